"""The exchanger contract shared by every BSP parameter-exchange strategy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from theanompi.comm import is_power_of_two
from theanompi.errors import ConfigError

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
    * Accuracy: float32 strategies are within ``~N * 2**-24`` of the exact result, relative to
      ``sum |x_r|``; ``asa16`` sends float16 and is within ``2**-10`` (see
      :mod:`theanompi.exchange.asa`).
    * Strategies that need N to be a power of 2 (``requires_power_of_two``) raise
      :class:`~theanompi.errors.ConfigError` in the constructor otherwise.
    * With one rank, ``exchange`` returns at once (the mean and sum of one value are itself).

    Subclasses override only :meth:`_prepare` (allocate) and :meth:`_exchange` (one step).

    Parameters
    ----------
    comm : mpi4py communicator, optional
        Defaults to ``MPI.COMM_WORLD``. Anything with ``Get_rank()``/``Get_size()`` passes
        the constructor's checks.
    op : {"mean", "sum"}
        Mean for ``sync_type=avg`` (parameters) and usually ``cdd`` (gradients).
    """

    name = "base"
    requires_power_of_two = False

    def __init__(self, comm: Any = None, op: str = "mean") -> None:
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}; choose from {', '.join(map(repr, OPS))}")
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
        self._shapes: list[tuple[int, ...]] | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(op={self.op!r}, size={self.size})"

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
