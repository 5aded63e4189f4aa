"""What goes on the wire: a compressor is a choice any exchanger can take (as Horovod's ``Compressor``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from theanompi.registry import Registry

__all__ = [
    "COMPRESSORS",
    "Compressor",
    "NoCompression",
    "FP16Compression",
    "get_compressor",
]

_U32 = 2.0**-24  # float32's unit roundoff
_U16 = 2.0**-11  # float16's unit roundoff
_F32_TINY = 2.0**-149  # float32's smallest subnormal: what one float32 underflow can lose
_F16_TINY = 2.0**-24  # float16's smallest subnormal (half of it is lost at most per rounding)


def _gamma(k: int, u: float) -> float:
    """Higham's ``gamma_k = k u / (1 - k u)``: the relative error of ``k`` roundings of ``u``."""
    return k * u / (1.0 - k * u)


class Compressor:
    """The wire format of one exchanger: compress into wire buffers, reduce them, decompress.

    A strategy never casts or scales values itself. It compresses each float32 array into a
    *wire buffer* (a 1-D numpy array of :attr:`wire_dtype`), moves and sums wire buffers with
    :meth:`add`, :meth:`sum_rows` or an ``Allreduce`` with :meth:`mpi_sum`, and decompresses
    the summed wire buffer into the arrays. The compressor, bound to the number of ranks N and
    the op, folds the mean's division into one of the two ends, so that after ``compress`` on
    every rank, any sum of the wire buffers over ranks, and ``decompress``, the array holds the
    ``op`` over ranks. Sums of wire values are computed in float32 and stored in the wire format.

    Parameters
    ----------
    size : int
        Number of ranks N.
    op : {"mean", "sum"}
    """

    name = "none"
    #: element type of wire buffers (float16 travels as its uint16 bit pattern)
    wire_dtype = np.dtype(np.float32)
    #: the float32 arrays can be their own wire buffers (compression is the identity)
    in_place = True

    def __init__(self, size: int = 1, op: str = "mean") -> None:
        self.size = int(size)
        self.op = op

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size}, op={self.op!r})"

    def empty(self, count: int) -> np.ndarray:
        """A zeroed wire buffer of ``count`` elements."""
        return np.zeros(count, self.wire_dtype)

    def compress(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Write float32 ``src`` (any shape and order) into the 1-D wire buffer ``dst``."""
        raise NotImplementedError

    def decompress(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Write the summed wire buffer ``src`` into float32 ``dst`` (any shape), as the op.

        ``src`` may be ``dst`` itself when :attr:`in_place`.
        """
        raise NotImplementedError

    def add(self, acc: np.ndarray, other: np.ndarray) -> None:
        """``acc += other`` on wire buffers (summed in float32)."""
        raise NotImplementedError

    def sum_rows(self, rows: np.ndarray, out: np.ndarray) -> None:
        """``out[:] = rows[0] + rows[1] + ...`` in row order, summed in float32, on the wire."""
        raise NotImplementedError

    def mpi_sum(self) -> Any:
        """The ``MPI.Op`` that sums wire buffers in an ``Allreduce``."""
        raise NotImplementedError

    def error_bound(self, wire_roundings: int) -> tuple[float, float]:
        """``(rtol, atol)`` of an exchange whose values are rounded to the wire at most
        ``wire_roundings`` times on their way (see :meth:`Exchanger.error_bound
        <theanompi.exchange.base.Exchanger.error_bound>`)."""
        raise NotImplementedError


class NoCompression(Compressor):
    """float32 on the wire: compress is a copy, decompress divides by N for the mean.

    Examples
    --------
    >>> c = NoCompression(size=4, op="mean")
    >>> wire = c.empty(3)
    >>> c.compress(np.array([1, 2, 3], np.float32), wire); wire *= 4   # four equal ranks
    >>> out = np.empty(3, np.float32); c.decompress(wire, out); out
    array([1., 2., 3.], dtype=float32)
    """

    def compress(self, src: np.ndarray, dst: np.ndarray) -> None:
        np.copyto(dst.reshape(src.shape), src)

    def decompress(self, src: np.ndarray, dst: np.ndarray) -> None:
        src = src.reshape(dst.shape)
        if self.op == "mean":
            np.divide(src, np.float32(self.size), out=dst)
        elif src is not dst:
            np.copyto(dst, src)

    def add(self, acc: np.ndarray, other: np.ndarray) -> None:
        np.add(acc, other, out=acc)

    def sum_rows(self, rows: np.ndarray, out: np.ndarray) -> None:
        np.add.reduce(rows, axis=0, out=out)

    def mpi_sum(self) -> Any:
        from mpi4py import MPI

        return MPI.SUM

    def error_bound(self, wire_roundings: int) -> tuple[float, float]:
        # at most N - 1 float32 additions on any value's way, and the division: N + 2 is slack
        n = self.size
        return _gamma(n + 2, _U32), (n + 2) * _F32_TINY


_FP16_SUM_OP: Any = None  # one MPI.Op per process (mpi4py allows only a few user-defined ops)


def _fp16_sum(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
    """The user-defined ``MPI.Op``: ``inout = float16(float32(in) + float32(inout))``."""
    from theanompi.exchange._kernels import kernels

    kernels().add_half(np.frombuffer(inbuf, np.uint16), np.frombuffer(inoutbuf, np.uint16))


class FP16Compression(Compressor):
    """float16 on the wire (half the bytes), every sum computed in float32.

    Each value is divided by N *before* it is converted (as Theano-MPI's asa16 did; exact when
    N is a power of 2), so the sum over ranks of the converted values is at most the largest
    input in magnitude and nothing that fits float16 (``|x| <= 65504``) overflows. A partial
    sum stored as float16 is rounded once more; a finite sum that would round beyond 65504
    (possible only through those roundings, e.g. ``3 * float16(65504 / 3) = 65520`` at N=3)
    saturates to 65504 instead of becoming inf. Inputs beyond 65504 become inf (not checked).
    ``op="sum"`` multiplies by N on the way out. float16 values travel as their uint16 bit
    patterns, converted by the numba kernels of :mod:`theanompi.exchange._kernels`; MPI has
    no float16 sum, so :meth:`mpi_sum` is a user-defined ``MPI.Op`` on ``MPI.UINT16_T`` that
    sums pairs in float32 (commutative bit for bit, so every rank of an ``Allreduce`` ends
    with the same bits).

    Examples
    --------
    >>> c = FP16Compression(size=2, op="mean")
    >>> a, b = c.empty(2), c.empty(2)
    >>> c.compress(np.array([1.0, 65504.0], np.float32), a)   # rank 0's values / 2
    >>> c.compress(np.array([3.0, 65504.0], np.float32), b)   # rank 1's values / 2
    >>> c.add(a, b); out = np.empty(2, np.float32); c.decompress(a, out); out.tolist()
    [2.0, 65504.0]
    """

    name = "fp16"
    wire_dtype = np.dtype(np.uint16)
    in_place = False

    def __init__(self, size: int = 1, op: str = "mean") -> None:
        super().__init__(size, op)
        self._back = float(self.size) if op == "sum" else 1.0
        self._kernels: Any = None

    @property
    def kernels(self) -> Any:
        """The float16 kernels (numba, or numpy as the fallback), built on first use."""
        if self._kernels is None:
            from theanompi.exchange._kernels import kernels

            self._kernels = kernels()
        return self._kernels

    def compress(self, src: np.ndarray, dst: np.ndarray) -> None:
        self.kernels.to_half(np.ascontiguousarray(src).reshape(-1), 1.0 / self.size, dst)

    def decompress(self, src: np.ndarray, dst: np.ndarray) -> None:
        if dst.flags.c_contiguous and dst.flags.writeable:
            self.kernels.from_half(src, self._back, dst.reshape(-1))
        else:
            tmp = np.empty(dst.size, np.float32)
            self.kernels.from_half(src, self._back, tmp)
            np.copyto(dst, tmp.reshape(dst.shape))

    def add(self, acc: np.ndarray, other: np.ndarray) -> None:
        self.kernels.add_half(other, acc)

    def sum_rows(self, rows: np.ndarray, out: np.ndarray) -> None:
        self.kernels.sum_rows_half(rows, out)

    def mpi_sum(self) -> Any:
        global _FP16_SUM_OP
        if _FP16_SUM_OP is None:
            from mpi4py import MPI

            _FP16_SUM_OP = MPI.Op.Create(_fp16_sum, commute=True)
        return _FP16_SUM_OP

    def error_bound(self, wire_roundings: int) -> tuple[float, float]:
        # k roundings to float16 (u = 2**-11) and at most N + 2 float32 roundings (1/N, the
        # product, N - 1 additions, the final scale) on any value's way; each of the N
        # conversions may also lose half float16's smallest subnormal of x / N (N * 2**-25,
        # doubled to cover the relative roundings of those losses further on)
        n = self.size
        rtol = (1 + _gamma(wire_roundings, _U16)) * (1 + _gamma(n + 2, _U32)) - 1
        return rtol, n * _F16_TINY


#: ``weight_exchange.compression``: what travels on the wire
COMPRESSORS: Registry[type[Compressor]] = Registry(
    "compression", {"none": NoCompression, "fp16": FP16Compression}
)


def get_compressor(name: str, size: int = 1, op: str = "mean") -> Compressor:
    """The compressor called ``name``, bound to ``size`` ranks and ``op``.

    Examples
    --------
    >>> get_compressor("fp16", size=4)
    FP16Compression(size=4, op='mean')
    """
    return COMPRESSORS.get(name)(size, op)
