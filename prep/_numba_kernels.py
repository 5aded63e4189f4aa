"""The numba kernels of :mod:`prep.resize` (compiled on first use, ``cache=True``), used where
no C compiler builds :mod:`prep._c_kernels`. Importing this module imports numba (~0.3 s), and
loading the kernels pulls in numba's registries (~0.35 s more): a fresh process pays both."""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

__all__ = ["resize", "transpose_bytes", "transpose_words"]

_jit = njit(nogil=True, cache=True, error_model="numpy", boundscheck=False)
_TILE = 64  # transpose tile side, in bytes (or 8-byte words): a tile stays in L1/L2


@_jit
def _vertical(
    src: Any, o: Any, n: Any, y: Any, count: Any, w: Any, r: Any
) -> None:  # pragma: no cover - compiled
    """r[:n] = sum over k < count of w[k] * src[y + k, o:o + n], the taps added in order.

    Slices indexed by the range variable vectorise (no negative-index checks); the usual tap
    counts are unrolled (one pass over ``r`` instead of one per tap, same additions).
    """
    if count == 3:
        s0 = src[y, o : o + n]
        s1 = src[y + 1, o : o + n]
        s2 = src[y + 2, o : o + n]
        w0, w1, w2 = w[0], w[1], w[2]
        for x in range(n):
            r[x] = w0 * s0[x] + w1 * s1[x] + w2 * s2[x]
    elif count == 2:
        s0 = src[y, o : o + n]
        s1 = src[y + 1, o : o + n]
        w0, w1 = w[0], w[1]
        for x in range(n):
            r[x] = w0 * s0[x] + w1 * s1[x]
    elif count == 4:
        s0 = src[y, o : o + n]
        s1 = src[y + 1, o : o + n]
        s2 = src[y + 2, o : o + n]
        s3 = src[y + 3, o : o + n]
        w0, w1, w2, w3 = w[0], w[1], w[2], w[3]
        for x in range(n):
            r[x] = w0 * s0[x] + w1 * s1[x] + w2 * s2[x] + w3 * s3[x]
    else:
        s = src[y, o : o + n]
        w0 = w[0]
        for x in range(n):
            r[x] = w0 * s[x]
        for k in range(1, count):
            s = src[y + k, o : o + n]
            wk = w[k]
            for x in range(n):
                r[x] += wk * s[x]


@_jit
def _horizontal(
    row: Any, ch: Any, pos: Any, wx: Any, o0: Any, o1: Any, o2: Any
) -> None:  # pragma: no cover - compiled
    """o_c[j] = round(sum over k of wx[j, k] * row[pos[j] + k * ch + c]), the taps in order.

    Unsigned offsets spare the negative-index checks (2x faster); the taps are zero-padded
    to ``wx.shape[1]`` (the row has room), and 3 or 4 of them are unrolled. No clipping:
    the weights are >= 0 and sum to 1, so 0 <= sum + 0.5 < 256.
    """
    kx = wx.shape[1]
    one, two = np.uint64(1), np.uint64(2)
    if kx == 3:
        for j in range(o0.shape[0]):
            p0 = pos[j]
            p1 = p0 + ch
            p2 = p1 + ch
            w0, w1, w2 = wx[j, 0], wx[j, 1], wx[j, 2]
            o0[j] = np.int32(w0 * row[p0] + w1 * row[p1] + w2 * row[p2] + 0.5)
            p0 += one
            p1 += one
            p2 += one
            o1[j] = np.int32(w0 * row[p0] + w1 * row[p1] + w2 * row[p2] + 0.5)
            p0 += one
            p1 += one
            p2 += one
            o2[j] = np.int32(w0 * row[p0] + w1 * row[p1] + w2 * row[p2] + 0.5)
    elif kx == 4:
        for j in range(o0.shape[0]):
            p0 = pos[j]
            p1 = p0 + ch
            p2 = p1 + ch
            p3 = p2 + ch
            w0, w1, w2, w3 = wx[j, 0], wx[j, 1], wx[j, 2], wx[j, 3]
            o0[j] = np.int32(w0 * row[p0] + w1 * row[p1] + w2 * row[p2] + w3 * row[p3] + 0.5)
            p0 += one
            p1 += one
            p2 += one
            p3 += one
            o1[j] = np.int32(w0 * row[p0] + w1 * row[p1] + w2 * row[p2] + w3 * row[p3] + 0.5)
            p0 += one
            p1 += one
            p2 += one
            p3 += one
            o2[j] = np.int32(w0 * row[p0] + w1 * row[p1] + w2 * row[p2] + w3 * row[p3] + 0.5)
    else:
        for j in range(o0.shape[0]):
            p = pos[j]
            w = wx[j, 0]
            a0 = w * row[p]
            a1 = w * row[p + one]
            a2 = w * row[p + two]
            for k in range(1, kx):
                p += ch
                w = wx[j, k]
                a0 += w * row[p]
                a1 += w * row[p + one]
                a2 += w * row[p + two]
            o0[j] = np.int32(a0 + 0.5)
            o1[j] = np.int32(a1 + 0.5)
            o2[j] = np.int32(a2 + 0.5)


