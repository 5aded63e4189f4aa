"""The kernels of :mod:`prep.resize` in C: built once per machine with ``cc``, loaded with ctypes.

The same arithmetic as :mod:`prep._numba_kernels`, term by term and in the same order, in
IEEE double (``-ffp-contract=off``, no fast-math), so the pixels are identical; a fresh
process loads a ~20 KB library (~5 ms) instead of importing numba and its registries (~0.7 s
of CPU). The library is kept under ``$THEANOMPI_CACHE/prep`` (default ``~/.cache/theanompi``),
named by a hash of this source, the flags and the CPU (``-march=native``); it is built into a
temporary name and renamed, so ranks building at once never load a half-written file.
:func:`load` returns None where no compiler builds it (the caller uses numba then); a failed
build is marked beside it and not tried again by every process (delete the marker to retry).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["SOURCE", "FLAGS", "CKernels", "library_path", "load"]

SOURCE = r"""
#include <stdint.h>

typedef uint8_t u8;
typedef int64_t i64;
typedef uint64_t u64;

/* r[:n] = sum over k < count of w[k] * src[y + k, o:o + n], the taps added in order */
static void vertical(const u8 *src, i64 stride, i64 o, i64 n, i64 y, i64 count,
                     const double *w, double *restrict r) {
    const u8 *s0 = src + y * stride + o;
    if (count == 3) {
        const u8 *s1 = s0 + stride, *s2 = s1 + stride;
        double w0 = w[0], w1 = w[1], w2 = w[2];
        for (i64 x = 0; x < n; x++) r[x] = w0 * s0[x] + w1 * s1[x] + w2 * s2[x];
    } else if (count == 2) {
        const u8 *s1 = s0 + stride;
        double w0 = w[0], w1 = w[1];
        for (i64 x = 0; x < n; x++) r[x] = w0 * s0[x] + w1 * s1[x];
    } else if (count == 4) {
        const u8 *s1 = s0 + stride, *s2 = s1 + stride, *s3 = s2 + stride;
        double w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
        for (i64 x = 0; x < n; x++) r[x] = w0 * s0[x] + w1 * s1[x] + w2 * s2[x] + w3 * s3[x];
    } else {
        double w0 = w[0];
        for (i64 x = 0; x < n; x++) r[x] = w0 * s0[x];
        for (i64 k = 1; k < count; k++) {
            const u8 *s = s0 + k * stride;
            double wk = w[k];
            for (i64 x = 0; x < n; x++) r[x] += wk * s[x];
        }
    }
}

/* o_c[j] = (int32) (sum over k of wx[j, k] * row[pos[j] + k * ch + c] + 0.5), taps in order */
static void horizontal(const double *row, u64 ch, const u64 *pos, const double *wx, i64 kx,
                       i64 size, u8 *o0, u8 *o1, u8 *o2) {
    for (i64 j = 0; j < size; j++) {
        const double *p = row + pos[j];
        const double *w = wx + j * kx;
        double a0 = w[0] * p[0], a1 = w[0] * p[1], a2 = w[0] * p[2];
        for (i64 k = 1; k < kx; k++) {
            p += ch;
            a0 += w[k] * p[0];
            a1 += w[k] * p[1];
            a2 += w[k] * p[2];
        }
        o0[j] = (u8)(int32_t)(a0 + 0.5);
        o1[j] = (u8)(int32_t)(a1 + 0.5);
        o2[j] = (u8)(int32_t)(a2 + 0.5);
    }
}

/* src (h, stride) uint8 rows read at [o, o + n); out (3, size, size) with row and channel
   strides in bytes; row: n + kx * ch + 4 doubles, zeroed (the padded taps read zeros) */
void tmpi_resize(const u8 *src, i64 stride, i64 o, i64 n, i64 ch, const i64 *ys,
                 const i64 *ny, const double *wy, i64 ky, const u64 *pos, const double *wx,
                 i64 kx, u8 *out, i64 size, i64 cstride, i64 rstride, double *row) {
    for (i64 i = 0; i < size; i++) {
        vertical(src, stride, o, n, ys[i], ny[i], wy + i * ky, row);
        u8 *d = out + i * rstride;
        horizontal(row, (u64)ch, pos, wx, kx, size, d, d + cstride, d + 2 * cstride);
    }
}

#define TILE 64

/* dst (m_n, b_n) = src (b_n, m_n).T byte by byte, in tiles */
void tmpi_transpose_bytes(const u8 *src, u8 *dst, i64 b_n, i64 m_n) {
    for (i64 m0 = 0; m0 < m_n; m0 += TILE) {
        i64 m1 = m0 + TILE < m_n ? m0 + TILE : m_n;
        for (i64 b0 = 0; b0 < b_n; b0 += TILE) {
            i64 b1 = b0 + TILE < b_n ? b0 + TILE : b_n;
            for (i64 m = m0; m < m1; m++)
                for (i64 b = b0; b < b1; b++) dst[m * b_n + b] = src[b * m_n + m];
        }
    }
}

#define SWAP(a, b, s, mask) \
    do { u64 t = (((a) >> (s)) ^ (b)) & (mask); (b) ^= t; (a) ^= t << (s); } while (0)

