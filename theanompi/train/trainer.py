"""The training loop, written once: epochs and steps over the parts that own the rest (workers, checkpoints, record, progress, lr); a sync rule only keeps the replicas together."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from theanompi.errors import DivergedError, ResourceError
from theanompi.io import startup_trace
from theanompi.io.recorder import Recorder
from theanompi.launch.signals import StopFlag
from theanompi.launch.watchdog import Watchdog
from theanompi.models.params import assert_identical
from theanompi.train.agreement import Agreement
from theanompi.train.checkpoints import Checkpoints
from theanompi.train.elastic import Point
from theanompi.train.epoch_end import EpochEnd
from theanompi.train.progress import TIMES, Progress, StepStats
from theanompi.train.schedule import LRSetter
from theanompi.train.steps import LocalStep, StepTimes, add_step
from theanompi.train.workers import Workers, wtime

__all__ = ["Trainer", "LoopSettings", "wtime"]


@dataclass(frozen=True)
class LoopSettings:
    """The loop's knobs (from the config's ``model``, ``training`` and ``weight_exchange``)."""

    n_epochs: int
    print_freq: int = 10
    check_every: int = 0  # assert replicas bit-identical every K steps (rules that keep them so)
    checkpoint_every_steps: int = 0  # mid-epoch checkpoint every K steps (0: off)
    checkpoint_every_minutes: float = 0.0  # mid-epoch checkpoint every M minutes (0: off)
    #: sub-batches per optimiser step (gradient accumulation); every count above is in steps
    accumulate_steps: int = 1


class Trainer:
    """Run a sync rule's training on the workers' communicator.

    Parameters
    ----------
    model
        A built model (the :class:`~theanompi.models.base.Model` protocol) holding the start
        values on every worker (:func:`~theanompi.train.start_point.start_state`).
    rule
        The :class:`~theanompi.rules.base.SyncRule`, already ``setup`` (and given back a
        mid-epoch checkpoint's own state).
    comm
        The workers' communicator (``rule.worker_comm``).
    train, val
        This rank's :class:`~theanompi.data.TrainLoader` and ``ValLoader``.
    snap
        :class:`~theanompi.train.snapshot.Snapshotter` on ``comm``.
    record
        :class:`~theanompi.io.record.RecordWriter` (enabled on rank 0 only).
    timeline
        :class:`~theanompi.io.timeline.Timeline` (disabled unless asked for).
    schedule
        :class:`~theanompi.train.schedule.LRSchedule` on top of the model's lr policy.
    settings
        :class:`LoopSettings`.
    watchdog
        :class:`~theanompi.launch.watchdog.Watchdog` on the job's communicator (default: none).
    loggers
        :class:`~theanompi.io.loggers.Logger` objects fed each ``step`` and ``epoch`` entry
        right after the record got it (pass them on the rank that writes the record only).
    commit
        Elastic training's :class:`~theanompi.train.elastic.Commit`: the state copied after
        every step and at each epoch's start (default: none).
    """

    def __init__(
        self,
        *,
        model: Any,
        rule: Any,
        comm: Any,
        train: Any,
        val: Any,
        snap: Any,
        record: Any,
        timeline: Any,
        schedule: Any,
        settings: LoopSettings,
        watchdog: Watchdog | None = None,
        loggers: Sequence[Any] = (),
        commit: Any = None,
    ) -> None:
        self.model, self.rule, self.train, self.val = model, rule, train, val
        self.commit = commit
        self.timeline, self.settings = timeline, settings
        self.workers = Workers(comm, getattr(rule, "world", None), watchdog)
        #: sub-batches per optimiser step: a step is K loader steps, its loss their mean
        self.k = max(1, int(settings.accumulate_steps))
        self.tag = rule.name.lower()
        images = train.batch_size * self.k * self.workers.size
        self.progress = Progress(comm, images, tag=self.tag)
        self.recorder = Recorder(record, loggers)
        self.lr = LRSetter(schedule, model.lr)
        self.stats = StepStats()
        self.local_step = LocalStep(model, rule, timeline, self.k, self.workers.rank)
        self.ckpts = Checkpoints(
            snap,
            rule,
            model,
            self.workers,
            timeline,
            n_epochs=settings.n_epochs,
            every_steps=settings.checkpoint_every_steps,
            every_minutes=settings.checkpoint_every_minutes,
            log=self.log,
        )
        self.epoch_end = EpochEnd(
            model,
            rule,
            val,
            workers=self.workers,
            progress=self.progress,
            ckpts=self.ckpts,
            recorder=self.recorder,
            timeline=timeline,
            n_epochs=settings.n_epochs,
            log=self.log,
        )

    def log(self, text: str) -> None:
        """One line on rank 0, tagged with the rule."""
        self.progress.log(f"[{self.tag}] {text}")

    def fit(
        self,
        start_epoch: int = 0,
        step: int = 0,
        last_ckpt: str | None = None,
        start_in_epoch: int = 0,
        dealt: int | None = None,
    ) -> dict[str, Any]:
        """Train epochs ``start_epoch .. n_epochs - 1`` (the first from step ``start_in_epoch``
        of it, after a mid-epoch checkpoint; or, after an elastic shrink, from the ``dealt``
        sub-batches of it that a world of another size trained); returns the summary (every
        rank).

        A nan/inf loss on any rank raises :class:`~theanompi.errors.DivergedError` on every
        worker at the next agreement point (at most 10 steps later), before any checkpoint
        of the bad values is written. A full disk or refused write of a rank-local output
        (the record) prints one line and aborts the job with exit 4.
        """
        try:
            return self._fit(start_epoch, step, last_ckpt, start_in_epoch, dealt)
        except ResourceError as err:
            if not (err.agreed or self.workers.size == 1):
                self.workers.abort(err)
            raise
        except DivergedError as err:
            self.workers.end_beside_servers(err)
            raise

    def _fit(
        self,
        start_epoch: int,
        step: int,
        last_ckpt: str | None,
        start_in_epoch: int,
        dealt: int | None,
    ) -> dict[str, Any]:
        t_start = wtime()
        model, rule, w = self.model, self.rule, self.workers
        summary: dict[str, Any] = {"val_top1_err": None, "val_top5_err": None, "val_loss": None}
        interrupted = False
        epoch = epochs_done = start_epoch
        self.ckpts.start(last_ckpt)
        with StopFlag() as stop:
            for epoch in range(start_epoch, self.settings.n_epochs):
                first = epoch == start_epoch
                k0 = start_in_epoch if first else 0
                step, interrupted = self._epoch(epoch, step, stop, k0, dealt if first else None)
                if interrupted:
                    break
                summary.update(
                    self.epoch_end.conclude(
                        epoch, step, self.stats.since(self._ep_first), self._ep_t0
                    )
                )
                epochs_done = epoch + 1
        s = self.stats
        with w.waiting("the rule's finish", collective=rule.synchronous):
            extra = rule.finish(model)
            steps = step if rule.synchronous else w.sum(len(s))
        summary.update(
            epochs=epochs_done,
            steps=steps,
            world_size=rule.world_size,
            seconds=wtime() - t_start,
            checkpoint=self.ckpts.last,
            interrupted=interrupted,
            images_per_s=self.progress.images_per_s(s),
            **s.split(),
            **{f"median_{k}_s": s.median(k) for k in TIMES},
            **extra,
        )
        if interrupted:
            self.log(
                f"interrupted at epoch {epoch + 1} step {step}; last checkpoint: "
                f"{self.ckpts.last or 'none'} (continue with --resume)"
            )
        self.recorder.add_end(summary)
        return summary

    def _epoch(
        self, epoch: int, step: int, stop: StopFlag, k0: int = 0, dealt: int | None = None
    ) -> tuple[int, bool]:
        """One epoch of steps (from step ``k0`` of it, or from its ``dealt`` sub-batches
        already trained); returns the step count and whether the ranks agreed to stop."""
        model, rule, w, s = self.model, self.rule, self.workers, self.stats
        n = self.train.steps_per_epoch // self.k  # optimiser steps of K sub-batches
        per_step = self.k * w.size  # sub-batches of the epoch one optimiser step trains
        if dealt is None:
            dealt = k0 * per_step
        else:  # a world of another size trained them: the steps left of this world's epoch
            k0 = n - self.train.steps_left(dealt) // self.k
        self._commit(epoch, step, dealt, always=True)
        print_freq = max(1, self.settings.print_freq)
        check_every = self.settings.check_every if rule.identical_replicas else 0
        agreement = Agreement(w, self.ckpts, min(print_freq, 10))  # Ctrl-C: within 10 steps
        model.adjust_hyperparams(epoch)
        lr = self.lr.new_epoch(float(model.lr.get_value()), step)
        self._ep_first, self._ep_t0 = len(s), wtime()
        win_start = len(s)
        interrupted = False
        with self.train.epoch(epoch, k0 * self.k, dealt) as batches:
            for k in range(k0, n):
                lr = self.lr.at_step(step)
                t0 = wtime()
                loss, err, waited = self.local_step.compute(batches, step)
                agreement.saw(loss, step + 1)
                t2 = wtime()
                with w.waiting("the exchange", collective=rule.synchronous):
                    exch = rule.after_step(model, step + 1)
                if step == 0 or k == k0:
                    w.watchdog.arm()  # the first step (compilation, start-up) is behind us
                    startup_trace.mark("first_step")
                    startup_trace.write()
                t3 = wtime()
                step += 1
                self._commit(epoch, step, dealt + (k + 1 - k0) * per_step)
                last = k + 1 == n
                ckpt_due = self.ckpts.step_due(k + 1, last)
                save_mid = False
                if agreement.due(k + 1, last, ckpt_due):  # every few steps, not every step
                    interrupted, save_mid = agreement.reach(stop.requested, epoch)
                    save_mid = (save_mid or ckpt_due) and not last
                add_step(
                    s,
                    self.timeline,
                    rule,
                    step,
                    loss,
                    err,
                    StepTimes(t0, t2, t3, wtime(), waited, exch),
                )
                if check_every and step % check_every == 0:
                    with w.waiting("the replica check"):
                        assert_identical(model.params, w.comm, step)
                if (k + 1) % print_freq == 0 or last:
                    self._window(s.since(win_start), epoch, k + 1, n, step, lr)
                    win_start = len(s)
                # a checkpoint only ever at an optimiser-step boundary (after its K sub-batches)
                if self.ckpts.mid_ok and (save_mid or interrupted):  # Ctrl-C: that step's
                    self.ckpts.save_mid(epoch, k + 1, step, dealt + (k + 1 - k0) * per_step)
                if interrupted:
                    break
        return step, interrupted

    def _commit(self, epoch: int, step: int, dealt: int, *, always: bool = False) -> None:
        """Elastic: the state after ``step`` (``dealt`` sub-batches of ``epoch`` trained) as
        the point a shrink goes back to."""
        if self.commit is not None:
            self.commit.keep(Point(epoch, step, dealt, self.ckpts.last), always=always)

    def _window(self, stats: StepStats, epoch: int, k: int, n: int, step: int, lr: float) -> None:
        """The progress line and ``step`` entry of the steps since the last one."""
        with self.workers.waiting("the progress line"):
            entry = self.progress.window(
                stats,
                epoch=epoch,
                n_epochs=self.settings.n_epochs,
                step_in_epoch=k,
                steps_per_epoch=n,
                step=step,
                lr=lr,
            )
        self.recorder.add_step(entry)

    def average_buffers(self) -> None:
        """Collective over the workers: every rank's ``model.buffers`` (batch-norm running
        statistics) replaced by their mean (:meth:`Workers.average_buffers`); the loop does it
        at each epoch end (before validation and the checkpoint) and before a mid-epoch
        checkpoint."""
        self.workers.average_buffers(self.model)
