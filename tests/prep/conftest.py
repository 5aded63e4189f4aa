"""Fixtures for the prep tests: a tiny ImageNet-layout tree with every real-world quirk."""

from __future__ import annotations

import io
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from PIL import Image, ImageOps

S = 16  # output side used by the tests
B = 4  # batch size used by the tests
WNIDS = ["n01000001", "n01000002", "n01000003"]


def _photo(w: int, h: int, seed: int) -> Image.Image:
    """A smooth colour image (gradients + a little noise): JPEG-friendly, content-rich."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    base = np.stack(
        [
            127 + 120 * np.sin(x / (3 + seed % 5) + seed),
            127 + 120 * np.cos(y / (4 + seed % 3)),
            255 * (x + y) / (w + h),
        ],
        axis=-1,
    )
    arr = np.clip(base + rng.normal(0, 8, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(arr)


def _jpeg_bytes(im: Image.Image, **kw: Any) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="JPEG", quality=90, **kw)
    return buf.getvalue()


def make_tree(root: Path, gt: str = "positional1") -> dict[str, Any]:
    """Build the fixture tree under ``root``; returns what a correct scan must find.

    train: n01000001 5 colour JPEGs of assorted sizes (incl. a 3x2 tiny one);
    n01000002 grayscale, CMYK, PNG-named-.JPEG, EXIF-rotated (orientation 6), colour;
    n01000003 4 colour + 1 truncated JPEG. val: 6 files, one not an image at all.
    ``gt``: positional1 | positional0 | named | wnid | folders.
    """
    train = root / "train"
    for w in WNIDS:
        (train / w).mkdir(parents=True)
    sizes = [(24, 18), (18, 30), (3, 2), (20, 20), (31, 17)]
    for i, (w, h) in enumerate(sizes):
        (train / WNIDS[0] / f"{WNIDS[0]}_{i}.JPEG").write_bytes(_jpeg_bytes(_photo(w, h, i)))
    d2 = train / WNIDS[1]
    (d2 / f"{WNIDS[1]}_0.JPEG").write_bytes(_jpeg_bytes(_photo(22, 28, 10).convert("L")))
    (d2 / f"{WNIDS[1]}_1.JPEG").write_bytes(_jpeg_bytes(_photo(26, 20, 11).convert("CMYK")))
    _photo(20, 25, 12).convert("RGBA").save(d2 / f"{WNIDS[1]}_2.JPEG", format="PNG")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    (d2 / f"{WNIDS[1]}_3.JPEG").write_bytes(_jpeg_bytes(_photo(30, 18, 13), exif=exif))
    (d2 / f"{WNIDS[1]}_4.JPEG").write_bytes(_jpeg_bytes(_photo(25, 19, 14)))
    d3 = train / WNIDS[2]
    for i in range(4):
        (d3 / f"{WNIDS[2]}_{i}.JPEG").write_bytes(_jpeg_bytes(_photo(21 + i, 17 + 2 * i, 20 + i)))
    whole = _jpeg_bytes(_photo(64, 48, 30))
    (d3 / f"{WNIDS[2]}_9.JPEG").write_bytes(whole[: len(whole) // 2])  # truncated
    (train / WNIDS[2] / ".DS_Store").write_bytes(b"junk")  # hidden: ignored
    val = root / "val"
    val.mkdir()
    val_labels = [2, 0, 1, 1, 0, 2]  # 0-based class of val file k
    names = [f"ILSVRC2012_val_{k + 1:08d}.JPEG" for k in range(len(val_labels))]
    for k, name in enumerate(names):
        target = val / WNIDS[val_labels[k]] / name if gt == "folders" else val / name
        target.parent.mkdir(exist_ok=True)
        if k == 3:
            target.write_bytes(b"this is not an image")
        else:
            target.write_bytes(_jpeg_bytes(_photo(23, 19 + k, 40 + k)))
    lines = {
        "positional1": [f"{lab + 1}" for lab in val_labels],
        "positional0": [f"{lab}" for lab in val_labels],
        "named": [f"{n} {lab}" for n, lab in reversed(list(zip(names, val_labels, strict=True)))],
        "wnid": [WNIDS[lab] for lab in val_labels],
    }
    if gt in lines:
        (root / "val_ground_truth.txt").write_text("\n".join(lines[gt]) + "\n")
    (root / "synset_words.txt").write_text(
        "".join(f"{w} thing {i}, object {i}\n" for i, w in enumerate(WNIDS)) + "n09999999 other\n"
    )
    good_val = [
        (f"val/{n}" if gt != "folders" else f"val/{WNIDS[lab]}/{n}", lab)
        for k, (n, lab) in enumerate(zip(names, val_labels, strict=True))
        if k != 3
    ]
    return {
        "n_train": 14,
        "n_val": 5,
        "skipped": {
            f"train/{WNIDS[2]}/{WNIDS[2]}_9.JPEG",
            (f"val/{WNIDS[1]}/{names[3]}" if gt == "folders" else f"val/{names[3]}"),
        },
        "val": sorted(good_val),
    }


def make_bad_tree(root: Path) -> dict[str, str]:
    """The fixture tree (val in class folders) plus every bad name a real tree can hold.

    Returns the printable relpath -> a word its skip reason must contain.
    """
    make_tree(root, "folders")
    w0, w1 = WNIDS[0], WNIDS[1]
    d = root / "train" / w0
    good = (d / f"{w0}_0.JPEG").read_bytes()
    (d / "a.JPEG").symlink_to("b.JPEG")  # a.JPEG -> b.JPEG -> a.JPEG
    (d / "b.JPEG").symlink_to("a.JPEG")
    (d / "gone.JPEG").symlink_to("nowhere.JPEG")
    fd = os.open(os.fsencode(d) + b"/bad\xff\xfe.JPEG", os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, good)
    os.close(fd)
    (d / "new\nline.JPEG").write_bytes(good)
    (d / "line\u2028sep.JPEG").write_bytes(good)
    (root / "val" / w1 / "para\u2029sep.JPEG").write_bytes(good)
    return {
        f"train/{w0}/a.JPEG": "symlink loop",
        f"train/{w0}/b.JPEG": "symlink loop",
        f"train/{w0}/gone.JPEG": "broken symlink",
        f"train/{w0}/bad\\xff\\xfe.JPEG": "not valid UTF-8",
        f"train/{w0}/new\\nline.JPEG": "line break",
        f"train/{w0}/line\\u2028sep.JPEG": "line break",
        f"val/{w1}/para\\u2029sep.JPEG": "line break",
    }


def reference_decode(path: Path, size: int = S) -> np.ndarray:
    """An independent decode: EXIF transpose, RGB, shorter side to S and centre crop (ImageOps.fit)."""
    with Image.open(path) as im:
        im = ImageOps.exif_transpose(im).convert("RGB")
        return np.asarray(ImageOps.fit(im, (size, size), Image.Resampling.BILINEAR))


def bilinear_taps(n_in: int, b0: float, b1: float, n_out: int) -> list[tuple[int, list[float]]]:
    """Pillow's ``precompute_coeffs`` for its bilinear filter, plainly: (first input, weights) per output."""
    scale = (b1 - b0) / n_out
    fs = max(scale, 1.0)  # the triangle widens when downscaling (antialias); support = fs
    rows = []
    for i in range(n_out):
        centre = b0 + (i + 0.5) * scale
        lo = max(int(centre - fs + 0.5), 0)
        hi = min(int(centre + fs + 0.5), n_in)
        w = [max(0.0, 1.0 - abs((x - centre + 0.5) * (1.0 / fs))) for x in range(lo, hi)]
        total = 0.0
        for v in w:  # summed in order, as Pillow
            total += v
        rows.append((lo, [v / total for v in w]))
    return rows


