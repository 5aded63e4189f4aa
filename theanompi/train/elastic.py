"""Elastic BSP: a lost rank leaves the job, and the ranks left shrink their world and train on
from the last state they all committed in memory.

Under ``mpirun --with-ft ulfm`` (the launcher adds it when ``elastic.min_np`` is set) a
collective that meets a lost rank raises ``MPI_ERR_PROC_FAILED`` on the ranks that notice;
each of them revokes every communicator of the job (:func:`~theanompi.comm.revoke_made`), so
that the others, wherever they wait, get ``MPI_ERR_REVOKED``. Then every rank left:

1. shrinks the job's communicator (``Comm.Shrink``, ULFM) and makes it the world;
2. agrees with the others on the newest :class:`Commit` they all hold (a rank may be one
   ahead: its exchange finished before the loss was noticed) and puts it back in the model;
3. rebuilds the rule, the loaders and the watchdog on the new world (the compiled model is
   kept) and trains on: the epoch's sub-batches not yet trained are dealt over the ranks left.

No process starts and no file is read: the work lost is at most ``elastic.commit_every_steps``
steps. Below ``elastic.min_np`` ranks the job stops (exit 1; 75 under Slurm, requeued) with
the last checkpoint on disk.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from theanompi.comm import revoke_made, set_world
from theanompi.errors import UserError
from theanompi.launch.banners import BELOW_MIN_NP
from theanompi.models.params import get_values, set_values

__all__ = ["Point", "Commit", "Resume", "BelowMinimum", "shrink", "train_elastic"]


@dataclass(frozen=True)
class Point:
    """Where the loop stands at a commit: ``dealt`` sub-batches of ``epoch`` trained (by all
    ranks together), ``step`` optimiser steps in all, ``checkpoint`` the last one written."""

    epoch: int
    step: int
    dealt: int
    checkpoint: str | None = None


@dataclass(frozen=True)
class Resume:
    """What the loop goes on from after a shrink: the agreed :class:`Point` and the change
    (which ranks left, the new world size, the seconds it took) for the record."""

    point: Point
    change: dict[str, Any] = field(default_factory=dict)


class Commit:
    """The state a shrink falls back to: a copy of the parameters, optimiser state and buffers
    every ``every`` steps (and at each epoch's start), in memory.

    The last two are kept: commits happen at the same points of the loop on every rank, and
    one rank can be at most one ahead (its exchange of the step finished before the loss was
    noticed; the next collective needs the others). :meth:`restore` takes the newest that
    every rank left holds.
    """

    def __init__(self, model: Any, every: int = 1) -> None:
        self.vars = [*model.params, *model.opt_state, *(getattr(model, "buffers", None) or [])]
        self.every = max(1, int(every))
        self.seq = 0  # commits so far: the same count on every rank at the same point
        self._slots: list[tuple[int, Point, list[np.ndarray]]] = []  # oldest first, at most 2

    def keep(self, point: Point, *, always: bool = False) -> None:
        """Copy the values now, as ``point`` (every ``every`` steps, or ``always``)."""
        if not always and point.step % self.every:
            return
        values = get_values(self.vars)
        if len(self._slots) == 2:
            _, _, copies = self._slots.pop(0)  # the oldest's arrays take the new values
            for dst, src in zip(copies, values, strict=True):
                np.copyto(dst, src)
        else:
            copies = [np.array(a, copy=True) for a in values]
        self.seq += 1
        self._slots.append((self.seq, point, copies))

    def restore(self, comm: Any) -> Point:
        """Collective over the ranks left: put the newest commit all of them hold back in the
        model (a copy: the slots stay the commit's); returns its point."""
        from mpi4py import MPI

        if not self._slots:
            raise RuntimeError("elastic: no commit to go back to (the loop never started)")
        agreed = comm.allreduce(self._slots[-1][0], op=MPI.MIN)
        for seq, point, copies in self._slots:
            if seq == agreed:
                set_values(self.vars, [np.array(a, copy=True) for a in copies])
                self._slots = [s for s in self._slots if s[0] <= agreed]
                self.seq = agreed
                return point
        raise RuntimeError(f"elastic: commit {agreed} is no longer held here")


class BelowMinimum(UserError):
    """Fewer ranks are left than ``elastic.min_np``: the job stops."""

    exit_code = 1


def shrink(comm: Any) -> tuple[Any, list[int]]:
    """Collective over the ranks left of ``comm``: revoke the job's communicators, shrink
    ``comm`` to the ranks left and make it the world (:func:`~theanompi.comm.set_world`);
    returns it and the ranks of ``comm`` that were lost."""
    from mpi4py import MPI

    revoke_made()
    try:
        comm.Revoke()
    except Exception:  # noqa: BLE001 - revoked by a peer already
        pass
    new = comm.Shrink()
    kept = MPI.Group.Translate_ranks(new.Get_group(), list(range(new.Get_size())), comm.Get_group())
    lost = sorted(set(range(comm.Get_size())) - {int(r) for r in kept})
    set_world(new)
    return new, lost


def train_elastic(
    comm: Any,
    parts: Any,
    *,
    min_np: int,
    commit: Commit,
    fit: Callable[[Any, Any, Resume | None], dict[str, Any]],
    rebuild: Callable[[Any], tuple[Any, str]],
    log: Callable[[str], None],  # called on rank 0
    stop_code: Callable[[], int],
) -> tuple[dict[str, Any], Any]:
    """``fit(comm, parts, resume)`` on ``comm``; after each lost rank, the shrink, the commit
    put back and ``rebuild(new comm)`` (the parts for the ranks left, and a note on what
    changed in them), then ``fit`` again from there. Returns the summary and the world it
    ended on.

    Below ``min_np`` ranks it raises :class:`BelowMinimum` with ``stop_code()`` (1, or 75
    under Slurm) after rank 0 of the ranks left has said where the last checkpoint is.
    """
    from mpi4py import MPI

    hosts = comm.allgather(MPI.Get_processor_name())
    resume: Resume | None = None
    while True:
        try:
            return fit(comm, parts, resume), comm
        except MPI.Exception as err:  # any class: a collective under way may say ERR_OTHER
            t0 = time.monotonic()
            before = comm.Get_size()
            comm, lost = shrink(comm)
            if not lost or not commit.seq:  # an MPI error of its own (the others: REVOKED),
                raise err  # or a loss before the loop began: nothing to go back to
        point = commit.restore(comm)
        gone = sorted({hosts[r] for r in lost})
        hosts = [h for r, h in enumerate(hosts) if r not in lost]
        size = comm.Get_size()
        who = f"rank{'s' if len(lost) > 1 else ''} {','.join(map(str, lost))} ({', '.join(gone)})"
        if size < min_np:
            err = BelowMinimum(
                f"elastic: lost {who}; {size} {BELOW_MIN_NP}{min_np}; last "
                f"checkpoint: {point.checkpoint or 'none'} (continue with --resume)"
            )
            err.exit_code = stop_code()
            if comm.Get_rank() == 0:  # one line, from rank 0 of the ranks left
                raise err
            raise SystemExit(err.exit_code)
        parts, note = rebuild(comm)
        seconds = time.monotonic() - t0
        change = dict(
            lost_ranks=lost,
            lost_hosts=gone,
            world_size=size,
            world_size_before=before,
            step=point.step,
            epoch=point.epoch,
            seconds=round(seconds, 4),
        )
        if comm.Get_rank() == 0:
            log(
                f"elastic: lost {who}; {size} of {before} ranks go on from step {point.step} "
                f"(epoch {point.epoch + 1}, {point.dealt} sub-batches of it trained), "
                f"{seconds:.3f} s{note}"
            )
        resume = Resume(point, change)
