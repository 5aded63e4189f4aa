"""Per-step numbers of a rank (loss, error, compute / exchange / wait seconds) and rank 0's progress lines."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

__all__ = ["StepStats", "Progress", "TIMES", "fmt_ms"]


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


#: StepStats' fields in seconds per step
TIMES = ("compute", "exchange", "wait", "wall", "hidden", "sync")


@dataclass
class StepStats:
    """Per-step numbers of one rank: loss, error, and seconds in compute / exchange / data wait
    (``exchange``: what the step waited for; ``hidden``: exchange seconds under compute;
    ``sync``: seconds waited for the slowest rank before the exchange, not in ``exchange``)."""

    loss: list[float] = field(default_factory=list)
    err: list[float] = field(default_factory=list)
    compute: list[float] = field(default_factory=list)
    exchange: list[float] = field(default_factory=list)
    wait: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)
    hidden: list[float] = field(default_factory=list)
    sync: list[float] = field(default_factory=list)

    def add(
        self,
        loss: float,
        err: float,
        compute: float,
        exchange: float,
        wait: float,
        wall: float,
        hidden: float = 0.0,
        sync: float = 0.0,
    ) -> None:
        self.loss.append(float(loss))
        self.err.append(float(err))
        self.compute.append(compute)
        self.exchange.append(exchange)
        self.wait.append(wait)
        self.wall.append(wall)
        self.hidden.append(hidden)
        self.sync.append(sync)

    def __len__(self) -> int:
        return len(self.loss)

    def since(self, start: int) -> StepStats:
        """The steps from index ``start`` on."""
        return StepStats(**{f.name: getattr(self, f.name)[start:] for f in fields(self)})

    def mean(self, key: str) -> float:
        v = getattr(self, key)
        return float(np.mean(v)) if v else float("nan")

    def median(self, key: str) -> float:
        v = getattr(self, key)
        return float(statistics.median(v)) if v else float("nan")

    def split(self) -> dict[str, float]:
        """Mean seconds per step in compute / exchange / wait, the mean step wall time, the
        exchange seconds hidden under compute and the seconds waited for the slowest rank."""
        return {f"t_{k}": self.mean(k) for k in TIMES}


def _hidden(seconds: float) -> str:
    return f" (+{fmt_ms(seconds)} hidden)" if seconds > 0 else ""


def _sync(seconds: float) -> str:
    return f" (after {fmt_ms(seconds)} for the slowest rank)" if seconds > 0 else ""


class Progress:
    """Rank 0's progress lines and record entries for a window of steps.

    ``window(stats, ...)`` averages loss/error over all ranks of ``comm`` (one
    small allreduce, so every rank must call it at the same steps), prints one
    line on rank 0 and returns the entry it would record.
    """

    def __init__(self, comm: Any, images_per_step: int, tag: str = "bsp") -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.images_per_step = images_per_step
        self.tag = tag

    def reduce_mean(self, values: Sequence[float]) -> list[float]:
        """Mean over ranks of each value (all ranks call it)."""
        arr = np.asarray(values, dtype=np.float64)
        if self.comm.Get_size() > 1:
            out = np.empty_like(arr)
            from mpi4py import MPI

            self.comm.Allreduce(arr, out, op=MPI.SUM)
            arr = out / self.comm.Get_size()
        return [float(v) for v in arr]

    def images_per_s(self, stats: StepStats) -> float | None:
        """This rank's view of the images per second over the steps of ``stats`` (every
        worker's images over this rank's wall time); None without steps."""
        wall = float(np.sum(stats.wall))
        return self.images_per_step * len(stats) / wall if len(stats) and wall > 0 else None

    def window(
        self,
        stats: StepStats,
        *,
        epoch: int,
        n_epochs: int,
        step_in_epoch: int,
        steps_per_epoch: int,
        step: int,
        lr: float,
    ) -> dict[str, Any]:
        loss, err = self.reduce_mean([stats.mean("loss"), stats.mean("err")])
        wall = float(np.sum(stats.wall)) or 1e-12
        ips = self.images_per_step * len(stats) / wall
        split = stats.split()
        entry = {
            "epoch": epoch,
            "step": step,
            "step_in_epoch": step_in_epoch,
            "loss": loss,
            "error": err,
            "images_per_s": ips,
            "lr": lr,
            "n_steps": len(stats),
            **split,
        }
        self.log(
            f"[{self.tag}] epoch {epoch + 1}/{n_epochs} step {step_in_epoch}/{steps_per_epoch} | "
            f"loss {loss:.4f} err {err * 100:.2f}% | {ips:,.0f} img/s | compute "
            f"{fmt_ms(split['t_compute'])}, exchange {fmt_ms(split['t_exchange'])}"
            f"{_hidden(split['t_hidden'])}{_sync(split['t_sync'])}, wait "
            f"{fmt_ms(split['t_wait'])} per step | lr {lr:.4g}"
        )
        return entry

    def log(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)
