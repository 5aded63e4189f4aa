"""Antialiased bilinear resize of an image's centred square to S x S, and the c01b transpose, in C or numba.

The filter is Pillow's ``BILINEAR`` with a box (its ``precompute_coeffs``): a triangle whose
support is widened by the downscale factor, so that every source pixel counts (antialiasing).
Unlike Pillow, which filters horizontally first and rounds the intermediate image to uint8
(fixed point), both passes run in float64, vertical first, and only the result is rounded:
the output differs from Pillow's by at most 1 per value and is a plain function of the
input, reproduced exactly by the same arithmetic in numpy (see ``tests/prep``).

The kernels are C (:mod:`prep._c_kernels`: built on first use, once per machine, loaded in
~5 ms), or numba where no C compiler is found (:mod:`prep._numba_kernels`, ``cache=True``; its
import and registries cost a fresh process ~0.7 s of CPU); both release the GIL and give the
same pixels.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np

__all__ = ["Taps", "taps", "centre_box", "kernels", "resize_into", "transpose_into", "warm_up"]


class Taps(NamedTuple):
    """The filter along one axis: output i reads ``count[i]`` inputs from ``first[i]`` on.

    ``weight`` is (out, K) float64, K = ``count.max()``, zero beyond ``count[i]``.
    """

    first: np.ndarray
    count: np.ndarray
    weight: np.ndarray


@lru_cache(maxsize=1024)
def taps(in_size: int, box0: float, box1: float, out_size: int) -> Taps:
    """Pillow's bilinear coefficients for resampling ``[box0, box1)`` of ``in_size`` to ``out_size``.

    Parameters
    ----------
    in_size
        Input length (pixels).
    box0, box1
        The source interval, in pixel edges (may be fractional).
    out_size
        Output length.

    Returns
    -------
    Taps
        Read-only arrays, cached: most images of a data set share their sizes.
    """
    scale = (box1 - box0) / out_size
    filterscale = max(scale, 1.0)
    support = filterscale  # the triangle's support (1) widened when downscaling
    centre = box0 + (np.arange(out_size) + 0.5) * scale
    # int() truncates toward zero, as C's (int) in Pillow
    first = np.maximum((centre - support + 0.5).astype(np.int64), 0)
    last = np.minimum((centre + support + 0.5).astype(np.int64), in_size)
    count = last - first
    k = np.arange(max(int(count.max()), 1))
    x = ((k[None, :] + first[:, None]) - centre[:, None] + 0.5) * (1.0 / filterscale)
    weight = np.where(k[None, :] < count[:, None], np.maximum(1.0 - np.abs(x), 0.0), 0.0)
    total = np.zeros(out_size)
    for j in range(k.size):  # in order, as Pillow (numpy's sum pairs terms from 8 on)
        total += weight[:, j]
    weight = np.divide(weight, total[:, None], out=weight, where=total[:, None] != 0.0)
    for a in (first, count, weight):
        a.flags.writeable = False
    return Taps(first, count, weight)


def centre_box(width: int, height: int) -> tuple[float, float, float, float]:
    """The centred square of a ``width`` x ``height`` image (side = shorter side), as a box."""
    m = min(width, height)
    return ((width - m) / 2, (height - m) / 2, (width + m) / 2, (height + m) / 2)


@lru_cache(maxsize=1)
def kernels() -> Any:
    """The kernels in use: C where it builds, else numba (``$THEANOMPI_PREP_KERNELS=numba``
    forces numba). Each has ``resize``, ``transpose_bytes`` and ``transpose_words``."""
    from prep import _c_kernels

    found = _c_kernels.load()
    if found is not None:
        return found
    from prep import _numba_kernels

    return _numba_kernels


@lru_cache(maxsize=1024)
def _plan(h: int, w: int, ch: int, size: int) -> tuple[Any, ...]:
    """Per-geometry arrays for ``_resize``: the column window and the kernel's tap arrays."""
    x0, y0, x1, y1 = centre_box(w, h)
    ty, tx = taps(h, y0, y1, size), taps(w, x0, x1, size)
    c0 = int(tx.first[0])
    c1 = int((tx.first + tx.count).max())
    pos = ((tx.first - c0) * ch).astype(np.uint64)
    pos.flags.writeable = False
    return c0, c1, ty.first, ty.count, ty.weight, pos, tx.weight


def resize_into(src: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Resample the centred square of ``src`` into ``out`` (channel-first), in place.

    Parameters
    ----------
    src
        (h, w, 3) or (h, w, 4) uint8, C-contiguous, RGB first (a 4th channel is ignored:
        Pillow's own 4-byte RGB pixels can be used without a copy).
    out
        (3, S, S) uint8 (e.g. a slot of a batch); each of its rows must be contiguous.

    Returns
    -------
    numpy.ndarray
        ``out``.
    """
    h, w, ch = src.shape
    size = out.shape[1]
    bad_dtype = src.dtype != np.uint8 or out.dtype != np.uint8
    bad_shape = out.shape != (3, size, size) or (size > 1 and out.strides[2] != 1)
    if ch not in (3, 4) or bad_shape or bad_dtype:
        raise ValueError(
            f"need uint8 (h, w, 3|4) -> (3, S, S), got {src.dtype} {src.shape} -> "
            f"{out.dtype} {out.shape}"
        )
    c0, c1, ys, ny, wy, pos, wx = _plan(h, w, ch, size)
    rows = np.ascontiguousarray(src).reshape(h, w * ch)
    kernels().resize(rows, c0 * ch, (c1 - c0) * ch, np.uint64(ch), ys, ny, wy, pos, wx, out)
    return out


def transpose_into(stage: np.ndarray, out: np.ndarray) -> np.ndarray:
    """(B, 3, S, S) -> c01b (3, S, S, B), cache-blocked (numpy's strided copy is ~14x slower).

    Parameters
    ----------
    stage
        (B, ...) uint8, C-contiguous.
    out
        (..., B) uint8, C-contiguous, the same shape with the first axis moved last.

    Returns
    -------
    numpy.ndarray
        ``out``.
    """
    b = stage.shape[0]
    ok = stage.flags.c_contiguous and out.flags.c_contiguous and stage.dtype == out.dtype
    if not ok or out.shape != stage.shape[1:] + (b,) or stage.dtype != np.uint8:
        raise ValueError(f"cannot transpose {stage.dtype} {stage.shape} into {out.shape}")
    src, dst = stage.reshape(b, -1), out.reshape(-1, b)
    if np.little_endian and b % 8 == 0 and src.shape[1] % 8 == 0 and src.size:
        # whole 8x8 blocks: the word kernel on uint64 views (byte k of a word = k-th byte)
        kernels().transpose_words(src.view(np.uint64), dst.view(np.uint64))
    else:
        kernels().transpose_bytes(src, dst)
    return out


def warm_up() -> None:
    """Load (or build) the kernels and every specialisation the batch stage uses, untimed."""
    for ch in (3, 4):
        src = np.zeros((3, 5, ch), np.uint8)
        resize_into(src, np.zeros((3, 2, 2), np.uint8))
        src.flags.writeable = False  # np.asarray of a Pillow image is read-only
        resize_into(src, np.zeros((3, 2, 2), np.uint8))
    for b in (2, 8):  # the byte kernel, then the word kernel (3 * 2 * 4 and 8 divisible by 8)
        transpose_into(np.zeros((b, 3, 2, 4), np.uint8), np.zeros((3, 2, 4, b), np.uint8))
