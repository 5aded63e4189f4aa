"""The exchanger contract shared by every BSP parameter-exchange strategy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from theanompi.comm import is_power_of_two
from theanompi.errors import ConfigError
from theanompi.exchange.compression import COMPRESSORS, Compressor, get_compressor

__all__ = ["Exchanger", "OPS"]

OPS = ("mean", "sum")


class Exchanger:
    """Combine a fixed list of float32 arrays across all ranks of a communicator, in place.

    The contract (every strategy keeps all of it):

    * ``prepare(arrays)`` is called once, with the list of float32 numpy arrays that will be
      exchanged (the values of the model's shared variables). Their number, shapes and dtype
      are fixed from then on; strategies allocate their buffers here.
    * ``exchange(arrays)`` is called every step, on every rank, with arrays of the prepared
      shapes (the same objects or new ones). Each array is overwritten **in place** with the
      element-wise ``op`` over ranks: ``"mean"`` (sum / N) or ``"sum"``.
    * Afterwards every rank holds **bit-identical** values: each element of the result is
      computed once (by one rank, or by an order-independent MPI reduction) and copied to
      the others, so replicas never drift apart.
    * Accuracy: :meth:`error_bound` states it, per strategy, compression and N; float32 is
      within ``~N * 2**-24`` of the exact result relative to ``sum |x_r|``, float16 on the
      wire (``compression="fp16"``, see :mod:`theanompi.exchange.compression`) within about
      ``2**-11`` per rounding to float16 that a value meets (:attr:`wire_roundings`).
    * Strategies that need N to be a power of 2 (``requires_power_of_two``) raise
      :class:`~theanompi.errors.ConfigError` in the constructor otherwise.
    * With one rank, ``exchange`` returns at once (the mean and sum of one value are itself).

    Subclasses override only :meth:`_prepare` (allocate) and :meth:`_exchange` (one step),
    and leave every cast and scaling of values to :attr:`compressor`.

    Parameters
    ----------
    comm : mpi4py communicator, optional
        Defaults to ``MPI.COMM_WORLD``. Anything with ``Get_rank()``/``Get_size()`` passes
        the constructor's checks.
    op : {"mean", "sum"}
        Mean for ``sync_type=avg`` (parameters) and usually ``cdd`` (gradients).
    compression : {"none", "fp16"}
        What travels between ranks (a key of
        :data:`~theanompi.exchange.compression.COMPRESSORS`). A strategy whose name implies
        a compression (``implied_compression``, e.g. ``asa16``) uses it when given ``"none"``.
    """

    name = "base"
    #: N must be a power of 2 (checked in the constructor)
    requires_power_of_two = False
    #: compression this strategy always uses (``asa16``: ``"fp16"``); None: the caller's
    implied_compression: str | None = None
    #: a reference point for benchmarks (``ar_per_array``), not a choice for training
    baseline = False
    #: ``weight_exchange.shard_optimizer`` may take its place: each rank needs the reduced chunk it
    #: owns (its first half, a reduce-scatter), the rest is the parameters' all-gather
    reduces_by_chunks = False
    #: its MPI collective already reduces inside a node before the network (``hierarchical:
    #: auto`` then keeps it flat)
    node_aware = False

    @classmethod
    def wire_compression(cls, compression: str) -> str:
        """What this strategy sends given ``compression``: its :attr:`implied_compression`, or
        ``compression``; an unknown name, or another than the implied one, is a one-line
        ``ConfigError``."""
        COMPRESSORS.get(compression)
        implied = cls.implied_compression
        if implied is not None and compression not in ("none", implied):
            raise ConfigError(
                f"exchanger {cls.name!r} always sends {implied}, got compression={compression!r}; "
                f"drop the compression or choose it with another strategy"
            )
        return implied or compression

    def __init__(self, comm: Any = None, op: str = "mean", compression: str = "none") -> None:
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}; choose from {', '.join(map(repr, OPS))}")
        wire = self.wire_compression(compression)
        if comm is None:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
        self.comm = comm
        self.op = op
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        if self.requires_power_of_two and not is_power_of_two(self.size):
            lower = 1 << (self.size.bit_length() - 1)
            raise ConfigError(
                f"exchanger {self.name!r} needs a power-of-2 number of ranks, got N={self.size}; "
                f"run with -n {lower} or -n {lower * 2}, or use strategy 'ar' (any N)"
            )
        self.compressor: Compressor = get_compressor(wire, self.size, op)
        self._shapes: list[tuple[int, ...]] | None = None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(op={self.op!r}, size={self.size}, "
            f"compression={self.compressor.name!r})"
        )

    @classmethod
    def wire_roundings(cls, n: int) -> int:
        """The most times one value is rounded to the wire format on its way through an
        exchange on ``n`` ranks: by compression, then by every partial sum stored in the wire
        format. Default ``n``: an ``Allreduce`` may add the N values in any order, so a value
        can meet N - 1 such sums."""
        return n

    def error_bound(self) -> tuple[float, float]:
        """``(rtol, atol)``: every result element is within ``rtol * sum_r |x_r| / D + atol * N / D``
        of the exact ``op`` of the inputs ``x_r`` (``D = N`` for the mean, 1 for the sum).

        Holds for finite inputs with ``|x_r| <= 65504`` when compressing to float16, and
        is tested against float64 under real ``mpirun`` at N = 1, 2, 3, 4, 8.

        Examples
        --------
        >>> class FakeComm:
        ...     def Get_rank(self): return 0
        ...     def Get_size(self): return 8
        >>> from theanompi.exchange import create_exchanger
        >>> rtol, atol = create_exchanger("asa16", comm=FakeComm()).error_bound()
        >>> f"{rtol:.3g} {atol:.3g}"
        '0.000978 4.77e-07'
        """
        return self.compressor.error_bound(self.wire_roundings(self.size))

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        """The shapes given to :meth:`prepare`."""
        if self._shapes is None:
            raise RuntimeError(f"{type(self).__name__}.prepare(arrays) must be called first")
        return self._shapes

    def prepare(self, arrays: Sequence[np.ndarray]) -> None:
        """Fix the list of arrays (count, shapes, float32) and allocate buffers.

        Parameters
        ----------
        arrays : sequence of numpy.ndarray
            Float32 arrays, the same shapes on every rank.
        """
        arrays = list(arrays)
        if not arrays:
            raise ValueError("prepare() needs at least one array")
        for i, a in enumerate(arrays):
            if not isinstance(a, np.ndarray) or a.dtype != np.float32:
                kind = a.dtype if isinstance(a, np.ndarray) else type(a).__name__
                raise TypeError(f"array {i} is {kind}, expected a float32 numpy array")
        self._shapes = [tuple(a.shape) for a in arrays]
        self._prepare(arrays)

    def exchange(self, arrays: Sequence[np.ndarray]) -> None:
        """Overwrite every array with the ``op`` over ranks (in place, bit-identical on all).

        Parameters
        ----------
        arrays : sequence of numpy.ndarray
            Writeable float32 arrays with the shapes given to :meth:`prepare`.
        """
        shapes = self.shapes
        if len(arrays) != len(shapes):
            raise ValueError(f"exchange() got {len(arrays)} arrays, prepare() had {len(shapes)}")
        for i, (a, s) in enumerate(zip(arrays, shapes, strict=True)):
            if a.shape != s or a.dtype != np.float32:
                raise ValueError(f"array {i} is {a.dtype}{a.shape}, prepared float32{s}")
        if self.size == 1:
            return
        self._exchange(list(arrays))

    # -- strategy hooks ---------------------------------------------------------------------
    def _prepare(self, arrays: list[np.ndarray]) -> None:
        """Allocate buffers for these arrays (default: nothing)."""

    def _exchange(self, arrays: list[np.ndarray]) -> None:
        """One exchange step with ``size > 1``; arrays already validated."""
        raise NotImplementedError
