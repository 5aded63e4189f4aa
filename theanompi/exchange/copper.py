"""``copper``: binary-tree reduction to rank 0, then broadcast back down the tree (N = 2**k)."""

from __future__ import annotations

import numpy as np

from theanompi.exchange._fusion import FusionBuffer
from theanompi.exchange.base import Exchanger

__all__ = ["CopperExchanger", "SEGMENT"]

SEGMENT = 1 << 20  # elements per pipelined segment (4 MiB of float32)


class CopperExchanger(Exchanger):
    """Tree all-reduce with point-to-point messages, written once for any power-of-2 N.

    Up the tree, at distance ``d = 1, 2, 4, ...``, rank ``r`` with ``r % 2d == d`` sends its
    partial sum to ``r - d``, which adds it (pairs 1→0, 3→2, ..., then 2→0, 6→4, ..., then
    4→0, ...). Rank 0 then holds the total and sends it back down the same tree in reverse
    (``d = N/2, ..., 1``: ``r → r + d``), so every rank receives the same bytes. The fusion
    buffer is processed in segments of :data:`SEGMENT` elements, segment after segment in
    each phase, so the levels of the tree work on different segments at once (a pipeline)
    and the receive buffer stays small.

    With ``compression="fp16"`` (Theano-MPI's ``copper16``) the tree moves float16 and each
    level adds in float32 and rounds back to float16, so a value meets ``1 + log2 N``
    roundings to float16 (:attr:`wire_roundings`).

    Parameters
    ----------
    comm, op, compression
        See :class:`~theanompi.exchange.base.Exchanger`; N must be a power of 2.
    segment : int
        Elements per pipelined segment.
    """

    name = "copper"
    requires_power_of_two = True

    def __init__(
        self, comm=None, op: str = "mean", compression: str = "none", segment: int = SEGMENT
    ) -> None:
        super().__init__(comm, op, compression)
        if segment < 1:
            raise ValueError(f"segment must be >= 1 element, got {segment!r}")
        self.segment = int(segment)

    @classmethod
    def wire_roundings(cls, n: int) -> int:
        """``1 + log2 n``: the conversion, and one sum per level of the tree."""
        return max(n - 1, 0).bit_length() + 1

    def _prepare(self, arrays: list[np.ndarray]) -> None:
        c = self.compressor
        self._fusion = FusionBuffer([a.size for a in arrays], dtype=c.wire_dtype)
        self._tmp = c.empty(min(self.segment, self._fusion.padded_count))

    def _levels(self) -> list[int]:
        d, out = 1, []
        while d < self.size:
            out.append(d)
            d *= 2
        return out

    def send(self, buf: np.ndarray, dest: int) -> None:
        """``MPI.Send``."""
        self.comm.Send(buf, dest=dest, tag=17)

    def recv(self, buf: np.ndarray, source: int) -> None:
        """``MPI.Recv``."""
        self.comm.Recv(buf, source=source, tag=17)

    def reduce_tree(self, buf: np.ndarray) -> None:
        """Sum ``buf`` over ranks into rank 0's ``buf`` (others keep partial sums)."""
        r, levels, add = self.rank, self._levels(), self.compressor.add
        for s0 in range(0, buf.size, self.segment):
            seg = buf[s0 : s0 + self.segment]
            tmp = self._tmp[: seg.size]
            for d in levels:
                if r % (2 * d) == d:
                    self.send(seg, r - d)
                    break
                self.recv(tmp, r + d)  # here r % (2d) == 0, so r + d < N
                add(seg, tmp)

    def bcast_tree(self, buf: np.ndarray) -> None:
        """Copy rank 0's ``buf`` to every rank, down the same tree."""
        r, levels = self.rank, self._levels()[::-1]
        for s0 in range(0, buf.size, self.segment):
            seg = buf[s0 : s0 + self.segment]
            for d in levels:
                if r % (2 * d) == 0:
                    self.send(seg, r + d)
                elif r % (2 * d) == d:
                    self.recv(seg, r - d)

    def _exchange(self, arrays: list[np.ndarray]) -> None:
        c, fb = self.compressor, self._fusion
        fb.pack(arrays, c)
        self.reduce_tree(fb.buffer)
        self.bcast_tree(fb.buffer)
        fb.unpack(arrays, c)
