"""decode: simplejpeg for plain JPEGs (Pillow's pixels, +-1 at most), Pillow for the rest, EXIF applied."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from prep import decode


def _pillow_pixels(path: Path, size: int) -> np.ndarray:
    """An independent reference: Pillow's draft decode, ``ImageOps.exif_transpose``, RGB."""
    with Image.open(path) as im:
        im.draft("RGB", (size, size))
        im = ImageOps.exif_transpose(im)
        return np.asarray(im.convert("RGBA" if "transparency" in im.info else "RGB").convert("RGB"))


def _close(got: np.ndarray, ref: np.ndarray, what: str = "") -> None:
    assert got.shape == ref.shape and got.dtype == np.uint8, what
    assert int(np.abs(got.astype(np.int16) - ref).max(initial=0)) <= 1, what


def _took_simplejpeg(path: Path, size: int) -> bool:
    return decode._simplejpeg(path.read_bytes(), size, decode.Scratch()) is not None


@pytest.mark.parametrize(
    ("wh", "size"), [((500, 375), 256), ((23, 19), 16), ((640, 480), 64), ((1100, 900), 256)]
)
@pytest.mark.parametrize("kw", [{}, {"progressive": True}, {"subsampling": 0}])
def test_plain_jpeg_matches_pillow(fx, tmp_path: Path, wh, size: int, kw) -> None:
    """simplejpeg takes it, at Pillow's DCT scale (640x480 at 64: 1/4, 1100x900 at 256: 1/2)."""
    path = tmp_path / "a.JPEG"
    path.write_bytes(fx.jpeg_bytes(fx.photo(*wh, 3), **kw))
    assert _took_simplejpeg(path, size)
    scratch = decode.Scratch()
    got = decode.decode(path, size, scratch)
    assert got.flags.c_contiguous
    f = decode.draft_factor(*wh, size)
    assert got.shape == (-(-wh[1] // f), -(-wh[0] // f), 3)
    _close(got, _pillow_pixels(path, size))
    assert np.shares_memory(got, scratch._flat)  # decoded straight into the reused buffer


def test_draft_factor_is_pillows() -> None:
    """The scale rule equals what ``Image.draft`` picks, over many sizes."""
    for w, h, s in [(500, 375, 256), (1024, 768, 256), (600, 512, 256), (4000, 3000, 256)]:
        data = io.BytesIO()
        Image.new("RGB", (w, h), (90, 20, 200)).save(data, "JPEG")
        with Image.open(data) as im:
            im.draft("RGB", (s, s))
            assert im.size == (
                -(-w // decode.draft_factor(w, h, s)),
                -(-h // decode.draft_factor(w, h, s)),
            )


def test_quirky_fixture_tree_matches_pillow(fx, tree) -> None:
    """Every fixture file (grayscale, CMYK, PNG-named-.JPEG, EXIF, tiny), whichever path it takes."""
    root, _ = tree
    files = sorted(root.rglob("*.JPEG"))
    assert len(files) >= 19
    for path in files:
        if path.name.endswith("_9.JPEG") or path.read_bytes().startswith(b"this"):
            continue  # truncated / not an image: scan drops them
        for size in (2, 4, 8, fx.S):
            _close(decode.decode(path, size), _pillow_pixels(path, size), f"{path} S={size}")


@pytest.mark.parametrize("mode", ["L", "CMYK"])
def test_grayscale_and_cmyk_jpeg(fx, tmp_path: Path, mode: str) -> None:
    """Grayscale goes through simplejpeg (gray -> RGB), CMYK through Pillow (Adobe inversion)."""
    path = tmp_path / f"{mode}.JPEG"
    path.write_bytes(fx.jpeg_bytes(fx.photo(26, 20, 1).convert(mode)))
    assert _took_simplejpeg(path, 16) == (mode == "L")
    got = decode.decode(path, 16)
    with Image.open(path) as im:
        assert im.mode == mode
        ref = np.asarray(im.convert("RGB"))
    assert got.shape == (20, 26, 3)
    _close(got, ref)


@pytest.mark.parametrize("mode", ["RGBA", "P", "RGB"])
def test_png_named_jpeg_falls_back(fx, tmp_path: Path, mode: str) -> None:
    path = tmp_path / "png.JPEG"
    fx.photo(20, 25, 2).convert(mode).save(path, format="PNG")
    assert not _took_simplejpeg(path, 16)
    got = decode.decode(path, 16)
    with Image.open(path) as im:
        assert im.format == "PNG"
        ref = np.asarray(im.convert("RGB"))
    np.testing.assert_array_equal(got, ref)


def test_jpeg_simplejpeg_rejects_falls_back_to_pillow(fx, tmp_path: Path) -> None:
    """Garbage before a marker: libjpeg warns, simplejpeg (strict) refuses, Pillow decodes it."""
    data = fx.jpeg_bytes(fx.photo(40, 30, 4))
    sos = data.index(b"\xff\xda")
    path = tmp_path / "extraneous.JPEG"
    path.write_bytes(data[:sos] + b"\x00\x00\x00" + data[sos:])
    assert not _took_simplejpeg(path, 16)
    assert decode.check(path) is None
    _close(decode.decode(path, 16), _pillow_pixels(path, 16))


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientations(fx, tmp_path: Path, orientation: int) -> None:
    exif = Image.Exif()
    exif[0x0112] = orientation
    path = tmp_path / f"o{orientation}.JPEG"
    path.write_bytes(fx.jpeg_bytes(fx.photo(30, 18, 13), exif=exif))
    assert decode.exif_orientation(path.read_bytes()) == orientation
    assert _took_simplejpeg(path, 16)
    got = decode.decode(path, 16)
    with Image.open(path) as im:
        ref = np.asarray(ImageOps.exif_transpose(im).convert("RGB"))
    assert ref.shape[:2] == ((30, 18) if orientation >= 5 else (18, 30))
    assert got.flags.c_contiguous
    _close(got, ref)


def test_exif_big_endian_and_absent(fx, tmp_path: Path) -> None:
    """A Motorola-order EXIF block is read too; no EXIF means upright."""
    entry = b"\x01\x12" + b"\x00\x03" + b"\x00\x00\x00\x01" + b"\x00\x08\x00\x00"  # SHORT 8
    tiff = b"MM\x00\x2a\x00\x00\x00\x08" + b"\x00\x01" + entry + b"\x00\x00\x00\x00"
    app1 = b"\xff\xe1" + (len(tiff) + 8).to_bytes(2, "big") + b"Exif\x00\x00" + tiff
    plain = fx.jpeg_bytes(fx.photo(30, 18, 5))
    assert decode.exif_orientation(plain) == 1
    path = tmp_path / "mm.JPEG"
    path.write_bytes(plain[:2] + app1 + plain[2:])
    with Image.open(path) as im:
        assert im.getexif().get(0x0112) == 8
    _close(decode.decode(path, 16), _pillow_pixels(path, 16))


def test_truncated_and_non_images_raise(fx, tmp_path: Path) -> None:
    """Bad files raise as before (scan skips them; batch reports one that slipped through)."""
    whole = fx.jpeg_bytes(fx.photo(64, 48, 30))
    path = tmp_path / "cut.JPEG"
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(OSError):
        decode.decode(path, 16)
    assert "truncated" in decode.check(path)
    bad = tmp_path / "bad.JPEG"
    bad.write_bytes(b"this is not an image")
    with pytest.raises(OSError):
        decode.decode(bad, 16)
    assert "UnidentifiedImageError" in decode.check(bad)
