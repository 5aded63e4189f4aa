"""Decode an image file into an upright RGB uint8 array with Pillow, straight into numpy for plain JPEGs.

A colour JPEG without an EXIF rotation (nearly all of ImageNet) is decoded by Pillow's JPEG
decoder directly into a numpy buffer: Pillow keeps RGB as 4 bytes per pixel (RGB + padding),
so the buffer is (h, w, 4), and ``np.asarray`` of the image (which packs it to 3 bytes per
pixel, as long as the decode itself) is never needed. Everything else (grayscale, CMYK,
palette/RGBA, a PNG under a .JPEG name, an EXIF orientation) goes through Pillow's ordinary
path, transposed and converted to RGB, then ``np.asarray``: (h, w, 3).
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import numpy as np

__all__ = ["ORIENTATIONS", "Scratch", "decode", "zero_copy_ok"]

# EXIF orientation -> Image.Transpose member name (as ImageOps.exif_transpose)
ORIENTATIONS = {
    2: "FLIP_LEFT_RIGHT",
    3: "ROTATE_180",
    4: "FLIP_TOP_BOTTOM",
    5: "TRANSPOSE",
    6: "ROTATE_270",
    7: "TRANSVERSE",
    8: "ROTATE_90",
}


class Scratch:
    """One growing buffer handed out as (h, w, 4) views: decode after decode, no new pages.

    A fresh 0.75 MB array per image costs page faults and zeroing on every first touch;
    a view of this one is only valid until the next call.
    """

    def __init__(self) -> None:
        self._flat = np.empty(0, dtype=np.uint8)

    def __call__(self, h: int, w: int) -> np.ndarray:
        """A C-contiguous (h, w, 4) uint8 view (contents undefined)."""
        if self._flat.size < h * w * 4:
            self._flat = np.empty(h * w * 4, dtype=np.uint8)
        return self._flat[: h * w * 4].reshape(h, w, 4)


def _new_buffer(h: int, w: int) -> np.ndarray:
    return np.empty((h, w, 4), dtype=np.uint8)


def _into_numpy(im: Any, buffer: Callable[[int, int], np.ndarray] = _new_buffer) -> np.ndarray:
    """Load a JPEG ``im`` (mode RGB) into ``buffer(h, w)``, (h, w, 4); (h, w, 3) if Pillow would not.

    ``ImageFile.load`` decodes into ``im.im`` when one of the right mode and size is already
    there, so a core image mapped onto our buffer receives the pixels. Should a Pillow version
    replace it anyway, the decoded image is still correct and is read back the ordinary way.
    """
    from PIL import Image

    w, h = im.size
    buf = buffer(h, w)
    core = Image.core.map_buffer(buf, (w, h), "raw", 0, ("RGB", 0, 1))
    im.im = core
    im.load()
    if im.im is not core:  # pragma: no cover - a Pillow that allocates its own image
        return np.asarray(im)
    return buf


@lru_cache(maxsize=1)
def zero_copy_ok() -> bool:
    """Whether this Pillow decodes into a numpy buffer pixel-identically (checked once per process).

    The check decodes a small in-memory JPEG both ways; any difference or error (another
    internal pixel layout, a missing ``map_buffer``) turns the direct path off for good.
    """
    from PIL import Image

    try:
        rng = np.random.default_rng(0)
        data = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (9, 13, 3), dtype=np.uint8)).save(data, "JPEG")
        with Image.open(io.BytesIO(data.getvalue())) as im:
            ref = np.asarray(im)
        with Image.open(io.BytesIO(data.getvalue())) as im:
            got = _into_numpy(im)
        return got.shape[:2] == ref.shape[:2] and np.array_equal(got[..., :3], ref)
    except Exception:  # noqa: BLE001 - any failure: use the ordinary path
        return False


def decode(
    path: str | os.PathLike[str], size: int, buffer: Callable[[int, int], np.ndarray] | None = None
) -> np.ndarray:
    """Decode ``path`` into an upright RGB array, JPEGs DCT-scaled while both sides stay >= ``size``.

    Parameters
    ----------
    path
        Image file (JPEG, or anything Pillow reads).
    size
        The output side S the image will be resized to (for ``Image.draft``).
    buffer
        ``buffer(h, w)`` gives the (h, w, 4) uint8 array a plain JPEG is decoded into (e.g. a
        ``Scratch``); default a new array.

    Returns
    -------
    numpy.ndarray
        (h, w, 4) uint8 (RGB + an unused 4th byte) for a colour JPEG without EXIF rotation,
        else (h, w, 3); C-contiguous either way.
    """
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with Image.open(path) as im:
            im.draft("RGB", (size, size))  # JPEG: DCT-scale while both sides stay >= size
            orientation = im.getexif().get(0x0112, 1)
            if (
                im.format == "JPEG"
                and im.mode == "RGB"
                and orientation not in ORIENTATIONS
                and zero_copy_ok()
            ):
                return _into_numpy(im, buffer or _new_buffer)
            im.load()
            if orientation in ORIENTATIONS:
                im = im.transpose(getattr(Image.Transpose, ORIENTATIONS[orientation]))
            if im.mode != "RGB":
                im = im.convert("RGBA" if "transparency" in im.info else "RGB").convert("RGB")
            return np.asarray(im)
