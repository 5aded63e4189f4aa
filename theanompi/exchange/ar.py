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

    With ``compression="fp16"`` (Theano-MPI's ``nccl16``) every array goes through the
    streamed segments, compressed to float16 on the way in, and the ``Allreduce`` uses the
    compressor's user-defined ``MPI.Op``, which adds two float16 buffers in float32 and
    rounds back to float16 (MPI has no float16 sum). Open MPI may add the N values in any
    order, so a value can meet up to N - 1 float16 roundings of partial sums besides its own
    conversion: :attr:`wire_roundings` is N, a looser bound than ``asa16``'s 2.

    Parameters
    ----------
    comm, op, compression
        See :class:`~theanompi.exchange.base.Exchanger`.
    fuse_below : int
        Arrays with fewer elements than this are fused; ``0`` fuses none, a huge value fuses
        every array. Compressed exchanges stream every array (they copy them anyway).
    segment : int
        Most elements one ``Allreduce`` call moves; a huge value reduces each large array
        in one call.
    """

    name = "ar"
    reduces_by_chunks = True
    # Open MPI 5's Allreduce across 2 nodes x 2 ranks (1 Gbit, `tmpi bench cluster`): flat
    # 111 ms a step, ours through the node leaders 297 ms: it is already node-aware
    node_aware = True

    def __init__(
        self,
        comm=None,
        op: str = "mean",
        compression: str = "none",
        fuse_below: int = FUSE_BELOW,
        segment: int = SEGMENT,
    ) -> None:
        super().__init__(comm, op, compression)
        if fuse_below < 0:
            raise ValueError(f"fuse_below must be >= 0 elements, got {fuse_below!r}")
        if segment < 1:
            raise ValueError(f"segment must be >= 1 element, got {segment!r}")
        self.fuse_below = int(fuse_below)
        self.segment = int(segment)

    def _prepare(self, arrays: list[np.ndarray]) -> None:
        c = self.compressor
        fuse_below = self.fuse_below if c.in_place else 1 << 62
        self._fused, self._direct = split_by_size(arrays, fuse_below)
        sizes = [arrays[i].size for i in self._fused]
        self._fusion = StreamingFusion(sizes, self.segment, c.wire_dtype) if sizes else None
        self._op = c.mpi_sum() if self.size > 1 else None

    def allreduce(self, buf: np.ndarray) -> None:
        """``MPI.Allreduce(IN_PLACE, buf, op)``: the compressor's sum of a contiguous wire buffer."""
        from mpi4py import MPI

        self.comm.Allreduce(MPI.IN_PLACE, buf, op=self._op)

    def _reduce_segments(self, buf: np.ndarray) -> None:
        """Allreduce a contiguous float32 buffer in place slice by slice, each then scaled."""
        flat = buf.reshape(-1)
        for s0 in range(0, flat.size, self.segment):
            seg = flat[s0 : s0 + self.segment]
            self.allreduce(seg)
            self.compressor.decompress(seg, seg)  # float32: the mean's division, in place

    def _exchange(self, arrays: list[np.ndarray]) -> None:
        if self._fusion is not None:
            fused = [arrays[i] for i in self._fused]
            self._fusion.reduce(fused, self.allreduce, self.compressor)
        for i in self._direct:
            a = arrays[i]
            buf = a if a.flags.c_contiguous and a.flags.writeable else np.ascontiguousarray(a)
            self._reduce_segments(buf)
            if buf is not a:
                np.copyto(a, buf)
