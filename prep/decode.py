"""Decode an image file into an upright RGB uint8 array: simplejpeg (libjpeg-turbo) first, Pillow for the rest.

A JPEG in YCbCr, grayscale or RGB (nearly all of ImageNet) is decoded by ``simplejpeg``
straight into a reused buffer, at the scale Pillow's ``Image.draft`` would choose (1/2, 1/4 or
1/8 only where both sides stay >= S, i.e. where the short side is >= 2S: the full-size decode
is SIMD, the other M/8 scales are not), then turned upright by its EXIF orientation. Everything
else goes through Pillow's ordinary path (draft, transpose, convert to RGB): CMYK/YCCK JPEGs
(Adobe inversion), PNG or other content under any name, and any JPEG that simplejpeg rejects
(it is strict about recoverable errors that Pillow tolerates). Both paths use libjpeg-turbo's
accurate IDCT and fancy upsampling, so their pixels agree (``tests/prep/test_prep_decode.py``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import numpy as np
import simplejpeg

__all__ = [
    "ORIENTATIONS",
    "Scratch",
    "decode",
    "draft_factor",
    "exif_orientation",
    "check",
    "check_bytes",
]

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
_SIMPLE_COLOURSPACES = frozenset({"YCbCr", "Gray", "RGB"})  # CMYK/YCCK: Pillow (Adobe inversion)


class Scratch:
    """One growing buffer handed out as (h, w, 3) views: decode after decode, no new pages.

    A fresh 0.56 MB array per image costs page faults and zeroing on every first touch;
    a view of this one is only valid until the next call.
    """

    def __init__(self) -> None:
        self._flat = np.empty(0, dtype=np.uint8)

    def __call__(self, h: int, w: int) -> np.ndarray:
        """A C-contiguous (h, w, 3) uint8 view (contents undefined)."""
        if self._flat.size < h * w * 3:
            self._flat = np.empty(h * w * 3, dtype=np.uint8)
        return self._flat[: h * w * 3].reshape(h, w, 3)


def _new_buffer(h: int, w: int) -> np.ndarray:
    return np.empty((h, w, 3), dtype=np.uint8)


def draft_factor(width: int, height: int, size: int) -> int:
    """The JPEG DCT scale divisor Pillow's ``draft(mode, (size, size))`` picks: 8, 4, 2 or 1.

    >>> draft_factor(500, 375, 256), draft_factor(1024, 768, 256), draft_factor(4000, 3000, 256)
    (1, 2, 8)
    """
    scale = min(width // size, height // size) if size > 0 else 1
    for s in (8, 4, 2):
        if scale >= s:
            return s
    return 1


def _tiff_orientation(tiff: bytes) -> int:
    """Tag 0x0112 of IFD0 in a TIFF (EXIF) block, 1 when absent or malformed."""
    if tiff[:2] == b"II":
        order = "little"
    elif tiff[:2] == b"MM":
        order = "big"
    else:
        return 1
    ifd = int.from_bytes(tiff[4:8], order)
    if ifd + 2 > len(tiff):
        return 1
    for k in range(int.from_bytes(tiff[ifd : ifd + 2], order)):
        e = ifd + 2 + 12 * k
        if e + 12 > len(tiff):
            return 1
        if int.from_bytes(tiff[e : e + 2], order) != 0x0112:
            continue
        kind = int.from_bytes(tiff[e + 2 : e + 4], order)
        width = {3: 2, 4: 4}.get(kind)  # SHORT (the standard) or LONG
        return int.from_bytes(tiff[e + 8 : e + 8 + width], order) if width else 1
    return 1


def exif_orientation(data: bytes) -> int:
    """The EXIF orientation (1..8) of JPEG bytes, read from the first ``Exif`` APP1 as Pillow does.

    Only the markers before the first scan are walked: no decoding. 1 when there is none.

    >>> exif_orientation(b"\\xff\\xd8\\xff\\xd9")
    1
    """
    i, n = 2, len(data)
    while i + 4 <= n and data[i] == 0xFF:
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0x01, 0xD8) or 0xD0 <= marker <= 0xD7:  # no length field
            i += 2
            continue
        if marker in (0xDA, 0xD9):  # start of scan / end of image
            break
        length = int.from_bytes(data[i + 2 : i + 4], "big")
        if marker == 0xE1 and data[i + 4 : i + 10] == b"Exif\0\0":
            return _tiff_orientation(data[i + 10 : i + 2 + length])
        i += 2 + length
    return 1


def _upright(arr: np.ndarray, orientation: int) -> np.ndarray:
    """``arr`` (h, w, 3) turned as Pillow's ``Image.transpose(ORIENTATIONS[orientation])``."""
    if orientation == 2:
        arr = arr[:, ::-1]
    elif orientation == 3:
        arr = arr[::-1, ::-1]
    elif orientation == 4:
        arr = arr[::-1]
    elif orientation == 5:
        arr = arr.transpose(1, 0, 2)
    elif orientation == 6:
        arr = arr.transpose(1, 0, 2)[:, ::-1]
    elif orientation == 7:
        arr = arr.transpose(1, 0, 2)[::-1, ::-1]
    elif orientation == 8:
        arr = arr.transpose(1, 0, 2)[::-1]
    return np.ascontiguousarray(arr)


