"""When and how the loop checkpoints: epoch and mid-epoch checkpoints of the rule's values, each after a finite-parameter check."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from theanompi.models.params import holding
from theanompi.train.agreement import check_finite
from theanompi.train.workers import Workers, wtime

__all__ = ["Checkpoints"]


class Checkpoints:
    """The run's checkpoints as the loop writes them, and the last one written.

    Mid-epoch checkpoints (``output.checkpoint_every_steps`` / ``_minutes``, and the one a
    stop request writes) only for rules that can resume from one (BSP, EASGD, GOSGD);
    otherwise a note says they are ignored and checkpoints stay per epoch.

    Parameters
    ----------
    snap
        The run's :class:`~theanompi.train.snapshot.Snapshotter`.
    rule, model
        The sync rule and the model whose values are saved.
    workers
        :class:`~theanompi.train.workers.Workers` (every save is collective).
    timeline
        :class:`~theanompi.io.timeline.Timeline`: each save is a ``checkpoint`` span.
    n_epochs
        The run's epochs (the last one is always checkpointed).
    every_steps, every_minutes
        Mid-epoch checkpoint periods (0: off).
    log
        Rank 0's line printer (the note above).
    """

    def __init__(
        self,
        snap: Any,
        rule: Any,
        model: Any,
        workers: Workers,
        timeline: Any,
        *,
        n_epochs: int,
        every_steps: int = 0,
        every_minutes: float = 0.0,
        log: Callable[[str], None] = print,
    ) -> None:
        self.snap, self.rule, self.model = snap, rule, model
        self.workers, self.timeline = workers, timeline
        self.n_epochs = int(n_epochs)
        self.mid_ok = bool(getattr(rule, "mid_epoch_checkpoints", rule.identical_replicas))
        if not self.mid_ok and (every_steps > 0 or every_minutes > 0):
            log(
                f"note: output.checkpoint_every_* are ignored for {rule.name}: it cannot resume "
                "mid-epoch (checkpoints stay per epoch)"
            )
        self.every_steps = int(every_steps) if self.mid_ok else 0
        self.every_minutes = float(every_minutes)
        self.last: str | None = None  # the last checkpoint written (or resumed from)
        self._next_t = 0.0  # wtime() of the next minute-based checkpoint

    def start(self, last: str | None) -> None:
        """The run starts (or resumes from checkpoint ``last``): the minute clock starts."""
        self.last = last
        self._next_t = wtime() + 60 * self.every_minutes

    def minute_due(self) -> bool:
        """Whether the minutes of a mid-epoch checkpoint have passed (worker 0 decides)."""
        return self.mid_ok and self.every_minutes > 0 and wtime() >= self._next_t

    def step_due(self, k: int, last: bool) -> bool:
        """Whether step ``k`` of an epoch (1-based, ``last`` of it or not) is a step-count
        checkpoint (never the epoch's last: the epoch checkpoint follows it)."""
        return bool(self.every_steps) and k % self.every_steps == 0 and not last

    def save_mid(self, epoch: int, k: int, step: int, dealt: int) -> None:
        """Collective: a mid-epoch checkpoint after ``k`` steps of ``epoch`` (``dealt`` of its
        sub-batches trained, by all ranks: a resume on another number of ranks deals the rest):
        the rule's values (EASGD's centre, GOSGD's weighted mean) with each rank's own state
        beside them."""
        t0 = wtime()
        model, rule = self.model, self.rule
        with self.workers.waiting("a mid-epoch checkpoint"):
            check_finite(self.workers, model.params, epoch=epoch, step=step, last_ckpt=self.last)
            self.workers.average_buffers(model)
            settle = getattr(rule, "checkpoint_state", None)  # a SyncRule's: nothing in flight
            state = settle(model) if settle is not None else None
            with rule.whole_state(model), holding(model.params, rule.eval_values(model)):
                extra = {"mid_epoch": True, "dealt": dealt}
                saved = self.snap.save(epoch, step, extra, k, rank_state=state)
            self.last = str(saved)
        self._next_t = wtime() + 60 * self.every_minutes
        self.timeline.add("checkpoint", t0, wtime(), step=step)

    def save_epoch(
        self, epoch: int, step: int, val: dict[str, Any], t0: float, entry: dict[str, Any]
    ) -> str | None:
        """Collective, with the values to keep in ``model.params``: the checkpoint of finished
        ``epoch`` (with its validation ``val`` and its record ``entry``, JSON-safe) when
        ``output.snapshot_freq`` says so; its path, else None. ``t0``: when the epoch's close
        began writing (the span's start)."""
        if not self.snap.due(epoch + 1, self.n_epochs):
            return None
        with self.workers.waiting("the epoch checkpoint"):
            check_finite(
                self.workers, self.model.params, epoch=epoch, step=step, last_ckpt=self.last
            )
            with self.rule.whole_state(self.model):
                saved = str(self.snap.save(epoch + 1, step, {"val": val, "record": entry}))
        self.timeline.add("checkpoint", t0, wtime(), epoch=epoch)
        self.last = saved
        return saved
