"""``asa32``/``asa16``: Alltoall, local sum of the N received chunks, Allgather (N a power of 2).

Every array is packed into one fusion buffer, zero-padded to a multiple of N, so any sizes
work (Theano-MPI raised ``NotImplementedError`` for sizes not divisible by N). The buffer is
cut into N chunks; ``Alltoall`` hands chunk j of every rank to rank j, which sums its N copies
(in rank order, in float32) and ``Allgather`` returns the summed chunks to everyone. Each
element is summed by exactly one rank, so all ranks end bit-identical.

``asa16`` sends float16 (half the bytes of ``asa32``): each value is divided by N *before* it
is converted (exact for a power of 2, and the sum of N such values cannot exceed the largest
input, so nothing that fits float16 overflows to inf), the N chunks are summed in float32, the
mean is rounded to float16 for the Allgather, and ``op="sum"`` multiplies by N again (exact).

Error bound of ``asa16`` (two roundings to float16, unit roundoff ``u = 2**-11``), per element,
for inputs with ``|x_r| <= 65504`` (float16's largest finite value)::

    |mean_asa16 - mean_exact| <= 2 u * mean_r |x_r| + (N + 1) * 2**-25    (u = 2**-11)

i.e. relative error ``<= 2**-10 ~ 9.8e-4`` of ``mean |x_r|`` (plus ``N * 2**-24`` from the
float32 sum: :data:`ASA16_RTOL` = 1e-3 covers both), and an absolute ``<= 2**-21`` for N <= 8
(:data:`ASA16_ATOL`) from values in float16's subnormal range (``|x_r| / N < 2**-14``).
For ``op="sum"`` multiply both terms by N. Inputs beyond 65504 become inf (not checked).
float32 ``asa32`` is within ``N * 2**-24`` of ``sum |x_r|``.
"""

from __future__ import annotations

import numpy as np

from theanompi.exchange._fusion import FusionBuffer
from theanompi.exchange._kernels import NumpyKernels, kernels
from theanompi.exchange.base import Exchanger

__all__ = ["Asa32Exchanger", "Asa16Exchanger", "ASA16_RTOL", "ASA16_ATOL"]

ASA16_RTOL = 1e-3  # relative to mean_r |x_r|: two float16 roundings (2**-10) + float32 sum
ASA16_ATOL = 2.0**-21  # absolute, for the mean, N <= 8: (N + 1) * 2**-25 rounded up


class _AsaExchanger(Exchanger):
    """Shared collectives of the two asa variants."""

    requires_power_of_two = True

    def alltoall(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        """``MPI.Alltoall``: chunk j of ``sendbuf`` goes to rank j; chunk i of ``recvbuf``
        comes from rank i."""
        self.comm.Alltoall(sendbuf, recvbuf)

    def allgather(self, buf: np.ndarray) -> None:
        """``MPI.Allgather(IN_PLACE, buf)``: rank j's chunk j is copied to every rank."""
        from mpi4py import MPI

        self.comm.Allgather(MPI.IN_PLACE, buf)


class Asa32Exchanger(_AsaExchanger):
    """Alltoall → float32 sum of the N chunks → Allgather, on one padded fusion buffer.

    Parameters
    ----------
    comm, op
        See :class:`~theanompi.exchange.base.Exchanger`; N must be a power of 2.
    """

    name = "asa32"

    def _prepare(self, arrays: list[np.ndarray]) -> None:
        self._kernels = NumpyKernels  # numpy's add.reduce is as fast as numba for float32
        self._fusion = FusionBuffer([a.size for a in arrays], multiple=self.size)
        self._recv = np.empty_like(self._fusion.buffer)

    def _exchange(self, arrays: list[np.ndarray]) -> None:
        fb, n = self._fusion, self.size
        fb.pack(arrays)
        self.alltoall(fb.buffer, self._recv)
        self._kernels.sum_rows(self._recv.reshape(n, -1), 1.0, fb.chunk(self.rank, n))
        self.allgather(fb.buffer)
        # the mean's division costs nothing extra inside the copy out (same sums everywhere)
        fb.unpack(arrays, divide_by=n if self.op == "mean" else None)


class Asa16Exchanger(_AsaExchanger):
    """As :class:`Asa32Exchanger` with float16 on the wire (sum in float32).

    Parameters
    ----------
    comm, op
        See :class:`~theanompi.exchange.base.Exchanger`; N must be a power of 2.
    """

    name = "asa16"

    def _prepare(self, arrays: list[np.ndarray]) -> None:
        self._kernels = kernels()
        # float16 bit patterns held as uint16 (numba has no CPU float16 type)
        self._fusion = FusionBuffer([a.size for a in arrays], multiple=self.size, dtype=np.uint16)
        self._recv = np.empty_like(self._fusion.buffer)

    def _exchange(self, arrays: list[np.ndarray]) -> None:
        k, fb, n = self._kernels, self._fusion, self.size
        for i, a in enumerate(arrays):  # divide by N first: no overflow to inf
            k.to_half(np.ascontiguousarray(a).reshape(-1), 1.0 / n, fb.view(i))
        self.alltoall(fb.buffer, self._recv)
        k.sum_rows_half(self._recv.reshape(n, -1), fb.chunk(self.rank, n))
        self.allgather(fb.buffer)
        back = float(n) if self.op == "sum" else 1.0
        for i, a in enumerate(arrays):
            if a.flags.c_contiguous and a.flags.writeable:
                k.from_half(fb.view(i), back, a.reshape(-1))
            else:
                tmp = np.empty(a.size, np.float32)
                k.from_half(fb.view(i), back, tmp)
                np.copyto(a, tmp.reshape(a.shape))
