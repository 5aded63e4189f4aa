"""Local compute of the exchangers: float16 conversion, sums of received chunks and pairs.

numpy converts float32<->float16 one element at a time in software (~6 ns/element here),
which would cost more than float16 saves on the wire. These kernels are compiled with numba
(a PyTensor dependency) using LLVM's ``fptrunc``/``fpext`` to ``half``, which become the F16C
``vcvtps2ph``/``vcvtph2ps`` instructions and are vectorised: ~12x faster and bit-identical to
numpy (round to nearest even; inf and nan kept). float16 data is held as ``uint16`` bit
patterns because numba has no CPU float16 type. If numba is missing or the compiled kernels
disagree with numpy on a self-test, the numpy versions below are used (``kernels().backend`` says which).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

__all__ = ["kernels", "NumpyKernels", "F16_MAX"]

F16_MAX = 65504.0  # float16's largest finite value


class NumpyKernels:
    """Reference implementations (and the fallback) of the kernels."""

    backend = "numpy"

    @staticmethod
    def to_half(src: np.ndarray, scale: float, dst: np.ndarray) -> None:
        """``dst[:] = float16(src * scale)`` as uint16 bits; src float32, dst uint16, 1-D."""
        np.multiply(src, np.float32(scale), out=dst.view(np.float16), casting="same_kind")

    @staticmethod
    def from_half(src: np.ndarray, scale: float, dst: np.ndarray) -> None:
        """``dst[:] = float32(src) * scale``; src uint16 bits, dst float32, 1-D."""
        np.multiply(src.view(np.float16), np.float32(scale), out=dst, dtype=np.float32)

    @staticmethod
    def sum_rows(rows: np.ndarray, scale: float, out: np.ndarray) -> None:
        """``out[:] = (rows[0] + rows[1] + ... ) * scale`` in row order; float32."""
        np.add.reduce(rows, axis=0, out=out)
        if scale != 1.0:
            out *= np.float32(scale)

    @staticmethod
    def sum_rows_half(rows: np.ndarray, out: np.ndarray) -> None:
        """``out[:] = float16(sum of float32(rows[k]) in row order)``; uint16 bits; a finite
        sum beyond float16's range saturates to +-65504 instead of becoming inf."""
        acc = np.add.reduce(rows.view(np.float16), axis=0, dtype=np.float32)
        _saturate(acc)
        np.copyto(out.view(np.float16), acc, casting="same_kind")

    @staticmethod
    def add_half(src: np.ndarray, inout: np.ndarray) -> None:
        """``inout[:] = float16(float32(src) + float32(inout))``; uint16 bits; saturating
        as :meth:`sum_rows_half`."""
        acc = np.add(src.view(np.float16), inout.view(np.float16), dtype=np.float32)
        _saturate(acc)
        np.copyto(inout.view(np.float16), acc, casting="same_kind")


def _saturate(acc: np.ndarray) -> None:
    """Clip finite float32 values to float16's range in place (inf and nan stay)."""
    np.clip(acc, -F16_MAX, F16_MAX, out=acc, where=np.isfinite(acc))


def _build_numba() -> Any:
    from theanompi.exchange import _numba_kernels as nk

    f32 = np.float32

    def to_half(src: np.ndarray, scale: float, dst: np.ndarray) -> None:
        nk.to_half(src, f32(scale), dst)

    def from_half(src: np.ndarray, scale: float, dst: np.ndarray) -> None:
        nk.from_half(src, f32(scale), dst)

    def sum_rows(rows: np.ndarray, scale: float, out: np.ndarray) -> None:
        nk.sum_rows(rows, f32(scale), out)

    return SimpleNamespace(
        backend="numba",
        to_half=to_half,
        from_half=from_half,
        sum_rows=sum_rows,
        sum_rows_half=nk.sum_rows_half,
        add_half=nk.add_half,
    )


def _self_test(k: Any) -> bool:
    """True when the kernels ``k`` agree bit for bit with :class:`NumpyKernels`."""
    ref = NumpyKernels
    x = np.concatenate(
        [
            np.random.default_rng(0).standard_normal(5000).astype(np.float32) * 3e4,
            np.array([0, -0.0, 1e-8, 3e-6, 6.1e-5, 65504, 65520, 7e4, np.inf, -np.inf], np.float32),
        ]
    )
    ok = True
    for scale in (1.0, 0.125):
        h1, h2 = np.empty(x.size, np.uint16), np.empty(x.size, np.uint16)
        k.to_half(x, scale, h1)
        ref.to_half(x, scale, h2)
        ok &= np.array_equal(h1, h2)
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    y1, y2 = np.empty(bits.size, np.float32), np.empty(bits.size, np.float32)
    k.from_half(bits, 4.0, y1)
    ref.from_half(bits, 4.0, y2)
    ok &= np.array_equal(y1, y2, equal_nan=True)
    rows = np.random.default_rng(1).standard_normal((4, 10001)).astype(np.float32)
    s1, s2 = np.empty(rows.shape[1], np.float32), np.empty(rows.shape[1], np.float32)
    k.sum_rows(rows, 0.25, s1)
    ref.sum_rows(rows, 0.25, s2)
    ok &= np.array_equal(s1, s2)
    hrows = rows.astype(np.float16)
    hrows[:, :3] = [[65504, -65504, 65504]] * 3 + [[16, -16, np.inf]]  # saturates, inf stays
    hrows = hrows.view(np.uint16)
    o1, o2 = np.empty(rows.shape[1], np.uint16), np.empty(rows.shape[1], np.uint16)
    k.sum_rows_half(hrows, o1)
    ref.sum_rows_half(hrows, o2)
    ok &= np.array_equal(o1, o2)
    a = np.random.default_rng(2).permutation(bits)  # every float16 against another one
    b1, b2 = bits.copy(), bits.copy()
    k.add_half(a, b1)
    ref.add_half(a, b2)
    ok &= np.array_equal(b1.view(np.float16), b2.view(np.float16), equal_nan=True)
    return bool(ok)


_KERNELS: Any = None


def kernels() -> Any:
    """The fastest kernels that pass the self-test (built once per process)."""
    global _KERNELS
    if _KERNELS is None:
        try:
            k = _build_numba()
            with np.errstate(all="ignore"):
                _KERNELS = k if _self_test(k) else NumpyKernels
        except Exception:  # numba missing, or no half support on this CPU/LLVM
            _KERNELS = NumpyKernels
    return _KERNELS
