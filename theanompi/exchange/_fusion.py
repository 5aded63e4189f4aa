"""Fusion buffer: many arrays packed back to back into one flat, padded buffer (as Horovod does)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from theanompi.exchange.compression import Compressor

__all__ = ["FusionBuffer", "StreamingFusion", "split_by_size"]


class FusionBuffer:
    """One flat buffer holding arrays of fixed sizes back to back, zero-padded at the end.

    One collective on :attr:`buffer` then moves every array at once; the padding makes the
    length a multiple of ``multiple`` (N for chunked collectives such as Alltoall), so array
    sizes need not divide N. The padding stays zero: it is never written by :meth:`pack`, and
    the sum or mean of zeros is zero.

    Parameters
    ----------
    sizes : sequence of int
        Number of elements of each array, in order.
    multiple : int
        The padded length is the smallest multiple of this that holds all elements.
    dtype : numpy dtype
        Element type of the buffer: a compressor's ``wire_dtype`` (float32, or uint16
        holding float16 bits).

    Examples
    --------
    >>> fb = FusionBuffer([3, 2], multiple=4)
    >>> fb.count, fb.padded_count, fb.offsets
    (5, 8, [0, 3])
    >>> a, b = np.arange(3, dtype=np.float32), np.ones(2, np.float32)
    >>> fb.pack([a, b]); fb.buffer
    array([0., 1., 2., 1., 1., 0., 0., 0.], dtype=float32)
    >>> fb.buffer *= 2; fb.unpack([a, b]); a
    array([0., 2., 4.], dtype=float32)
    >>> from theanompi.exchange.compression import NoCompression
    >>> fb.unpack([a, b], NoCompression(size=2, op="mean")); a   # the mean of two ranks
    array([0., 1., 2.], dtype=float32)
    """

    def __init__(
        self, sizes: Sequence[int], multiple: int = 1, dtype: np.dtype | type = np.float32
    ) -> None:
        if multiple < 1:
            raise ValueError(f"multiple must be >= 1, got {multiple!r}")
        self.sizes = [int(s) for s in sizes]
        self.offsets = [0] * len(self.sizes)
        total = 0
        for i, s in enumerate(self.sizes):
            self.offsets[i] = total
            total += s
        self.count = total
        self.padded_count = -(-max(total, 1) // multiple) * multiple
        self.buffer = np.zeros(self.padded_count, dtype=dtype)

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def view(self, i: int) -> np.ndarray:
        """The 1-D slice of :attr:`buffer` that holds array ``i``."""
        off = self.offsets[i]
        return self.buffer[off : off + self.sizes[i]]

    def chunk(self, j: int, n: int) -> np.ndarray:
        """Chunk ``j`` of ``n`` equal chunks of the padded buffer (what rank j owns)."""
        c = self.padded_count // n
        return self.buffer[j * c : (j + 1) * c]

    def pack(self, arrays: Sequence[np.ndarray], compressor: Compressor | None = None) -> None:
        """Copy (or ``compressor.compress``) every array into its slice of the buffer."""
        for i, a in enumerate(arrays):
            if compressor is None:
                np.copyto(self.view(i).reshape(a.shape), a, casting="same_kind")
            else:
                compressor.compress(a, self.view(i))

    def unpack(self, arrays: Sequence[np.ndarray], compressor: Compressor | None = None) -> None:
        """Copy (or ``compressor.decompress``) every slice of the buffer into its array."""
        for i, a in enumerate(arrays):
            if compressor is None:
                np.copyto(a, self.view(i).reshape(a.shape), casting="same_kind")
            else:
                compressor.decompress(self.view(i), a)


class StreamingFusion:
    """Arrays laid back to back in segments that are packed, reduced and unpacked one at a time.

    A classic fusion buffer is packed whole, reduced, then unpacked whole, with the mean's
    division as one more pass. Here one scratch segment (at most ``segment`` elements) is
    filled, reduced and emptied in turn, the compressor's casts and scaling folded into the
    filling and emptying, so with segments that fit the cache the collective reads what the
    pack just wrote and the unpack what it just summed. Arrays may straddle segments.

    Parameters
    ----------
    sizes : sequence of int
        Number of elements of each array, in order.
    segment : int
        Most elements per segment (one collective each).
    dtype : numpy dtype
        Element type of the scratch segment (the compressor's ``wire_dtype``).

    Examples
    --------
    >>> from theanompi.exchange.compression import NoCompression
    >>> sf = StreamingFusion([3, 4], segment=5)
    >>> sf.segments
    [(5, [(0, 0, 0, 3), (1, 0, 3, 2)]), (2, [(1, 2, 0, 2)])]
    >>> a, b = np.ones(3, np.float32), np.arange(4, dtype=np.float32)
    >>> mean_of_2 = NoCompression(size=2, op="mean")
    >>> sf.reduce([a, b], lambda buf: np.multiply(buf, 4, out=buf), mean_of_2); b
    array([0., 2., 4., 6.], dtype=float32)
    """

    def __init__(
        self, sizes: Sequence[int], segment: int, dtype: np.dtype | type = np.float32
    ) -> None:
        if segment < 1:
            raise ValueError(f"segment must be >= 1 element, got {segment!r}")
        # segments: (elements used, [(array k, offset in k, offset in segment, length), ...])
        self.segments: list[tuple[int, list[tuple[int, int, int, int]]]] = []
        pieces: list[tuple[int, int, int, int]] = []
        used = 0
        for k, size in enumerate(int(s) for s in sizes):
            start = 0
            while start < size:
                n = min(size - start, segment - used)
                pieces.append((k, start, used, n))
                used, start = used + n, start + n
                if used == segment:
                    self.segments.append((used, pieces))
                    pieces, used = [], 0
        if pieces:
            self.segments.append((used, pieces))
        self.scratch = np.zeros(max((u for u, _ in self.segments), default=1), dtype)

    def reduce(
        self,
        arrays: Sequence[np.ndarray],
        allreduce: Callable[[np.ndarray], None],
        compressor: Compressor,
    ) -> None:
        """Compress each segment, ``allreduce(segment)`` in place, decompress it into ``arrays``."""
        flats = [
            a.reshape(-1) if a.flags.c_contiguous else np.ascontiguousarray(a).reshape(-1)
            for a in arrays
        ]
        for used, pieces in self.segments:
            buf = self.scratch[:used]
            for k, a0, s0, n in pieces:
                compressor.compress(flats[k][a0 : a0 + n], buf[s0 : s0 + n])
            allreduce(buf)
            for k, a0, s0, n in pieces:
                compressor.decompress(buf[s0 : s0 + n], flats[k][a0 : a0 + n])
        for a, flat in zip(arrays, flats, strict=True):
            if not a.flags.c_contiguous:
                np.copyto(a, flat.reshape(a.shape))


def split_by_size(arrays: Sequence[np.ndarray], fuse_below: int) -> tuple[list[int], list[int]]:
    """Indices of arrays to fuse (small, or not contiguous) and to reduce in place (large).

    Large arrays gain nothing from fusion (one collective already saturates the link) but
    would pay two extra copies, so, like Horovod's fusion threshold, only small ones are packed.
    """
    fused, direct = [], []
    for i, a in enumerate(arrays):
        in_place_ok = a.flags.c_contiguous and a.flags.writeable
        (direct if in_place_ok and a.size >= fuse_below else fused).append(i)
    return fused, direct
