"""decode: JPEGs straight into numpy (exactly Pillow's pixels), every other file the ordinary way."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from prep import decode


def test_direct_path_is_active() -> None:
    """This Pillow decodes JPEGs into our buffer (else every image pays a copy: slower, not wrong)."""
    assert decode.zero_copy_ok()


@pytest.mark.parametrize(("wh", "size"), [((500, 375), 256), ((23, 19), 16), ((640, 480), 64)])
@pytest.mark.parametrize("kw", [{}, {"progressive": True}, {"subsampling": 0}])
def test_plain_jpeg_decodes_into_numpy_exactly(fx, tmp_path: Path, wh, size: int, kw) -> None:
    path = tmp_path / "a.JPEG"
    path.write_bytes(fx.jpeg_bytes(fx.photo(*wh, 3), **kw))
    got = decode.decode(path, size)
    with Image.open(path) as im:
        im.draft("RGB", (size, size))  # 640x480 at 64: decoded at 1/4 scale by both
        ref = np.asarray(im)
    assert got.shape == ref.shape[:2] + (4,) and got.flags.c_contiguous
    np.testing.assert_array_equal(got[..., :3], ref)


def test_tree_jpegs_equal_pillows_pixels(fx, tree) -> None:
    """Every fixture file, whichever path it takes, gives Pillow's upright RGB pixels."""
    root, _ = tree
    for path in sorted((root / "train").rglob("*.JPEG")):
        if path.name.endswith("_9.JPEG"):
            continue  # the truncated one (scan drops it)
        got = decode.decode(path, fx.S)
        np.testing.assert_array_equal(got[..., :3], fx.reference_pixels(path, fx.S), str(path))


@pytest.mark.parametrize("mode", ["L", "CMYK"])
def test_grayscale_and_cmyk_jpeg(fx, tmp_path: Path, mode: str) -> None:
    path = tmp_path / f"{mode}.JPEG"
    path.write_bytes(fx.jpeg_bytes(fx.photo(26, 20, 1).convert(mode)))
    got = decode.decode(path, 16)
    with Image.open(path) as im:
        assert im.mode == mode
        ref = np.asarray(im.convert("RGB"))
    assert got.shape == (20, 26, 3)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("mode", ["RGBA", "P", "RGB"])
def test_png_named_jpeg(fx, tmp_path: Path, mode: str) -> None:
    path = tmp_path / "png.JPEG"
    fx.photo(20, 25, 2).convert(mode).save(path, format="PNG")
    got = decode.decode(path, 16)
    with Image.open(path) as im:
        assert im.format == "PNG"
        ref = np.asarray(im.convert("RGB"))
    assert got.shape == (25, 20, 3)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientations(fx, tmp_path: Path, orientation: int) -> None:
    exif = Image.Exif()
    exif[0x0112] = orientation
    path = tmp_path / f"o{orientation}.JPEG"
    path.write_bytes(fx.jpeg_bytes(fx.photo(30, 18, 13), exif=exif))
    got = decode.decode(path, 16)
    with Image.open(path) as im:
        ref = np.asarray(ImageOps.exif_transpose(im).convert("RGB"))
    assert ref.shape[:2] == ((30, 18) if orientation >= 5 else (18, 30))
    assert got.shape[2] == (4 if orientation == 1 else 3)  # 1 = upright: the direct path
    np.testing.assert_array_equal(got[..., :3], ref)


def test_truncated_jpeg_still_raises(fx, tmp_path: Path) -> None:
    """Bad files raise as before (scan skips them; batch reports one that slipped through)."""
    whole = fx.jpeg_bytes(fx.photo(64, 48, 30))
    path = tmp_path / "cut.JPEG"
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(OSError):
        decode.decode(path, 16)
    bad = tmp_path / "bad.JPEG"
    bad.write_bytes(b"this is not an image")
    with pytest.raises(OSError):
        decode.decode(bad, 16)
