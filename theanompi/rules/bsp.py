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

import contextlib
from typing import Any, ClassVar

from theanompi.comm import made
from theanompi.errors import ConfigError
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
    hierarchical
        ``always``, ``never``, or ``auto`` (some node holds more than one rank, and there is
        more than one node): reduce inside each node, exchange between one leader per node
        (:class:`~theanompi.exchange.hierarchical.HierarchicalExchanger`).
    overlap, bucket_mb
        ``cdd`` on the C backend: exchange the gradients in buckets of ``bucket_mb`` MB, each
        as soon as the backward pass has produced it
        (:class:`~theanompi.exchange.overlap.OverlappedExchange`): ``always``, ``never``, or
        ``auto``: when the ranks span more than one node (in one node the exchange is a
        memory copy, cheaper than handing buckets to a thread).
    """

    name = "BSP"
    uses_strategy: ClassVar[bool] = True
    identical_replicas: ClassVar[bool] = True
    mid_epoch_checkpoints: ClassVar[bool] = True  # every replica is the checkpoint's

    def __init__(
        self,
        strategy: str = "ar",
        sync_type: str = "avg",
        compression: str = "none",
        overlap: str = "never",
        bucket_mb: float = 25.0,
        hierarchical: str = "never",
        shard_optimizer: bool = False,
    ):
        from theanompi.exchange import WHEN

        if sync_type not in SYNC_TYPES:
            raise ValueError(f"unknown sync_type {sync_type!r}; choose from {SYNC_TYPES}")
        for key, when in (("overlap", overlap), ("hierarchical", hierarchical)):
            if when not in WHEN:
                raise ValueError(f"unknown {key} {when!r}; choose from {WHEN}")
        self.strategy, self.sync_type, self.compression = strategy, sync_type, compression
        self.cdd = sync_type == "cdd"
        self.overlap, self.bucket_mb = overlap if self.cdd else "never", bucket_mb
        self.hierarchical = hierarchical
        self.shard_optimizer = shard_optimizer
        self.sharded: Any = None  # ShardedUpdate: this rank's part of the optimiser (ZeRO-1)
        self._node_first = False  # the exchange reduces inside each node first (set up)
        self.exchanger: Any = None
        self.overlapped: Any = None  # OverlappedExchange, when the gradients overlap
        self._in_flight = False  # this step's buckets went to `overlapped`
        self.hidden_s = 0.0  # of the last step's exchange, the seconds hidden under compute
        self.bucket_spans: list[tuple[int, float, float]] = []  # last step's (k, start, end)
        self.sync_s = 0.0  # the last step's wait for the slowest rank (serial exchange)
        self._comm: Any = None
        self._meet: Any = None  # a duplicate of comm for the barrier before exchanges

    @classmethod
    def from_config(cls, weight_exchange: Any, seed: int) -> BSP:
        we = weight_exchange
        return cls(
            strategy=we.exch_strategy,
            sync_type=we.sync_type,
            compression=we.compression,
            overlap=we.overlap,
            bucket_mb=we.bucket_mb,
            hierarchical=we.hierarchical,
            shard_optimizer=we.shard_optimizer,
        )

    @classmethod
    def check_sharding(cls, weight_exchange: Any) -> None:
        from theanompi.rules.sharded import sharding_strategies

        we = weight_exchange
        can = sharding_strategies()
        if we.sync_type != "cdd":
            raise ConfigError(
                "weight_exchange.shard_optimizer divides one update of averaged gradients; "
                f"sync_type {we.sync_type!r} updates each replica apart: set sync_type: cdd"
            )
        if we.exch_strategy not in can:
            raise ConfigError(
                f"weight_exchange.shard_optimizer needs a strategy that reduces by chunks "
                f"({', '.join(can)}), not {we.exch_strategy!r}; set exch_strategy: {can[0]}"
            )

    @classmethod
    def shrinks_in_place(cls, weight_exchange: Any) -> bool:
        # not ZeRO-1 (a lost rank takes its part of the optimiser state with it) nor the
        # overlapped exchange's thread (its communicator is not rebuilt); overlap auto stays
        # serial under elastic (train.run.create_rule)
        return not weight_exchange.shard_optimizer and weight_exchange.overlap != "always"

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
        how = " between node leaders" if self._node_first else ""
        if self.sharded is not None:
            how += f", optimizer state sharded 1/{self.sharded.n} (ZeRO-1)"
        if self.overlapped is not None:
            how += f", {len(self.overlapped.buckets)} buckets under the backward pass"
        return f"exchange {self.strategy}{wire}/{self.sync_type}{how}"

    def settings(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "sync_type": self.sync_type,
            "compression": self.compression,
            "shard_optimizer": self.sharded is not None,
        }

    def _shared(self, model: Any) -> list[Any]:
        return model.grads if self.cdd else model.params

    def _make_exchanger(self, comm: Any) -> Any:
        from theanompi.exchange import create_exchanger

        return create_exchanger(
            self.strategy,
            comm=comm,
            op="mean",
            compression=self.compression,
            hierarchical=self._node_first,
        )

    def _overlaps(self, model: Any, comm: Any) -> bool:
        from theanompi.comm import local_size

        if self.overlap == "never" or getattr(model, "backend", "c") != "c":
            return False
        if not hasattr(model, "compile_overlapped_grads"):
            return False
        return self.overlap == "always" or local_size(comm) < comm.Get_size()

    def setup(self, model: Any, comm: Any) -> None:
        if comm.Get_size() == 1:
            return
        from theanompi.exchange.hierarchical import hierarchical_wanted

        self._comm = comm
        self._meet = made(comm.Dup())
        if self.shard_optimizer and self.cdd:  # serial: the buckets of overlap are whole
            from theanompi.rules.sharded import ShardedUpdate

            opt, grads = model.optimizer, model.grads
            self.sharded = ShardedUpdate(opt, grads, comm, self.strategy, self.compression)
            return
        self._node_first = hierarchical_wanted(self.hierarchical, comm, self.strategy)
        shared = self._shared(model)
        if self._overlaps(model, comm):
            from theanompi.exchange.overlap import OverlappedExchange

            shapes = [v.shape for v in get_values(shared)]
            ox = OverlappedExchange(shapes, self.bucket_mb, self._make_exchanger, comm)
            model.compile_overlapped_grads(ox.buckets, ox.start)
            self.overlapped = ox
            return
        self.exchanger = self._make_exchanger(comm)
        self.exchanger.prepare(get_values(shared))

    def train_step(self, model: Any, x: Any, y: Any) -> tuple[float, float]:
        if self.overlapped is not None:
            self._in_flight = True
            return model.compute_grads_overlapped(x, y)
        return model.compute_grads(x, y) if self.cdd else model.train_step(x, y)

    def after_step(self, model: Any, step: int) -> float:
        from mpi4py import MPI

        from theanompi.exchange.polling import wait_idle

        t0 = MPI.Wtime()
        self.hidden_s, self.sync_s, self.bucket_spans = 0.0, 0.0, []
        if self._in_flight:  # the buckets are on their way: wait for the rest
            self._in_flight = False
            ox = self.overlapped
            waited = ox.wait()
            self.hidden_s = max(0.0, ox.take_busy() - waited)
            self.bucket_spans = ox.take_spans()
            set_values(model.grads, [ox.result(i) for i in range(len(model.grads))])
        elif self._comm is not None:  # serial (also the K > 1 sub-batch steps of overlap)
            # the ranks meet first (a barrier that sleeps, not spins), so that the exchange's
            # time is the network's and the slowest rank's lateness is counted apart
            wait_idle(self._meet.Ibarrier())
            self.sync_s = MPI.Wtime() - t0
            if self.sharded is not None:  # reduce-scatter, this rank's update, all-gather
                self.sharded.step()
                return MPI.Wtime() - t0
            if self.exchanger is None:
                self.exchanger = self._make_exchanger(self._comm)
                self.exchanger.prepare(get_values(self._shared(model)))
            shared = self._shared(model)
            arrays = get_values(shared)
            self.exchanger.exchange(arrays)
            set_values(shared, arrays)
        t1 = MPI.Wtime()
        if self.cdd:
            model.apply_grads()  # compute: the trainer counts it as such
        return t1 - t0

    def whole_state(self, model: Any) -> contextlib.AbstractContextManager[None]:
        return (
            self.sharded.whole_state() if self.sharded is not None else super().whole_state(model)
        )

    def finish(self, model: Any) -> dict[str, Any]:
        if self.overlapped is not None:
            self.overlapped.close()
        if self._meet is not None:
            self._meet.Free()
            self._meet = None
        return {}
