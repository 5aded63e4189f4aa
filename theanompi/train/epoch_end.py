"""An epoch's close: the rule's epoch end, one set of buffers, validation and the epoch checkpoint of the rule's values, then its record entry and line."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from theanompi.data._fault import fault_point
from theanompi.io.record import json_safe
from theanompi.io.recorder import Recorder
from theanompi.models.metrics import validate
from theanompi.models.params import holding
from theanompi.train.checkpoints import Checkpoints
from theanompi.train.progress import Progress, StepStats
from theanompi.train.workers import Workers, wtime

__all__ = ["EpochEnd"]


class EpochEnd:
    """Close a finished epoch on every worker (collective); see :meth:`conclude`.

    Parameters
    ----------
    model, rule, val
        The model, its sync rule and this rank's :class:`~theanompi.data.ValLoader`.
    workers, progress, ckpts, recorder
        The loop's :class:`~theanompi.train.workers.Workers`,
        :class:`~theanompi.train.progress.Progress`,
        :class:`~theanompi.train.checkpoints.Checkpoints` and
        :class:`~theanompi.io.recorder.Recorder`.
    timeline
        :class:`~theanompi.io.timeline.Timeline`: validation is a ``validate`` span.
    n_epochs
        The run's epochs (the line says ``epoch 3/n_epochs``).
    log
        Rank 0's tagged line printer.
    """

    def __init__(
        self,
        model: Any,
        rule: Any,
        val: Any,
        *,
        workers: Workers,
        progress: Progress,
        ckpts: Checkpoints,
        recorder: Recorder,
        timeline: Any,
        n_epochs: int,
        log: Callable[[str], None],
    ) -> None:
        self.model, self.rule, self.val = model, rule, val
        self.workers, self.progress, self.ckpts = workers, progress, ckpts
        self.recorder, self.timeline = recorder, timeline
        self.n_epochs, self.log = n_epochs, log

    def conclude(self, epoch: int, step: int, ep: StepStats, t_start: float) -> dict[str, Any]:
        """Validate (and checkpoint) the rule's values of finished ``epoch`` (its steps'
        numbers ``ep``, begun at ``wtime()`` ``t_start``); record and log it. Returns the
        validation's numbers (``val_top1_err``, ``val_top5_err``, ``val_loss``, ``val_n``).

        The checkpoint carries the epoch's record entry: a run killed after the save and
        before the record's line resumes after this epoch, and the resume writes the line
        back from the checkpoint (:meth:`~theanompi.io.recorder.Recorder.open`)."""
        model, rule, w = self.model, self.rule, self.workers
        with w.waiting("the epoch-end merge"):
            tr_loss, tr_err = self.progress.reduce_mean([ep.mean("loss"), ep.mean("err")])
        with w.waiting("the rule's epoch end", collective=rule.synchronous):
            rule.epoch_end(model)
            values = rule.eval_values(model)
        with w.waiting("the buffer average"):
            w.average_buffers(model)
        with holding(model.params, values):  # validate and save the rule's, train on our own
            t1 = wtime()
            with w.waiting("validation"):
                v = validate(model, self.val, w.comm)
            t2 = wtime()
            self.timeline.add("validate", t1, t2, epoch=epoch)
            entry = json_safe(
                dict(
                    epoch=epoch,
                    step=step,
                    train_loss=tr_loss,
                    train_error=tr_err,
                    lr=float(model.lr.get_value()),
                    images_per_s=self.progress.images_per_s(ep),
                    seconds=t2 - t_start,
                    **ep.split(),
                    **v,
                )
            )
            carried = entry | {"time": round(time.time(), 3)}  # the line a resume writes back
            saved = self.ckpts.save_epoch(epoch, step, v, t2, carried)
        if saved:
            fault_point("checkpointed", w.comm.Get_rank(), step)
        secs, ips = wtime() - t_start, entry["images_per_s"]
        self.recorder.add_epoch(**(entry | {"seconds": secs, "checkpoint": saved}))
        self.log(
            f"epoch {epoch + 1}/{self.n_epochs} done in {secs:.1f} s: train loss "
            f"{tr_loss:.4f} err {tr_err * 100:.2f}% | val loss {v['val_loss']:.4f} top-1 err "
            f"{v['val_top1_err'] * 100:.2f}% top-5 err {v['val_top5_err'] * 100:.2f}% "
            f"(n={v['val_n']}) | {ips or 0:,.0f} img/s" + (f" | saved {saved}" if saved else "")
        )
        return v
