"""BSP: every rank trains on its own sub-batch, then all ranks exchange (``avg`` params or ``cdd``
gradients) with the configured strategy and stay bit-identical.

One step of rank r (of N):

* ``avg``: ``model.train_step(x, y)`` (local SGD update), then the exchanger replaces
  every parameter by its mean over ranks;
* ``cdd``: ``model.compute_grads(x, y)``, the exchanger averages the gradients, then
  ``model.apply_grads()`` (the same update on every rank).

With ``training.accumulate_steps`` K > 1 a step takes K sub-batches per rank
(:meth:`~theanompi.rules.base.SyncRule.accumulate`): ``cdd`` sums their gradients into
``model.grads``, scales by 1/K and exchanges that mean once (one update of the global batch
``K * N * b``, as Horovod's ``backward_passes_per_step``); ``avg`` takes one local step on
the mean of its K sub-batch gradients (a K times larger local batch), then averages the
parameters once.
"""

from __future__ import annotations

from typing import Any, ClassVar

from theanompi.models.params import get_values, set_values
from theanompi.rules.base import SyncRule

__all__ = ["BSP", "SYNC_TYPES"]

SYNC_TYPES = ("avg", "cdd")


class BSP(SyncRule):
    """Bulk-synchronous SGD with an exchanger from :mod:`theanompi.exchange`.

    Parameters
    ----------
    strategy
        A name in ``theanompi.exchange.STRATEGIES``.
    sync_type
        ``avg`` (average parameters after the local step) or ``cdd`` (average gradients).
    compression
        A name in ``theanompi.exchange.compression.COMPRESSORS`` (what goes on the wire).
    """

    name = "BSP"
    uses_strategy: ClassVar[bool] = True
    identical_replicas: ClassVar[bool] = True

    def __init__(self, strategy: str = "ar", sync_type: str = "avg", compression: str = "none"):
        if sync_type not in SYNC_TYPES:
            raise ValueError(f"unknown sync_type {sync_type!r}; choose from {SYNC_TYPES}")
        self.strategy, self.sync_type, self.compression = strategy, sync_type, compression
        self.cdd = sync_type == "cdd"
        self.exchanger: Any = None

    @classmethod
    def from_config(cls, weight_exchange: Any, seed: int) -> BSP:
        we = weight_exchange
        return cls(strategy=we.exch_strategy, sync_type=we.sync_type, compression=we.compression)

    @property
    def local_opt_state(self) -> bool:
        # avg: each rank's momentum follows its own gradients; cdd: one update everywhere
        return not self.cdd

    @property
    def local_update(self) -> bool:
        # cdd: the optimiser step follows the gradient exchange (after_step)
        return not self.cdd

    def describe(self) -> str:
        wire = "" if self.compression == "none" else f"+{self.compression}"
        return f"exchange {self.strategy}{wire}/{self.sync_type}"

    def settings(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "sync_type": self.sync_type,
            "compression": self.compression,
        }

    def _shared(self, model: Any) -> list[Any]:
        return model.grads if self.cdd else model.params

    def setup(self, model: Any, comm: Any) -> None:
        if comm.Get_size() == 1:
            return
        from theanompi.exchange import create_exchanger

        self.exchanger = create_exchanger(
            self.strategy, comm=comm, op="mean", compression=self.compression
        )
        self.exchanger.prepare(get_values(self._shared(model)))

    def train_step(self, model: Any, x: Any, y: Any) -> tuple[float, float]:
        return model.compute_grads(x, y) if self.cdd else model.train_step(x, y)

    def after_step(self, model: Any, step: int) -> float:
        from mpi4py import MPI

        t0 = MPI.Wtime()
        if self.exchanger is not None:
            shared = self._shared(model)
            arrays = get_values(shared)
            self.exchanger.exchange(arrays)
            set_values(shared, arrays)
        t1 = MPI.Wtime()
        if self.cdd:
            model.apply_grads()  # compute: the trainer counts it as such
        return t1 - t0
