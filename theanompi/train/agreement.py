"""What the workers agree on before they go on: stop, a nan/inf seen anywhere, a checkpoint due; one small allreduce each."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from theanompi.errors import DivergedError
from theanompi.train.workers import Workers

__all__ = ["Agreement", "agree", "check_finite"]

_NONE = np.iinfo(np.int64).max  # no rank saw a nan/inf


def _fix(last_ckpt: str | None) -> str:
    return (
        f"last good checkpoint: {last_ckpt or 'none'} (lower the learning rate, then --resume "
        "from it or start again)"
    )


def agree(
    workers: Workers,
    stop: bool,
    bad_step: int | None,
    minute_due: bool,
    *,
    epoch: int,
    last_ckpt: str | None,
) -> tuple[bool, bool]:
    """Collective: (stop?, minute checkpoint due?) over the workers, from this rank's stop
    request, first step with a nan/inf loss (``None``: none) and, on worker 0, its clock.

    Raises :class:`~theanompi.errors.DivergedError` on every worker when any saw a nan/inf
    loss, naming the first such step and its rank in the job."""
    size, rank = workers.size, workers.rank
    out = workers.min(
        [
            -int(stop),
            _NONE if bad_step is None else bad_step * size + rank,
            -int(minute_due and rank == 0),
        ]
    )
    if out[1] != _NONE:
        step, bad_rank = divmod(int(out[1]), size)
        raise DivergedError(
            f"the loss became nan/inf at step {step} (epoch {epoch + 1}) on rank "
            f"{workers.peers[bad_rank]}; training stopped; {_fix(last_ckpt)}"
        )
    return bool(out[0]), bool(out[2])


def check_finite(
    workers: Workers, params: Sequence[Any], *, epoch: int, step: int, last_ckpt: str | None
) -> None:
    """Collective, before a checkpoint: :class:`~theanompi.errors.DivergedError` on every
    worker when any worker's parameters hold a nan/inf (a finite loss can still leave inf
    weights behind), naming the first such parameter and its rank in the job."""
    size, n = workers.size, len(params)
    bad = next(
        (i for i, p in enumerate(params) if not np.isfinite(p.get_value(borrow=True)).all()), -1
    )
    key = int(workers.min([size * n if bad < 0 else bad * size + workers.rank])[0])
    if key < size * n:
        i, r = divmod(key, size)
        name = getattr(params[i], "name", None) or f"#{i}"
        raise DivergedError(
            f"parameter {name!r} became nan/inf by step {step} (epoch {epoch + 1}) on rank "
            f"{workers.peers[r]}; training stopped before checkpointing it; {_fix(last_ckpt)}"
        )


class Agreement:
    """The workers' agreement of the loop, every ``every`` steps (and at an epoch's last step
    and a step-count checkpoint): a stop request, this rank's first nan/inf loss, worker 0's
    minute clock of the mid-epoch checkpoints.

    Parameters
    ----------
    workers
        :class:`~theanompi.train.workers.Workers`.
    ckpts
        :class:`~theanompi.train.checkpoints.Checkpoints`: the minute clock and the last
        checkpoint a divergence names.
    every
        Steps between agreements (``min(print_freq, 10)``: a Ctrl-C stops within 10 steps).
    """

    def __init__(self, workers: Workers, ckpts: Any, every: int) -> None:
        self.workers, self.ckpts, self.every = workers, ckpts, max(1, int(every))
        self.bad: int | None = None  # first step with a nan/inf loss on this rank

    def saw(self, loss: float, step: int) -> None:
        """Step ``step`` had ``loss`` on this rank."""
        if self.bad is None and not math.isfinite(loss):
            self.bad = step

    def due(self, k: int, last: bool, ckpt_due: bool) -> bool:
        """Whether the workers agree after step ``k`` of an epoch (1-based)."""
        return k % self.every == 0 or last or ckpt_due

    def reach(self, stop: bool, epoch: int) -> tuple[bool, bool]:
        """Collective :func:`agree`: (stop?, minute checkpoint due?)."""
        with self.workers.waiting("the stop agreement"):
            return agree(
                self.workers,
                stop,
                self.bad,
                self.ckpts.minute_due(),
                epoch=epoch,
                last_ckpt=self.ckpts.last,
            )
