"""The training loop, written once: epochs and steps, the timing split, the ranks' stop agreement,
progress lines, the record, the timeline, validation and checkpoints. A sync rule
(:mod:`theanompi.rules`) only says how the replicas are kept together."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from theanompi.data._fault import fault_point
from theanompi.metrics import validate
from theanompi.params import assert_identical, get_values, set_values
from theanompi.progress import Progress, StepStats
from theanompi.signals import StopFlag

__all__ = ["Trainer", "LoopSettings", "wtime"]


def wtime() -> float:
    """``MPI.Wtime()`` (seconds)."""
    from mpi4py import MPI

    return MPI.Wtime()


@dataclass(frozen=True)
class LoopSettings:
    """The loop's knobs (from the config's ``model``, ``training`` and ``weight_exchange``)."""

    n_epochs: int
    print_freq: int = 10
    check_every: int = 0  # assert replicas bit-identical every K steps (rules that keep them so)


class Trainer:
    """Run a sync rule's training on the workers' communicator.

    Parameters
    ----------
    model
        A built model (the :class:`~theanompi.models.base.Model` protocol).
    rule
        The :class:`~theanompi.rules.base.SyncRule`, already ``setup``.
    comm
        The workers' communicator (``rule.worker_comm``).
    train, val
        This rank's :class:`~theanompi.data.TrainLoader` and ``ValLoader``.
    snap
        :class:`~theanompi.snapshot.Snapshotter` on ``comm``.
    record
        :class:`~theanompi.record.RecordWriter` (enabled on rank 0 only).
    timeline
        :class:`~theanompi.timeline.Timeline` (disabled unless asked for).
    schedule
        :class:`~theanompi.schedule.LRSchedule` on top of the model's lr policy.
    settings
        :class:`LoopSettings`.
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
    ) -> None:
        self.model, self.rule, self.comm = model, rule, comm
        self.train, self.val, self.snap = train, val, snap
        self.record, self.timeline, self.schedule = record, timeline, schedule
        self.settings = settings
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.tag = rule.name.lower()
        self.progress = Progress(comm, train.batch_size * self.size, tag=self.tag)
        self.stats = StepStats()

    def log(self, text: str) -> None:
        self.progress.log(f"[{self.tag}] {text}")

    # -- the loop ------------------------------------------------------------------------
    def fit(
        self, start_epoch: int = 0, step: int = 0, last_ckpt: str | None = None
    ) -> dict[str, Any]:
        """Train epochs ``start_epoch .. n_epochs - 1``; returns the summary (every rank)."""
        t_start = wtime()
        n_epochs = self.settings.n_epochs
        summary: dict[str, Any] = {"val_top1_err": None, "val_top5_err": None, "val_loss": None}
        interrupted = False
        epoch = epochs_done = start_epoch
        with StopFlag() as stop:
            for epoch in range(start_epoch, n_epochs):
                step, interrupted = self._epoch(epoch, step, stop)
                if interrupted:
                    break
                v, saved = self._close_epoch(epoch, step)
                summary.update(v)
                last_ckpt = saved or last_ckpt
                epochs_done = epoch + 1
        extra = self.rule.finish(self.model)
        s = self.stats
        steps = step if self.rule.synchronous else int(self.comm.allreduce(len(s)))
        summary.update(
            epochs=epochs_done,
            steps=steps,
            world_size=self.rule.world_size,
            seconds=wtime() - t_start,
            checkpoint=last_ckpt,
            interrupted=interrupted,
            images_per_s=self._ips(s),
            **s.split(),
            **{f"median_{k}_s": s.median(k) for k in ("wall", "compute", "exchange", "wait")},
            **extra,
        )
        if interrupted:
            self.log(
                f"interrupted at epoch {epoch + 1} step {step}; last checkpoint: "
                f"{last_ckpt or 'none'} (continue with --resume)"
            )
        self.record.write("end", **summary)
        return summary

    def _ips(self, s: StepStats) -> float | None:
        wall = float(np.sum(s.wall))
        return self.train.batch_size * self.size * len(s) / wall if len(s) and wall > 0 else None

    def _epoch(self, epoch: int, step: int, stop: StopFlag) -> tuple[int, bool]:
        """One epoch of steps; returns the step count and whether the ranks agreed to stop."""
        model, rule, tl, s = self.model, self.rule, self.timeline, self.stats
        n = self.train.steps_per_epoch
        print_freq = max(1, self.settings.print_freq)
        stop_every = min(print_freq, 10)  # steps between the ranks' Ctrl-C agreement
        check_every = self.settings.check_every if rule.identical_replicas else 0
        model.adjust_hyperparams(epoch)
        epoch_lr = float(model.lr.get_value())
        lr = self._set_lr(epoch_lr, step, None)
        self._ep_first, self._ep_t0 = len(s), wtime()
        win_start = len(s)
        interrupted = False
        with self.train.epoch(epoch) as batches:
            for k in range(n):
                lr = self._set_lr(epoch_lr, step, lr)
                t0 = wtime()
                x, y = next(batches)
                t1 = wtime()
                fault_point("step", self.rank, step)
                loss, err = rule.train_step(model, x, y)
                t2 = wtime()
                exch = rule.after_step(model, step + 1)
                t3 = wtime()
                step += 1
                last = k + 1 == n
                if (k + 1) % stop_every == 0 or last:  # one sync point less on most steps
                    interrupted = stop.any(self.comm)
                t4 = wtime()
                s.add(loss, err, (t3 - t1) - exch, exch + (t4 - t3), t1 - t0, t4 - t0)
                tl.add("wait", t0, t1, step=step)
                tl.add("compute", t1, t2, step=step)
                tl.add("exchange", t2, t4, step=step)
                if check_every and step % check_every == 0:
                    assert_identical(model.params, self.comm, step)
                if (k + 1) % print_freq == 0 or last:
                    entry = self.progress.window(
                        s.since(win_start),
                        epoch=epoch,
                        n_epochs=self.settings.n_epochs,
                        step_in_epoch=k + 1,
                        steps_per_epoch=n,
                        step=step,
                        lr=lr,
                    )
                    self.record.write("step", **entry)
                    win_start = len(s)
                if interrupted:
                    break
        return step, interrupted

    def _set_lr(self, epoch_lr: float, step: int, current: float | None) -> float:
        lr = self.schedule.lr(epoch_lr, step)
        if lr != current:
            self.model.lr.set_value(np.asarray(lr, dtype=self.model.lr.get_value().dtype))
        return lr

    def _close_epoch(self, epoch: int, step: int) -> tuple[dict[str, Any], str | None]:
        """Validate (and checkpoint) the rule's values of a finished epoch; record and log it."""
        model, rule, tl = self.model, self.rule, self.timeline
        n_epochs = self.settings.n_epochs
        ep = self.stats.since(self._ep_first)
        tr_loss, tr_err = self.progress.reduce_mean([ep.mean("loss"), ep.mean("err")])
        rule.epoch_end(model)
        values = rule.eval_values(model)
        own = None
        if values is not None:  # validate and save the rule's values, then train on our own
            own = [np.array(a, copy=True) for a in get_values(model.params)]
            set_values(model.params, values)
        t1 = wtime()
        v = validate(model, self.val, self.comm)
        t2 = wtime()
        tl.add("validate", t1, t2, epoch=epoch)
        saved = None
        if self.snap.due(epoch + 1, n_epochs):
            saved = str(self.snap.save(epoch + 1, step, {"val": v}))
            tl.add("checkpoint", t2, wtime(), epoch=epoch)
        if own is not None:
            set_values(model.params, own)
        ep_secs = wtime() - self._ep_t0
        ips = self._ips(ep)
        lr = float(model.lr.get_value())
        self.record.write(
            "epoch",
            epoch=epoch,
            step=step,
            train_loss=tr_loss,
            train_error=tr_err,
            lr=lr,
            images_per_s=ips,
            seconds=ep_secs,
            checkpoint=saved,
            **ep.split(),
            **v,
        )
        self.log(
            f"epoch {epoch + 1}/{n_epochs} done in {ep_secs:.1f} s: train loss "
            f"{tr_loss:.4f} err {tr_err * 100:.2f}% | val loss {v['val_loss']:.4f} top-1 err "
            f"{v['val_top1_err'] * 100:.2f}% top-5 err {v['val_top5_err'] * 100:.2f}% "
            f"(n={v['val_n']}) | {ips or 0:,.0f} img/s" + (f" | saved {saved}" if saved else "")
        )
        return v, saved