def reference_resize(img: np.ndarray, size: int) -> np.ndarray:
    """(h, w, 3) uint8 -> (S, S, 3): the centred square through ``bilinear_taps`` in float64.

    Vertical pass, then horizontal, taps added in order, rounded once (floor(x + 0.5)).
    """
    h, w = img.shape[:2]
    m = min(w, h)
    src = img[..., :3].astype(np.float64)
    tmp = np.empty((size, w, 3))
    for i, (lo, ws) in enumerate(bilinear_taps(h, (h - m) / 2, (h + m) / 2, size)):
        acc = ws[0] * src[lo]
        for k in range(1, len(ws)):
            acc = acc + ws[k] * src[lo + k]
        tmp[i] = acc
    out = np.empty((size, size, 3))
    for j, (lo, ws) in enumerate(bilinear_taps(w, (w - m) / 2, (w + m) / 2, size)):
        acc = ws[0] * tmp[:, lo]
        for k in range(1, len(ws)):
            acc = acc + ws[k] * tmp[:, lo + k]
        out[:, j] = acc
    return np.clip(np.floor(out + 0.5), 0, 255).astype(np.uint8)


def reference_pixels(path: Path, size: int) -> np.ndarray:
    """Pillow's ordinary decode (same JPEG draft as prep), EXIF transpose, RGB: (h, w, 3)."""
    with Image.open(path) as im:
        im.draft("RGB", (size, size))
        im = ImageOps.exif_transpose(im)
        return np.asarray(im.convert("RGBA" if "transparency" in im.info else "RGB").convert("RGB"))


def float_reference(path: Path, size: int = S) -> np.ndarray:
    """What ``prep`` must produce, exactly: ``reference_pixels`` through ``reference_resize``."""
    return reference_resize(reference_pixels(path, size), size)


@pytest.fixture(scope="session")
def fx() -> SimpleNamespace:
    """The helpers above, as a fixture (works under any pytest import mode)."""
    return SimpleNamespace(
        S=S,
        B=B,
        WNIDS=WNIDS,
        make_tree=make_tree,
        make_bad_tree=make_bad_tree,
        reference_decode=reference_decode,
        float_reference=float_reference,
        reference_pixels=reference_pixels,
        reference_resize=reference_resize,
        bilinear_taps=bilinear_taps,
        photo=_photo,
        jpeg_bytes=_jpeg_bytes,
    )


@pytest.fixture(scope="session")
def tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("tree")
    return root, make_tree(root)


@pytest.fixture(scope="session")
def prepped(tree: tuple[Path, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fixture tree run through every stage in this process (1 rank), c01b, S=16, B=4."""
    from prep import batch, labels, mean, scan, shuffle, verify

    out = tmp_path_factory.mktemp("data")
    scan.run(tree[0], out)
    shuffle.run(out, seed=7)
    batch.run(out, batch_size=B, size=S, layout="c01b", progress=False)
    mean.run(out)
    labels.run(out)
    verify.run(out)
    return out
