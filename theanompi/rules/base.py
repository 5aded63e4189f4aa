"""The sync-rule protocol: what :class:`~theanompi.train.trainer.Trainer` asks of BSP, EASGD and GOSGD."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from theanompi.errors import ConfigError

__all__ = ["SyncRule", "Server", "own_values", "set_own_values"]


class Server:
    """A rank that serves the workers instead of training (EASGD's centre variable).

    ``serve()`` runs until every worker is done and returns a summary dict that the
    workers' summary is merged with (e.g. ``{"serve_s": ...}``).
    """

    def serve(self) -> dict[str, Any]:  # pragma: no cover - protocol
        raise NotImplementedError


class SyncRule:
    """How the workers' replicas are kept together; the Trainer owns everything else.

    The Trainer calls, on every worker (the ranks of :meth:`worker_comm`):

    1. ``setup(model, comm)`` once, after the model is built and every worker holds the
       same start values (rank 0's, or the checkpoint's);
    2. per (optimiser) step ``accumulate(model, x, y, i, k) -> (loss, err)`` for each of its
       ``k`` sub-batches (``training.accumulate_steps``; with ``k == 1`` that is
       ``train_step(model, x, y)``) (compute), then ``after_step(model, step) -> seconds
       spent exchanging``: the rest of ``after_step``'s wall time counts as compute;
    3. at each epoch end ``epoch_end(model)`` (a collective: drain messages in flight),
       then ``eval_values(model)``: the values to validate and checkpoint, ``None`` for
       the model's own (for BSP every replica is the same; for EASGD the centre; for
       GOSGD the gossip-weighted mean of the workers); the Trainer then averages the
       model's ``buffers`` (batch-norm running statistics, per rank while training) over
       the workers, whatever the rule, so validation and checkpoints see their mean;
    4. ``finish(model) -> dict`` once, with extra summary fields (exchanges per rank ...).

    Mid-epoch checkpoints (``output.checkpoint_every_*``, a stop on a signal) are written by
    rules with ``mid_epoch_checkpoints``: at such a step boundary the Trainer calls
    ``checkpoint_state(model)`` (a collective that settles whatever is in flight and returns
    this rank's own state, ``None`` where the checkpoint's values are every rank's), then
    ``eval_values`` for the checkpoint's values; on a resume from it the rule gets the state
    back through ``load_checkpoint_state`` after ``setup``.

    Class attributes describe the rule to config validation, the CLI and the loop:
    ``min_ranks``, ``uses_strategy`` (``exch_strategy`` applies), ``synchronous``,
    ``identical_replicas``, ``bit_exact_resume`` and ``supports_accumulation``; the
    ``local_opt_state`` property says whether ranks keep different optimiser state
    (checkpoints then carry per-rank side files), ``local_update`` whether the optimiser
    step is taken in the local compute (else in ``after_step``, after an exchange of the
    gradients).
    """

    name: ClassVar[str] = "rule"
    min_ranks: ClassVar[int] = 1
    uses_strategy: ClassVar[bool] = False
    #: every worker steps in lockstep on one global batch (the step count is the global one)
    synchronous: ClassVar[bool] = True
    #: replicas stay bit-identical (``check_every`` can assert it)
    identical_replicas: ClassVar[bool] = False
    bit_exact_resume: ClassVar[bool] = True
    #: ``training.accumulate_steps`` > 1 allowed (:meth:`accumulate`); a rule whose
    #: ``train_step`` is more than the model's step overrides ``accumulate`` or sets False
    supports_accumulation: ClassVar[bool] = True
    #: mid-epoch checkpoints resume the run where it was (``checkpoint_state``): otherwise
    #: ``output.checkpoint_every_*`` are ignored and checkpoints stay per epoch
    mid_epoch_checkpoints: ClassVar[bool] = False
    #: the whole job's communicator, set by :meth:`worker_comm`
    world: Any = None
    #: seconds of the last step's exchange hidden under compute (overlap; the Trainer logs it)
    hidden_s: float = 0.0
    #: seconds the last step waited for the slowest rank before its exchange (Horovod's
    #: negotiation: load imbalance, not the network; the Trainer logs it apart)
    sync_s: float = 0.0
    #: the last step's ``(bucket, start, end)`` Wtime spans of an overlapped exchange (timeline)
    bucket_spans: Sequence[tuple[int, float, float]] = ()

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_config(cls, weight_exchange: Any, seed: int) -> SyncRule:
        """The rule built from its ``weight_exchange`` section (and the run's seed): each rule
        takes the keys it uses, so naming a rule is the one lookup in ``RULES``."""
        return cls()

    # -- description -------------------------------------------------------------------
    @classmethod
    def n_workers(cls, size: int) -> int:
        """Training ranks among ``size`` ranks (all of them, unless a rank serves)."""
        return size

    @classmethod
    def check_world(cls, size: int) -> None:
        """One-line ``ConfigError`` when the rule cannot run on ``size`` ranks."""
        if size < cls.min_ranks:
            raise ConfigError(
                f"{cls.name} needs at least {cls.min_ranks} ranks, got {size}; "
                f"run with -n {cls.min_ranks} or more"
            )

    @classmethod
    def check_accumulate(cls, k: int) -> None:
        """One-line ``ConfigError`` when the rule cannot take ``k`` sub-batches per step."""
        if k > 1 and not cls.supports_accumulation:
            raise ConfigError(
                f"sync_rule {cls.name} does not support training.accumulate_steps={k} "
                "(gradient accumulation); set training.accumulate_steps: 1, or multiply "
                f"model.batch_size by {k} instead"
            )

    @classmethod
    def check_sharding(cls, weight_exchange: Any) -> None:
        """One-line ``ConfigError`` when ``weight_exchange.shard_optimizer`` cannot apply: only
        BSP's gradient exchange has one update for every rank to divide."""
        raise ConfigError(
            f"weight_exchange.shard_optimizer: {cls.name} updates each worker's own replica, "
            "with nothing to divide; set sync_rule: BSP and sync_type: cdd, or "
            "shard_optimizer: false"
        )

    @classmethod
    def shrinks_in_place(cls, weight_exchange: Any) -> bool:
        """Elastic training (``elastic.min_np``): whether the ranks left after a lost one go on
        in the same job (ULFM shrink, :mod:`theanompi.train.elastic`). Otherwise the launcher
        relaunches the job on one rank fewer from the last checkpoint. Only BSP, so far."""
        return False

    def whole_state(self, model: Any) -> contextlib.AbstractContextManager[None]:
        """Collective context around a checkpoint's save: ``model.opt_state`` whole on rank 0
        (a rule that divides it gathers it); by default it is already."""
        return contextlib.nullcontext()

    @property
    def local_opt_state(self) -> bool:
        """Ranks hold different optimiser state (checkpoints write per-rank side files)."""
        return False

    def describe(self) -> str:
        """The start-up line's exchange part, e.g. ``exchange ar/avg``."""
        return self.name

    def settings(self) -> dict[str, Any]:
        """Fields of the record's ``start`` entry."""
        return {}

    # -- roles -------------------------------------------------------------------------
    def server(self, comm: Any) -> Server | None:
        """The serving role of this rank, or ``None`` on a worker."""
        return None

    def worker_comm(self, comm: Any) -> Any:
        """The communicator of the training ranks (collective over ``comm``, the job's)."""
        self.world = comm
        return comm

    @property
    def world_size(self) -> int:
        """Ranks in the job, servers included."""
        return self.world.Get_size()

    # -- the loop's hooks ----------------------------------------------------------------
    def setup(self, model: Any, comm: Any) -> None:
        """Allocate buffers; ``comm`` is :meth:`worker_comm`."""

    @property
    def local_update(self) -> bool:
        """The optimiser step is part of the local compute (``train_step``); False where
        ``after_step`` applies the gradients after exchanging them (BSP ``cdd``)."""
        return True

    def train_step(self, model: Any, x: Any, y: Any) -> tuple[float, float]:
        """Local compute of one step; returns (loss, top-1 error) of the batch."""
        return model.train_step(x, y)

    def accumulate(self, model: Any, x: Any, y: Any, i: int, k: int) -> tuple[float, float]:
        """Local compute of sub-batch ``i`` (0-based) of the ``k`` of one optimiser step
        (gradient accumulation); returns its (loss, top-1 error).

        ``k == 1`` is :meth:`train_step`. Otherwise each sub-batch's gradient is added to
        ``model.grads`` (the first one writes them: ``compute_grads(x, y, accumulate=i > 0)``)
        and after the last one ``model.scale_grads(1 / k)`` leaves their mean there: the
        gradient of one ``k`` times larger batch, as the loss is a mean over the batch. Then
        a rule with :attr:`local_update` takes the optimiser step (``apply_grads``); BSP
        ``cdd`` exchanges the mean in ``after_step`` first.
        """
        if k == 1:
            return self.train_step(model, x, y)
        loss, err = model.compute_grads(x, y, accumulate=i > 0)
        if i + 1 == k:
            model.scale_grads(1.0 / k)
            if self.local_update:
                model.apply_grads()
        return loss, err

    def after_step(self, model: Any, step: int) -> float:
        """Exchange after step ``step`` (1-based); returns the seconds spent exchanging."""
        return 0.0

    def epoch_end(self, model: Any) -> None:
        """Collective over the workers at each epoch end, before validation."""

    def eval_values(self, model: Any) -> list[np.ndarray] | None:
        """Values to validate and checkpoint (collective); ``None``: the model's params."""
        return None

    def finish(self, model: Any) -> dict[str, Any]:
        """Last call on a worker (collective); returns extra summary fields."""
        return {}

    # -- mid-epoch checkpoints -----------------------------------------------------------
    def checkpoint_state(self, model: Any) -> tuple[list[np.ndarray], dict[str, Any]] | None:
        """Collective over the workers at a mid-epoch checkpoint: settle what is in flight,
        then return this rank's own state that a resume needs beside the checkpoint's values
        (arrays, JSON-able meta), or ``None`` where the replicas are the checkpoint's."""
        return None

    def load_checkpoint_state(self, model: Any, arrays: list[np.ndarray], meta: Any) -> None:
        """Take back what :meth:`checkpoint_state` returned on this rank (after ``setup``)."""


def own_values(model: Any) -> list[np.ndarray]:
    """Copies of this rank's parameters, then its optimiser state: a worker's own replica."""
    from theanompi.models.params import get_values

    items = list(model.params) + list(getattr(model, "opt_state", []) or [])
    return [np.array(a, copy=True) for a in get_values(items)]


def set_own_values(model: Any, arrays: list[np.ndarray]) -> None:
    """Set the parameters and optimiser state from :func:`own_values`'s arrays (cast to
    each variable's dtype); ``ValueError`` when they do not fit the model."""
    from theanompi.models.params import get_values, set_values

    items = list(model.params) + list(getattr(model, "opt_state", []) or [])
    have = get_values(items)
    if len(arrays) != len(items) or any(
        a.shape != h.shape for a, h in zip(arrays, have, strict=True)
    ):
        raise ValueError("the saved worker state does not fit this model")
    set_values(items, [np.asarray(a, dtype=h.dtype) for a, h in zip(arrays, have, strict=True)])
