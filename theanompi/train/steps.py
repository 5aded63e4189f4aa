"""One optimiser step of the loop, timed: its sub-batches' compute and data wait, then the time split of the whole step."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from theanompi.data._fault import fault_point
from theanompi.train.progress import StepStats
from theanompi.train.workers import wtime

__all__ = ["LocalStep", "StepTimes", "add_step"]


class LocalStep:
    """The local compute of an optimiser step: its ``k`` sub-batches, each fetched (timed as
    *wait*) and given to the rule (``rule.accumulate``), each a ``wait`` and a ``compute``
    span on the timeline.

    Parameters
    ----------
    model, rule
        The model and its sync rule.
    timeline
        :class:`~theanompi.io.timeline.Timeline`.
    k
        Sub-batches per optimiser step (``training.accumulate_steps``).
    rank
        This worker's rank (fault injection in tests names it).
    """

    def __init__(self, model: Any, rule: Any, timeline: Any, k: int, rank: int) -> None:
        self.model, self.rule, self.timeline = model, rule, timeline
        self.k, self.rank = k, rank

    def compute(self, batches: Iterator[Any], step: int) -> tuple[float, float, float]:
        """Optimiser step ``step + 1``: the mean loss and error over its sub-batches and the
        seconds waited for data."""
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


@dataclass(frozen=True)
class StepTimes:
    """The clock of one step: its start, the exchange's start and end, the step's end (after
    the agreement), the seconds waited for data and the seconds ``after_step`` exchanged."""

    start: float
    exchange_start: float
    exchange_end: float
    end: float
    waited: float
    exchanged: float


def add_step(
    stats: StepStats, timeline: Any, rule: Any, step: int, loss: float, err: float, t: StepTimes
) -> None:
    """Step ``step``'s time split into ``stats`` (compute: the rest of the step; exchange:
    what it waited for, the agreement included; ``hidden`` and ``sync`` as the rule measured
    them) and its exchange spans on the timeline."""
    hidden, sync = rule.hidden_s, rule.sync_s  # under compute; for the slowest rank
    stats.add(
        loss,
        err,
        (t.exchange_end - t.start) - t.waited - t.exchanged,
        t.exchanged - sync + (t.end - t.exchange_end),
        t.waited,
        t.end - t.start,
        hidden,
        sync,
    )
    if sync > 0:  # Horovod's NEGOTIATE: the ranks meet, then exchange
        timeline.add(
            "wait for the slowest rank", t.exchange_start, t.exchange_start + sync, step=step
        )
    timeline.add("exchange", t.exchange_start + sync, t.end, step=step)
    for b, start, end in rule.bucket_spans:  # overlap's thread
        timeline.add("bucket exchange", start, end, thread="exchange", step=step, bucket=b)