@_jit
def resize(
    src: Any, o: Any, n: Any, ch: Any, ys: Any, ny: Any, wy: Any, pos: Any, wx: Any, out: Any
) -> None:  # pragma: no cover - compiled
    """src (h, w*ch) uint8 rows, read at [o, o+n); out (3, S, S) uint8; one output row at a time.

    The vertical pass of row i goes to a float64 row that stays in L1, which the horizontal
    pass then reads (no (S, w) intermediate image).
    """
    row = np.zeros(n + wx.shape[1] * ch + 4, np.float64)  # room for the zero-padded taps
    r = row[:n]
    for i in range(out.shape[1]):
        _vertical(src, o, n, ys[i], ny[i], wy[i], r)
        _horizontal(row, ch, pos, wx, out[0, i], out[1, i], out[2, i])


@_jit
def transpose_bytes(src: Any, dst: Any) -> None:  # pragma: no cover - compiled
    """dst (M, B) = src (B, M).T byte by byte, in tiles that stay in L1 (any shape)."""
    b_n, m_n = src.shape
    for m0 in range(0, m_n, _TILE):
        m1 = min(m0 + _TILE, m_n)
        for b0 in range(0, b_n, _TILE):
            b1 = min(b0 + _TILE, b_n)
            for m in range(m0, m1):
                d = dst[m, b0:b1]
                for b in range(b1 - b0):
                    d[b] = src[b0 + b, m]


_M1 = np.uint64(0x00FF00FF00FF00FF)
_M2 = np.uint64(0x0000FFFF0000FFFF)
_M4 = np.uint64(0x00000000FFFFFFFF)
_S8, _S16, _S32 = np.uint64(8), np.uint64(16), np.uint64(32)


@_jit
def transpose_words(src: Any, dst: Any) -> None:  # pragma: no cover - compiled
    """As ``transpose_bytes`` on uint64 views, src (B, M/8) -> dst (M, B/8): 8x8 byte blocks.

    Eight 8-byte words (8 images x 8 bytes) are transposed in registers by three rounds of
    masked swaps (2x2 bytes, 2x2 shorts, 2x2 ints): 8 loads and 8 stores per 64 bytes instead
    of 64 of each. Words are visited in tiles of ``_TILE`` so that the output rows of a tile
    (8 * _TILE rows of B bytes) are completed while in cache.
    """
    b_n, mw_n = src.shape
    for m0 in range(0, mw_n, _TILE):
        m1 = min(m0 + _TILE, mw_n)
        for b in range(0, b_n, 8):
            bw = b // 8
            s0 = src[b]
            s1 = src[b + 1]
            s2 = src[b + 2]
            s3 = src[b + 3]
            s4 = src[b + 4]
            s5 = src[b + 5]
            s6 = src[b + 6]
            s7 = src[b + 7]
            for m in range(m0, m1):
                x0 = s0[m]
                x1 = s1[m]
                x2 = s2[m]
                x3 = s3[m]
                x4 = s4[m]
                x5 = s5[m]
                x6 = s6[m]
                x7 = s7[m]
                t = ((x0 >> _S8) ^ x1) & _M1
                x1 ^= t
                x0 ^= t << _S8
                t = ((x2 >> _S8) ^ x3) & _M1
                x3 ^= t
                x2 ^= t << _S8
                t = ((x4 >> _S8) ^ x5) & _M1
                x5 ^= t
                x4 ^= t << _S8
                t = ((x6 >> _S8) ^ x7) & _M1
                x7 ^= t
                x6 ^= t << _S8
                t = ((x0 >> _S16) ^ x2) & _M2
                x2 ^= t
                x0 ^= t << _S16
                t = ((x1 >> _S16) ^ x3) & _M2
                x3 ^= t
                x1 ^= t << _S16
                t = ((x4 >> _S16) ^ x6) & _M2
                x6 ^= t
                x4 ^= t << _S16
                t = ((x5 >> _S16) ^ x7) & _M2
                x7 ^= t
                x5 ^= t << _S16
                t = ((x0 >> _S32) ^ x4) & _M4
                x4 ^= t
                x0 ^= t << _S32
                t = ((x1 >> _S32) ^ x5) & _M4
                x5 ^= t
                x1 ^= t << _S32
                t = ((x2 >> _S32) ^ x6) & _M4
                x6 ^= t
                x2 ^= t << _S32
                t = ((x3 >> _S32) ^ x7) & _M4
                x7 ^= t
                x3 ^= t << _S32
                r = 8 * m
                dst[r, bw] = x0
                dst[r + 1, bw] = x1
                dst[r + 2, bw] = x2
                dst[r + 3, bw] = x3
                dst[r + 4, bw] = x4
                dst[r + 5, bw] = x5
                dst[r + 6, bw] = x6
                dst[r + 7, bw] = x7
