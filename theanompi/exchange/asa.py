"""``asa32``/``asa16``: Alltoall, local sum of the N received chunks, Allgather (N a power of 2).

Every array is packed into one fusion buffer, zero-padded to a multiple of N, so any sizes
work (Theano-MPI raised ``NotImplementedError`` for sizes not divisible by N). The buffer is
cut into N chunks; ``Alltoall`` hands chunk j of every rank to rank j, which sums its N copies
(in rank order, in float32) and ``Allgather`` returns the summed chunks to everyone. Each
element is summed by exactly one rank, so all ranks end bit-identical.

``asa16`` is ``asa32`` with ``compression="fp16"`` (either name gives the same bits): float16
on the wire, half the bytes. Each value is divided by N *before* it is converted (exact for a
power of 2, and the sum of N such values cannot exceed the largest input, so nothing that
fits float16 overflows to inf), the N chunks are summed in float32 and rounded to float16
once for the ``Allgather``, and ``op="sum"`` multiplies by N again (exact). A value meets two
roundings to float16 (:attr:`~Asa32Exchanger.wire_roundings`), the tightest float16 bound of
the strategies: per element, for the mean, with ``u = 2**-11``::

    |mean_asa16 - mean_exact| <= (2u + (N + 2) 2**-24) * mean_r |x_r| + N * 2**-24

about ``9.8e-4`` of ``mean_r |x_r|``, plus ``2**-21`` absolute at N=8 from values in float16's
subnormal range (``|x_r| / N < 2**-14``); for ``op="sum"`` multiply both terms by N.
"""

from __future__ import annotations

import numpy as np

from theanompi.exchange._fusion import FusionBuffer
from theanompi.exchange.base import Exchanger

__all__ = ["Asa32Exchanger", "Asa16Exchanger"]


class Asa32Exchanger(Exchanger):
    """Alltoall → float32 sum of the N chunks → Allgather, on one padded fusion buffer.

    Parameters
    ----------
    comm, op, compression
        See :class:`~theanompi.exchange.base.Exchanger`; N must be a power of 2.
    """

    name = "asa32"
    reduces_by_chunks = True
    requires_power_of_two = True

    @classmethod
    def wire_roundings(cls, n: int) -> int:
        """2: the conversion, and the one rounding of the float32 sum of the N chunks."""
        return 2

    def _prepare(self, arrays: list[np.ndarray]) -> None:
        wire = self.compressor.wire_dtype
        self._fusion = FusionBuffer([a.size for a in arrays], multiple=self.size, dtype=wire)
        # a whole receive buffer: Open MPI 5's in-place Alltoall would save it (116 MB for
        # AlexNet under asa16) but measured 2.5-4x slower (122 MB at N=2: 170-276 vs 55-72 ms)
        self._recv = np.empty_like(self._fusion.buffer)

    def alltoall(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        """``MPI.Alltoall``: chunk j of ``sendbuf`` goes to rank j; chunk i of ``recvbuf``
        comes from rank i."""
        self.comm.Alltoall(sendbuf, recvbuf)

    def allgather(self, buf: np.ndarray) -> None:
        """``MPI.Allgather(IN_PLACE, buf)``: rank j's chunk j is copied to every rank."""
        from mpi4py import MPI

        self.comm.Allgather(MPI.IN_PLACE, buf)

    def _exchange(self, arrays: list[np.ndarray]) -> None:
        c, fb, n = self.compressor, self._fusion, self.size
        fb.pack(arrays, c)
        self.alltoall(fb.buffer, self._recv)
        c.sum_rows(self._recv.reshape(n, -1), fb.chunk(self.rank, n))
        self.allgather(fb.buffer)
        fb.unpack(arrays, c)  # the mean's scaling rides on the copy out (same sums everywhere)


class Asa16Exchanger(Asa32Exchanger):
    """:class:`Asa32Exchanger` with float16 on the wire, whatever ``compression`` says.

    Parameters
    ----------
    comm, op
        See :class:`~theanompi.exchange.base.Exchanger`; N must be a power of 2.
    compression : {"none", "fp16"}
        Either gives float16 (the name implies it).
    """

    name = "asa16"
    implied_compression = "fp16"