/* src (b_n, mw_n) words -> dst (8 * mw_n, b_n / 8) words: 8x8-byte blocks in registers */
void tmpi_transpose_words(const u64 *src, u64 *dst, i64 b_n, i64 mw_n) {
    const u64 M1 = 0x00FF00FF00FF00FFull, M2 = 0x0000FFFF0000FFFFull;
    const u64 M4 = 0x00000000FFFFFFFFull;
    i64 bw_n = b_n / 8;
    for (i64 m0 = 0; m0 < mw_n; m0 += TILE) {
        i64 m1 = m0 + TILE < mw_n ? m0 + TILE : mw_n;
        for (i64 b = 0; b < b_n; b += 8) {
            i64 bw = b / 8;
            const u64 *s = src + b * mw_n;
            for (i64 m = m0; m < m1; m++) {
                u64 x0 = s[m], x1 = s[mw_n + m], x2 = s[2 * mw_n + m], x3 = s[3 * mw_n + m];
                u64 x4 = s[4 * mw_n + m], x5 = s[5 * mw_n + m], x6 = s[6 * mw_n + m];
                u64 x7 = s[7 * mw_n + m];
                SWAP(x0, x1, 8, M1); SWAP(x2, x3, 8, M1); SWAP(x4, x5, 8, M1); SWAP(x6, x7, 8, M1);
                SWAP(x0, x2, 16, M2); SWAP(x1, x3, 16, M2); SWAP(x4, x6, 16, M2);
                SWAP(x5, x7, 16, M2);
                SWAP(x0, x4, 32, M4); SWAP(x1, x5, 32, M4); SWAP(x2, x6, 32, M4);
                SWAP(x3, x7, 32, M4);
                u64 *d = dst + 8 * m * bw_n + bw;
                d[0] = x0; d[bw_n] = x1; d[2 * bw_n] = x2; d[3 * bw_n] = x3;
                d[4 * bw_n] = x4; d[5 * bw_n] = x5; d[6 * bw_n] = x6; d[7 * bw_n] = x7;
            }
        }
    }
}
"""

FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC")
DISABLE_ENV = "THEANOMPI_PREP_KERNELS"  # "numba": never build or load the C kernels


def _cpu() -> str:
    """What ``-march=native`` depends on: the CPU's model and flags (Linux), else its name."""
    try:
        with open("/proc/cpuinfo", "rb") as fh:
            text = fh.read(1 << 16).decode(errors="replace")
        keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
        return "\n".join(keep[:2])
    except OSError:
        return platform.processor() or platform.machine()


def library_path() -> Path:
    """Where this machine's build of :data:`SOURCE` lives (it may not exist yet)."""
    from theanompi.pytensor_env import cache_root

    base = cache_root()
    key = "\0".join([SOURCE, " ".join(FLAGS), sys.platform, platform.machine(), _cpu()])
    return base / "prep" / f"kernels-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def _build(path: Path, cc: str) -> None:
    """Compile :data:`SOURCE` with ``cc`` into ``path`` (a temporary name, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    src = tmp.with_suffix(".c")
    try:
        src.write_text(SOURCE)
        subprocess.run(
            [cc, *FLAGS, "-o", str(tmp), str(src)], check=True, capture_output=True, timeout=120
        )
        os.replace(tmp, path)
    finally:
        src.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)


_P = ctypes.c_void_p
_I = ctypes.c_int64


class CKernels:
    """The library's three kernels, called with numpy arrays (ctypes releases the GIL)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._resize = lib.tmpi_resize
        self._resize.argtypes = [_P, _I, _I, _I, _I, _P, _P, _P, _I, _P, _P, _I, _P, _I, _I, _I, _P]
        self._resize.restype = None
        self._bytes = lib.tmpi_transpose_bytes
        self._bytes.argtypes = [_P, _P, _I, _I]
        self._bytes.restype = None
        self._words = lib.tmpi_transpose_words
        self._words.argtypes = [_P, _P, _I, _I]
        self._words.restype = None

    def resize(
        self, src: Any, o: int, n: int, ch: int, ys: Any, ny: Any, wy: Any, pos: Any, wx: Any,
        out: Any,
    ) -> None:  # fmt: skip
        """As ``prep._numba_kernels.resize``: ``src`` (h, w*ch) C-contiguous rows; ``out``
        (3, S, S) with contiguous rows."""
        row = np.zeros(n + wx.shape[1] * ch + 4, np.float64)
        size = out.shape[1]
        self._resize(
            src.ctypes.data, src.strides[0], o, n, ch, ys.ctypes.data, ny.ctypes.data,
            wy.ctypes.data, wy.shape[1], pos.ctypes.data, wx.ctypes.data, wx.shape[1],
            out.ctypes.data, size, out.strides[0], out.strides[1], row.ctypes.data,
        )  # fmt: skip

    def transpose_bytes(self, src: Any, dst: Any) -> None:
        """dst (M, B) = src (B, M).T, both C-contiguous uint8."""
        self._bytes(src.ctypes.data, dst.ctypes.data, src.shape[0], src.shape[1])

    def transpose_words(self, src: Any, dst: Any) -> None:
        """As ``transpose_bytes`` on uint64 views: src (B, M/8) -> dst (M, B/8)."""
        self._words(src.ctypes.data, dst.ctypes.data, src.shape[0], src.shape[1])


def load() -> CKernels | None:
    """This machine's C kernels, built on first use; None without a compiler (or when
    ``$THEANOMPI_PREP_KERNELS`` is ``numba``)."""
    if os.environ.get(DISABLE_ENV, "").strip().lower() == "numba":
        return None
    path = library_path()
    cc = os.environ.get("CC", "cc")
    failed = path.with_name(f"{path.stem}.failed-{Path(cc).name}")  # not retried by each process
    try:
        if not path.exists():
            if failed.exists():
                return None
            try:
                _build(path, cc)
            except (OSError, subprocess.SubprocessError):
                failed.parent.mkdir(parents=True, exist_ok=True)
                failed.touch()
                raise
        return CKernels(ctypes.CDLL(str(path)))
    except (OSError, subprocess.SubprocessError):
        return None
