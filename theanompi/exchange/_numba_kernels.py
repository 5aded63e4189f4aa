"""numba versions of the kernels in :mod:`theanompi.exchange._kernels` (imported lazily)."""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

__all__ = ["to_half", "from_half", "sum_rows", "sum_rows_half", "add_half"]

_BLOCK = 4096  # columns per block in the row sums: the float32 accumulator stays in L1
_F16_MAX = np.float32(65504.0)  # float16's largest finite value
_INF = np.float32(np.inf)


@intrinsic
def _f2h(typingctx: Any, x: Any) -> Any:
    """float32 -> float16 bits (LLVM fptrunc: F16C vcvtps2ph, round to nearest even)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@intrinsic
def _h2f(typingctx: Any, b: Any) -> Any:
    """float16 bits -> float32 (LLVM fpext: F16C vcvtph2ps, exact)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


_jit = njit(nogil=True, cache=True, error_model="numpy", boundscheck=False)


@njit(inline="always")
def _saturate(s: Any) -> Any:  # pragma: no cover - compiled
    """A finite float32 beyond float16's range becomes +-65504 instead of rounding to inf."""
    if s > _F16_MAX:
        if s != _INF:
            return _F16_MAX
    elif s < -_F16_MAX:
        if s != -_INF:
            return -_F16_MAX
    return s


@_jit
def to_half(src: Any, scale: Any, dst: Any) -> None:  # pragma: no cover - compiled
    for i in range(src.size):
        dst[i] = _f2h(src[i] * scale)


@_jit
def from_half(src: Any, scale: Any, dst: Any) -> None:  # pragma: no cover - compiled
    for i in range(src.size):
        dst[i] = _h2f(src[i]) * scale


# The loops below index row slices with the range variable only: indexing rows[k, j] or
# acc[j - j0] directly leaves numba's negative-index checks in the loop and LLVM then does
# not vectorise it (sum_rows_half: 1.5 ns per element that way, ~0.2 ns like this).


@_jit
def sum_rows(rows: Any, scale: Any, out: Any) -> None:  # pragma: no cover - compiled
    n, c = rows.shape
    for j0 in range(0, c, _BLOCK):
        j1 = min(j0 + _BLOCK, c)
        o = out[j0:j1]
        r = rows[0, j0:j1]
        for j in range(j1 - j0):
            o[j] = r[j]
        for k in range(1, n):
            r = rows[k, j0:j1]
            for j in range(j1 - j0):
                o[j] += r[j]
        if scale != 1.0:
            for j in range(j1 - j0):
                o[j] *= scale


@_jit
def sum_rows_half(rows: Any, out: Any) -> None:  # pragma: no cover - compiled
    n, c = rows.shape
    acc = np.empty(_BLOCK, np.float32)
    for j0 in range(0, c, _BLOCK):
        j1 = min(j0 + _BLOCK, c)
        a = acc[: j1 - j0]
        r = rows[0, j0:j1]
        for j in range(j1 - j0):
            a[j] = _h2f(r[j])
        for k in range(1, n):
            r = rows[k, j0:j1]
            for j in range(j1 - j0):
                a[j] += _h2f(r[j])
        o = out[j0:j1]
        for j in range(j1 - j0):
            o[j] = _f2h(_saturate(a[j]))


@_jit
def add_half(src: Any, inout: Any) -> None:  # pragma: no cover - compiled
    for i in range(src.size):
        inout[i] = _f2h(_saturate(_h2f(src[i]) + _h2f(inout[i])))