def _simplejpeg(
    data: bytes, size: int, buffer: Callable[[int, int], np.ndarray]
) -> np.ndarray | None:
    """The simplejpeg decode, or None for a file it should not or cannot take (Pillow's then)."""
    try:
        h, w, colourspace, _ = simplejpeg.decode_jpeg_header(data)
        if colourspace not in _SIMPLE_COLOURSPACES or w < 1 or h < 1:
            return None
        f = draft_factor(w, h, size)
        oh, ow = -(-h // f), -(-w // f)
        scaled = {"min_height": oh, "min_width": ow, "min_factor": f} if f > 1 else {}
        arr = simplejpeg.decode_jpeg(data, "RGB", buffer=buffer(oh, ow), strict=True, **scaled)
        if arr.shape != (oh, ow, 3):  # a scale other than Pillow's: let Pillow decide
            return None
        orientation = exif_orientation(data)
    except Exception:  # noqa: BLE001 - anything simplejpeg rejects goes to Pillow
        return None
    return _upright(arr, orientation) if orientation in ORIENTATIONS else arr


def _pillow(path: str | os.PathLike[str], size: int) -> np.ndarray:
    """Pillow's ordinary path: draft, EXIF transpose, RGB (via RGBA when transparent)."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with Image.open(path) as im:
            im.draft("RGB", (size, size))  # JPEG: DCT-scale while both sides stay >= size
            orientation = im.getexif().get(0x0112, 1)
            im.load()
            if orientation in ORIENTATIONS:
                im = im.transpose(getattr(Image.Transpose, ORIENTATIONS[orientation]))
            if im.mode != "RGB":
                im = im.convert("RGBA" if "transparency" in im.info else "RGB").convert("RGB")
            return np.asarray(im)


def decode(
    path: str | os.PathLike[str], size: int, buffer: Callable[[int, int], np.ndarray] | None = None
) -> np.ndarray:
    """Decode ``path`` into an upright RGB array, JPEGs DCT-scaled while both sides stay >= ``size``.

    Parameters
    ----------
    path
        Image file (JPEG, or anything Pillow reads).
    size
        The output side S the image will be resized to (picks the DCT scale).
    buffer
        ``buffer(h, w)`` gives the (h, w, 3) uint8 array a JPEG is decoded into (e.g. a
        ``Scratch``); default a new array.

    Returns
    -------
    numpy.ndarray
        (h, w, 3) uint8, C-contiguous (possibly a view of ``buffer``'s array).

    Raises
    ------
    OSError
        When neither decoder can read the file (Pillow's error).
    """
    with open(path, "rb", buffering=0) as fh:  # unbuffered: one read into one bytes object
        data = fh.readall()
    if data[:2] == b"\xff\xd8":
        arr = _simplejpeg(data, size, buffer or _new_buffer)
        if arr is not None:
            return arr
    return _pillow(path, size)


def check(path: str | os.PathLike[str]) -> str | None:
    """None when ``path`` decodes, else a one-line reason (truncated, not an image, ...).

    JPEGs are decoded at 1/8 scale (DCT scaling): every entropy-coded byte is still read,
    so truncation and corrupt data are caught at a fraction of the cost of a full decode.
    simplejpeg first; what it rejects is left to Pillow, which :func:`decode` falls back to.
    """
    try:
        with open(path, "rb", buffering=0) as fh:  # unbuffered: one read, no pathlib (1.3 M files)
            data = fh.readall()
    except OSError as err:
        return f"cannot read: {err.strerror or err}"
    return check_bytes(data)


def check_bytes(data: bytes | memoryview) -> str | None:
    """:func:`check` of a file's content (bytes or a memoryview of a reused buffer)."""
    if bytes(data[:2]) == b"\xff\xd8":
        try:  # 1/8 scale (the smallest >= 1x1 with a factor >= 8); CMYK/YCCK raise: Pillow's
            simplejpeg.decode_jpeg(data, "GRAY", min_height=1, min_width=1, min_factor=8)
            return None
        except Exception:  # noqa: BLE001 - let Pillow decide (and word the reason)
            pass
    import io

    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(bytes(data))) as im:
                w, h = im.size
                if w < 1 or h < 1:
                    return "empty image"
                im.draft(im.mode, (max(1, w // 8), max(1, h // 8)))
                im.load()
    except Image.UnidentifiedImageError:  # its message names our BytesIO object: useless
        return "UnidentifiedImageError: not an image in a format Pillow reads"
    except Exception as err:  # noqa: BLE001 - any decode failure means: skip this file
        text = str(err).strip().splitlines()
        return f"{type(err).__name__}: {text[0] if text else ''}".strip()
    return None
