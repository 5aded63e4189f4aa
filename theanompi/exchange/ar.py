"""``ar``: in-place ``MPI.Allreduce`` in 16 MiB segments, arrays under 1 MiB fused (any N)."""

from __future__ import annotations

import numpy as np

from theanompi.exchange._fusion import StreamingFusion, split_by_size
from theanompi.exchange.base import Exchanger

__all__ = ["ArExchanger", "FUSE_BELOW", "SEGMENT"]

SEGMENT = 1 << 22  # elements per Allreduce call (16 MiB of float32)
FUSE_BELOW = 1 << 18  # arrays under 1 MiB are fused


class ArExchanger(Exchanger):
    """Sum (or mean) with ``MPI.Allreduce`` in 16 MiB segments: small arrays fused, large in place.

    Two measured effects of Open MPI's shared-memory allreduce shape this strategy
    (``tmpi bench exchange``; ``docs/exchange.md``):

    * Bandwidth: one call on 32 MiB or more runs ~2x slower per byte than the same bytes in
      16 MiB calls (AlexNet's set at N=2: 145 ms in 64 MiB or 32 MiB calls, 79 ms in 16 MiB
      calls). Smaller calls can be faster still on idle cores, but every call is a rendezvous
      of all ranks, and once another process shares a core each one can wait for a time
      slice (1 MiB calls: 56 to 176 ms idle, 450 ms next to one busy process; 16 MiB: 142 ms,
      per-array Allreduce 256 ms). So an array of ``fuse_below`` elements or more is reduced
      in place (``MPI.IN_PLACE``, no copy) in ``segment``-element slices, each divided by N
      (``op="mean"``) right after its call.
    * Latency: every call costs a fixed ~10 µs (much more with ranks oversubscribed), so
      smaller arrays are packed back to back into segments, one call each
      (:class:`~theanompi.exchange._fusion.StreamingFusion`: one segment is packed, reduced
      and unpacked at a time, so the copies stay in the last-level cache, and the mean's
      division rides on the unpack). A small CNN's 50 arrays (4 MB) take one call instead of 50.

    Works for any N. Every rank ends bit-identical because Open MPI's allreduce algorithms
    combine the same partial sums on every rank, and ``a + b == b + a`` exactly; the test
    suite checks this at N = 2, 3, 4, 8.

    Parameters
    ----------
    comm, op
        See :class:`~theanompi.exchange.base.Exchanger`.
    fuse_below : int
        Arrays with fewer elements than this are fused; ``0`` fuses none, a huge value fuses
        every array.
    segment : int
        Most elements one ``Allreduce`` call moves; a huge value reduces each large array
        in one call.
    """

    name = "ar"

    def __init__(
        self, comm=None, op: str = "mean", fuse_below: int = FUSE_BELOW, segment: int = SEGMENT
    ) -> None:
        super().__init__(comm, op)
        if fuse_below < 0:
            raise ValueError(f"fuse_below must be >= 0 elements, got {fuse_below!r}")
        if segment < 1:
            raise ValueError(f"segment must be >= 1 element, got {segment!r}")
        self.fuse_below = int(fuse_below)
        self.segment = int(segment)

    def _prepare(self, arrays: list[np.ndarray]) -> None:
        self._fused, self._direct = split_by_size(arrays, self.fuse_below)
        sizes = [arrays[i].size for i in self._fused]
        self._fusion = StreamingFusion(sizes, self.segment) if self._fused else None

    def allreduce(self, buf: np.ndarray) -> None:
        """``MPI.Allreduce(IN_PLACE, buf, SUM)`` on a contiguous buffer."""
        from mpi4py import MPI

        self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    def _reduce_segments(self, buf: np.ndarray) -> None:
        """Allreduce a contiguous buffer slice by slice, dividing each slice for the mean."""
        flat = buf.reshape(-1)
        n = np.float32(self.size)
        for s0 in range(0, flat.size, self.segment):
            seg = flat[s0 : s0 + self.segment]
            self.allreduce(seg)
            if self.op == "mean":
                np.divide(seg, n, out=seg)

    def _exchange(self, arrays: list[np.ndarray]) -> None:
        if self._fusion is not None:
            divide_by = self.size if self.op == "mean" else None
            self._fusion.reduce([arrays[i] for i in self._fused], self.allreduce, divide_by)
        for i in self._direct:
            a = arrays[i]
            buf = a if a.flags.c_contiguous and a.flags.writeable else np.ascontiguousarray(a)
            self._reduce_segments(buf)
            if buf is not a:
                np.copyto(a, buf)
