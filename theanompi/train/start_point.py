"""Where training starts: every worker on the same values (rank 0's, or the checkpoint's on resume) and the rule set up on them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from theanompi.errors import ConfigError
from theanompi.models.params import bcast_values

__all__ = ["StartPoint", "start_state"]


@dataclass(frozen=True)
class StartPoint:
    """Where the loop starts: epoch, global step, the checkpoint resumed from and, after a
    mid-epoch checkpoint, the optimiser steps of ``epoch`` already done (what
    :meth:`~theanompi.train.trainer.Trainer.fit` takes)."""

    epoch: int = 0
    step: int = 0
    checkpoint: str | None = None
    step_in_epoch: int = 0
    #: the sub-batches of ``epoch`` trained (by all ranks) at a mid-epoch checkpoint that says
    #: so; None: ``step_in_epoch`` whole steps of this world
    dealt: int | None = None
    #: the record entry of the epoch an epoch checkpoint closed (``None``: none carried)
    epoch_entry: dict[str, Any] | None = None


def _resumed(snap: Any, k: int, n_epochs: int, log: Callable[[str], None]) -> StartPoint:
    """The latest checkpoint, restored on every worker. A mid-epoch checkpoint counts
    optimiser steps of the ``accumulate_steps`` it was written with: a different ``k`` would
    restart the loader elsewhere, so it is refused."""
    ck = snap.restore()
    dealt, entry = ck.meta.get("dealt"), ck.meta.get("record")
    start = StartPoint(
        ck.epoch,
        ck.step,
        str(ck.path),
        int(ck.meta.get("step_in_epoch", 0)),
        None if dealt is None else int(dealt),
        None if entry is None else entry | {"checkpoint": str(ck.path)},
    )
    written = ck.meta.get("config", {}).get("training", {}).get("accumulate_steps", 1)
    if start.step_in_epoch and int(written) != k:
        raise ConfigError(
            f"resume: {ck.path.name} was written mid-epoch with training.accumulate_steps="
            f"{written}, now {k}; set training.accumulate_steps: {written} to resume it "
            "(change it at an epoch checkpoint)"
        )
    log(f"resumed from {ck.path} (epoch {start.epoch}, step {start.step})")
    if start.epoch >= n_epochs:
        log(
            f"{start.epoch} epoch(s) already done of model.n_epochs={n_epochs}; "
            "nothing to train (raise --epochs to continue)"
        )
    return start


def start_state(
    snap: Any,
    model: Any,
    rule: Any,
    comm: Any,
    *,
    resume: bool,
    k: int,
    n_epochs: int,
    log: Callable[[str], None],
) -> StartPoint:
    """Collective over the workers ``comm``: the start values in ``model`` on every worker,
    the rule set up on them; returns where the loop starts.

    On ``resume`` the latest checkpoint of ``snap`` (``k``: ``training.accumulate_steps``;
    ``n_epochs``: the run's epochs, for the note when none are left), else rank 0's
    parameters and optimiser state; the buffers (batch-norm statistics) are worker 0's
    either way. Then ``rule.setup``, and a mid-epoch checkpoint's own state of this rank
    (EASGD, GOSGD) goes back to the rule (``load_checkpoint_state``).
    """
    if resume:
        start = _resumed(snap, k, n_epochs, log)
    else:
        start = StartPoint()
        bcast_values(model.params, comm)
        bcast_values(model.opt_state, comm)
    bcast_values(getattr(model, "buffers", []), comm)  # worker 0's (the checkpoint's on resume)
    rule.setup(model, comm)
    own = getattr(snap, "rank_state", None)  # a mid-epoch checkpoint's worker state
    if own is not None and start.step_in_epoch:  # only rules with checkpoint_state write one
        rule.load_checkpoint_state(model, *own)
    return start
