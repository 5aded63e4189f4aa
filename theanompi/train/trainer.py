"""The training loop, written once: epochs and steps, the timing split, the ranks' stop agreement,
progress lines, the record, the timeline, validation and checkpoints. A sync rule
(:mod:`theanompi.rules`) only says how the replicas are kept together."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from theanompi.data._fault import fault_point
from theanompi.errors import DivergedError, ResourceError
from theanompi.launch.signals import StopFlag
from theanompi.launch.watchdog import Watchdog
from theanompi.models.metrics import validate
from theanompi.models.params import (
    ParamBuffer,
    assert_identical,
    bcast_values,
    get_values,
    set_values,
)
from theanompi.train.progress import TIMES, Progress, StepStats

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
    checkpoint_every_steps: int = 0  # mid-epoch checkpoint every K steps (0: off)
    checkpoint_every_minutes: float = 0.0  # mid-epoch checkpoint every M minutes (0: off)
    #: sub-batches per optimiser step (gradient accumulation); every count above is in steps
    accumulate_steps: int = 1


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
    ) -> None:
        self.model, self.rule, self.comm = model, rule, comm
        self.train, self.val, self.snap = train, val, snap
        self.record, self.timeline, self.schedule = record, timeline, schedule
        self.loggers = list(loggers)
        self.settings = settings
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.tag = rule.name.lower()
        #: sub-batches per optimiser step: a step is K loader steps, its loss their mean
        self.k = max(1, int(settings.accumulate_steps))
        self.progress = Progress(comm, train.batch_size * self.k * self.size, tag=self.tag)
        self.stats = StepStats()
        self.wd = watchdog if watchdog is not None else Watchdog(comm, 0)
        self.last_ckpt: str | None = None
        self._next_ckpt_t = 0.0  # wtime() of the next minute-based checkpoint
        # mid-epoch checkpoints: rules that can resume from one (BSP, EASGD, GOSGD)
        self.mid_ok = bool(getattr(rule, "mid_epoch_checkpoints", rule.identical_replicas))
        if not self.mid_ok and self._mid_asked():
            self.log(
                f"note: output.checkpoint_every_* are ignored for {rule.name}: it cannot resume "
                "mid-epoch (checkpoints stay per epoch)"
            )
        # the watchdog names ranks of the job; the workers' communicator may be smaller
        self.peers = self._world_ranks()

    def log(self, text: str) -> None:
        self.progress.log(f"[{self.tag}] {text}")

    def _emit(self, kind: str, **fields: Any) -> None:
        """A ``step`` or ``epoch`` entry: to the record, then, as written, to each logger."""
        entry = self.record.write(kind, **fields)
        for lg in self.loggers:
            (lg.on_step if kind == "step" else lg.on_epoch)(entry)

    # -- the loop ------------------------------------------------------------------------
    def _mid_asked(self) -> bool:
        st = self.settings
        return st.checkpoint_every_steps > 0 or st.checkpoint_every_minutes > 0

    def _world_ranks(self) -> list[int]:
        world = getattr(self.rule, "world", None)
        if world is None or world is self.comm or world.Get_size() == self.size:
            return list(range(self.size))
        from mpi4py import MPI

        got = MPI.Group.Translate_ranks(
            self.comm.Get_group(), list(range(self.size)), world.Get_group()
        )
        return [int(r) for r in got]

    def _waiting(self, phase: str, collective: bool = True) -> Any:
        """Context: a wait the watchdog watches, a collective over the workers by default."""
        return self.wd.waiting(phase, self.peers if collective else None, collective=collective)

    def fit(
        self,
        start_epoch: int = 0,
        step: int = 0,
        last_ckpt: str | None = None,
        start_in_epoch: int = 0,
    ) -> dict[str, Any]:
        """Train epochs ``start_epoch .. n_epochs - 1`` (the first from step ``start_in_epoch``
        of it, after a mid-epoch checkpoint); returns the summary (every rank).

        A nan/inf loss on any rank raises :class:`~theanompi.errors.DivergedError` on every
        worker at the next agreement point (at most 10 steps later), before any checkpoint
        of the bad values is written. A full disk or refused write of a rank-local output
        (the record) prints one line and aborts the job with exit 4.
        """
        try:
            return self._fit(start_epoch, step, last_ckpt, start_in_epoch)
        except ResourceError as err:
            if err.agreed or self.size == 1:
                raise
            _abort_job(self.rule, self.rank, err)
            raise
        except DivergedError as err:
            world = getattr(self.rule, "world", None)
            if world is not None and world.Get_size() != self.size:
                # a serving rank (EASGD) waits for requests that will not come: end the job;
                # worker 0 reports, the others wait for its abort to stop them
                if self.rank == 0:
                    print(f"tmpi: error: {err}", file=sys.stderr, flush=True)
                    world.Abort(err.exit_code)
                time.sleep(10)
                world.Abort(err.exit_code)
            raise

    def _fit(
        self, start_epoch: int, step: int, last_ckpt: str | None, start_in_epoch: int
    ) -> dict[str, Any]:
        t_start = wtime()
        n_epochs = self.settings.n_epochs
        with self._waiting("the buffer broadcast"):  # worker 0's (the checkpoint's on resume)
            bcast_values(getattr(self.model, "buffers", []), self.comm)
        own = getattr(self.snap, "rank_state", None)  # a mid-epoch checkpoint's worker state
        if own is not None and start_in_epoch:  # only rules with checkpoint_state write one
            self.rule.load_checkpoint_state(self.model, *own)
        summary: dict[str, Any] = {"val_top1_err": None, "val_top5_err": None, "val_loss": None}
        interrupted = False
        epoch = epochs_done = start_epoch
        self.last_ckpt = last_ckpt
        self._next_ckpt_t = wtime() + 60 * self.settings.checkpoint_every_minutes
        with StopFlag() as stop:
            for epoch in range(start_epoch, n_epochs):
                k0 = start_in_epoch if epoch == start_epoch else 0
                step, interrupted = self._epoch(epoch, step, stop, k0)
                if interrupted:
                    break
                v, saved = self._close_epoch(epoch, step)
                summary.update(v)
                self.last_ckpt = saved or self.last_ckpt
                epochs_done = epoch + 1
        last_ckpt = self.last_ckpt
        s = self.stats
        with self._waiting("the rule's finish", collective=self.rule.synchronous):
            extra = self.rule.finish(self.model)
            steps = step if self.rule.synchronous else self._sum_over_ranks(len(s))
        summary.update(
            epochs=epochs_done,
            steps=steps,
            world_size=self.rule.world_size,
            seconds=wtime() - t_start,
            checkpoint=last_ckpt,
            interrupted=interrupted,
            images_per_s=self._ips(s),
            **s.split(),
            **{f"median_{k}_s": s.median(k) for k in TIMES},
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
        images = self.train.batch_size * self.k * self.size * len(s)
        return images / wall if len(s) and wall > 0 else None

    def _local_step(self, batches: Any, step: int) -> tuple[float, float, float]:
        """The local compute of optimiser step ``step + 1``: its K sub-batches, each fetched
        (timed as *wait*) and given to the rule (``rule.accumulate``). Returns the mean loss
        and error over the sub-batches and the seconds waited for data."""
        model, rule, tl, k = self.model, self.rule, self.timeline, self.k
        loss = err = waited = 0.0
        for i in range(k):
            t0 = wtime()
            x, y = next(batches)
            t1 = wtime()
            if i == 0:
                fault_point("step", self.rank, step)
            sub_loss, sub_err = rule.accumulate(model, x, y, i, k)
            loss, err, waited = loss + sub_loss, err + sub_err, waited + (t1 - t0)
            tl.add("wait", t0, t1, step=step + 1)
            tl.add("compute", t1, wtime(), step=step + 1)
        return loss / k, err / k, waited

    def _epoch(self, epoch: int, step: int, stop: StopFlag, k0: int = 0) -> tuple[int, bool]:
        """One epoch of steps (from step ``k0`` of it); returns the step count and whether the
        ranks agreed to stop."""
        model, rule, tl, s, wd = self.model, self.rule, self.timeline, self.stats, self.wd
        n = self.train.steps_per_epoch // self.k  # optimiser steps of K sub-batches
        print_freq = max(1, self.settings.print_freq)
        stop_every = min(print_freq, 10)  # steps between the ranks' Ctrl-C agreement
        check_every = self.settings.check_every if rule.identical_replicas else 0
        every = self.settings.checkpoint_every_steps if self.mid_ok else 0
        model.adjust_hyperparams(epoch)
        epoch_lr = float(model.lr.get_value())
        lr = self._set_lr(epoch_lr, step, None)
        self._ep_first, self._ep_t0 = len(s), wtime()
        win_start = len(s)
        interrupted = False
        bad: int | None = None  # first step with a nan/inf loss on this rank
        with self.train.epoch(epoch, k0 * self.k) as batches:
            for k in range(k0, n):
                lr = self._set_lr(epoch_lr, step, lr)
                t0 = wtime()
                loss, err, waited = self._local_step(batches, step)
                if bad is None and not math.isfinite(loss):
                    bad = step + 1
                t2 = wtime()
                with self._waiting("the exchange", collective=rule.synchronous):
                    exch = rule.after_step(model, step + 1)
                if step == 0 or k == k0:
                    wd.arm()  # the first step (compilation, start-up) is behind us
                t3 = wtime()
                step += 1
                last = k + 1 == n
                ckpt_due = bool(every) and (k + 1) % every == 0 and not last
                save_mid = False
                # the ranks agree (Ctrl-C, nan, checkpoint due) every few steps, not every step
                if (k + 1) % stop_every == 0 or last or ckpt_due:
                    with self._waiting("the stop agreement"):
                        interrupted, save_mid = self._agree(stop, bad, epoch, step)
                    save_mid = (save_mid or ckpt_due) and not last
                t4 = wtime()
                hidden, sync = rule.hidden_s, rule.sync_s  # under compute; for the slowest rank
                s.add(
                    loss,
                    err,
                    (t3 - t0) - waited - exch,
                    exch - sync + (t4 - t3),
                    waited,
                    t4 - t0,
                    hidden,
                    sync,
                )
                if sync > 0:  # Horovod's NEGOTIATE: the ranks meet, then exchange
                    tl.add("wait for the slowest rank", t2, t2 + sync, step=step)
                tl.add("exchange", t2 + sync, t4, step=step)
                for b, start, end in rule.bucket_spans:  # overlap's thread
                    tl.add("bucket exchange", start, end, thread="exchange", step=step, bucket=b)
                if check_every and step % check_every == 0:
                    with self._waiting("the replica check"):
                        assert_identical(model.params, self.comm, step)
                if (k + 1) % print_freq == 0 or last:
                    with self._waiting("the progress line"):
                        entry = self.progress.window(
                            s.since(win_start),
                            epoch=epoch,
                            n_epochs=self.settings.n_epochs,
                            step_in_epoch=k + 1,
                            steps_per_epoch=n,
                            step=step,
                            lr=lr,
                        )
                    self._emit("step", **entry)
                    win_start = len(s)
                # a checkpoint only ever at an optimiser-step boundary (after its K sub-batches)
                if self.mid_ok and (save_mid or interrupted):  # Ctrl-C: that step's checkpoint
                    self._save_mid(epoch, k + 1, step)
                if interrupted:
                    break
        return step, interrupted

    def _agree(self, stop: StopFlag, bad: int | None, epoch: int, step: int) -> tuple[bool, bool]:
        """Collective: (stop?, minute checkpoint due?); raises ``DivergedError`` on every rank
        when any rank saw a nan/inf loss. One small allreduce, as the old stop agreement."""
        big = np.iinfo(np.int64).max
        t_due = self.mid_ok and self.settings.checkpoint_every_minutes > 0
        mine = np.array(
            [
                -int(stop.requested),
                big if bad is None else bad * self.size + self.rank,
                -int(t_due and self.rank == 0 and wtime() >= self._next_ckpt_t),
            ],
            dtype=np.int64,
        )
        if self.size > 1:
            from mpi4py import MPI

            out = np.empty_like(mine)
            self.comm.Allreduce(mine, out, op=MPI.MIN)
            mine = out
        if mine[1] != big:
            bad_step, bad_rank = divmod(int(mine[1]), self.size)
            bad_rank = self.peers[bad_rank]  # named in the job (EASGD: its server is rank 0)
            raise DivergedError(
                f"the loss became nan/inf at step {bad_step} (epoch {epoch + 1}) on rank "
                f"{bad_rank}; training stopped; last good checkpoint: "
                f"{self.last_ckpt or 'none'} (lower the learning rate, then --resume from it "
                "or start again)"
            )
        return bool(mine[0]), bool(mine[2])

    def _check_params(self, epoch: int, step: int) -> None:
        """Collective, before a checkpoint: ``DivergedError`` on every rank when any rank's
        parameters hold a nan/inf (a finite loss can still leave inf weights behind)."""
        bad = next(
            (
                i
                for i, p in enumerate(self.model.params)
                if not np.isfinite(p.get_value(borrow=True)).all()
            ),
            -1,
        )
        key = np.array(
            [self.size * len(self.model.params) if bad < 0 else bad * self.size + self.rank]
        )
        key = key.astype(np.int64)
        if self.size > 1:
            from mpi4py import MPI

            out = np.empty_like(key)
            self.comm.Allreduce(key, out, op=MPI.MIN)
            key = out
        if key[0] < self.size * len(self.model.params):
            i, r = divmod(int(key[0]), self.size)
            r = self.peers[r]
            name = getattr(self.model.params[i], "name", None) or f"#{i}"
            raise DivergedError(
                f"parameter {name!r} became nan/inf by step {step} (epoch {epoch + 1}) on rank "
                f"{r}; training stopped before checkpointing it; last good checkpoint: "
                f"{self.last_ckpt or 'none'} (lower the learning rate, then --resume from it "
                "or start again)"
            )

    def _save_mid(self, epoch: int, k: int, step: int) -> None:
        """Collective: a mid-epoch checkpoint after ``k`` steps of ``epoch``: the rule's values
        (EASGD's centre, GOSGD's weighted mean) with each rank's own state beside them."""
        t0 = wtime()
        model, rule = self.model, self.rule
        with self._waiting("a mid-epoch checkpoint"):
            self._check_params(epoch, step)
            self.average_buffers()
            settle = getattr(rule, "checkpoint_state", None)  # a SyncRule's: nothing in flight
            state = settle(model) if settle is not None else None
            values = rule.eval_values(model)
            own = None if values is None else [np.array(a) for a in get_values(model.params)]
            if values is not None:
                set_values(model.params, values)
            try:
                saved = self.snap.save(epoch, step, {"mid_epoch": True}, k, rank_state=state)
            finally:
                if own is not None:
                    set_values(model.params, own)
            self.last_ckpt = str(saved)
        self._next_ckpt_t = wtime() + 60 * self.settings.checkpoint_every_minutes
        self.timeline.add("checkpoint", t0, wtime(), step=step)

    def average_buffers(self) -> None:
        """Collective over the workers: replace every rank's ``model.buffers`` (batch-norm
        running statistics, updated by each rank's own batches) by their mean over the
        workers, summed in float64 in one ``Allreduce``. Called at each epoch end (before
        validation and the checkpoint) and before a mid-epoch checkpoint, so validation and
        checkpoints see one set of statistics under every rule (EASGD: the workers' mean
        beside the centre's parameters; GOSGD: the mean of all ranks)."""
        bufs = list(getattr(self.model, "buffers", []) or [])
        if not bufs or self.size == 1:
            return
        from mpi4py import MPI

        flat = ParamBuffer(bufs)
        mine = flat.gather().astype(np.float64)
        total = np.empty_like(mine)
        self.comm.Allreduce(mine, total, op=MPI.SUM)
        flat.scatter(total / self.size)

    def _sum_over_ranks(self, n: int) -> int:
        """Collective: a buffer ``Allreduce`` (a first pickled ``allreduce`` on a
        communicator holds the GIL while it waits, which would starve the watchdog)."""
        if self.size == 1:
            return n
        from mpi4py import MPI

        out = np.zeros(1, np.int64)
        self.comm.Allreduce(np.array([n], np.int64), out, op=MPI.SUM)
        return int(out[0])

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
        with self._waiting("the epoch-end merge"):
            tr_loss, tr_err = self.progress.reduce_mean([ep.mean("loss"), ep.mean("err")])
        with self._waiting("the rule's epoch end", collective=rule.synchronous):
            rule.epoch_end(model)
            values = rule.eval_values(model)
        with self._waiting("the buffer average"):
            self.average_buffers()
        own = None
        if values is not None:  # validate and save the rule's values, then train on our own
            own = [np.array(a, copy=True) for a in get_values(model.params)]
            set_values(model.params, values)
        t1 = wtime()
        with self._waiting("validation"):
            v = validate(model, self.val, self.comm)
        t2 = wtime()
        tl.add("validate", t1, t2, epoch=epoch)
        saved = None
        if self.snap.due(epoch + 1, n_epochs):
            with self._waiting("the epoch checkpoint"):
                self._check_params(epoch, step)
                saved = str(self.snap.save(epoch + 1, step, {"val": v}))
            tl.add("checkpoint", t2, wtime(), epoch=epoch)
        if own is not None:
            set_values(model.params, own)
        ep_secs = wtime() - self._ep_t0
        ips = self._ips(ep)
        lr = float(model.lr.get_value())
        self._emit(
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


def _abort_job(rule: Any, rank: int, err: Exception) -> None:
    """One rank met an error the others cannot know of: one line, then end the whole job
    with the error's exit code (a plain exit would leave the others in a collective)."""
    world = getattr(rule, "world", None)
    print(f"tmpi: error on rank {rank}: {err}", file=sys.stderr, flush=True)
    if world is not None and world.Get_size() > 1:
        world.Abort(getattr(err, "exit_code", 1))
