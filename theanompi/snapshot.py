"""Checkpoints of a training run: save and restore, with per-rank side files for rank-local state."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from theanompi.checkpoint import (
    Checkpoint,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    rank_state_path,
    save_arrays,
    save_checkpoint,
)
from theanompi.errors import ConfigError
from theanompi.params import bcast_values, get_values, set_values
from theanompi.rng import get_rng_states, set_rng_states

__all__ = ["Snapshotter"]


class Snapshotter:
    """Save and restore a training run's checkpoints, with per-rank side files.

    ``local_opt``: the optimizer state differs between ranks (BSP ``avg`` with
    N > 1), so ranks > 0 store theirs in ``epoch_NNNN.rank<r>.npz`` (written
    before the main file, which is the commit point). RNG states are always
    rank-local. Without side files a resume uses rank 0's state everywhere.
    """

    def __init__(
        self,
        directory: str | Path,
        freq: int,
        comm: Any,
        model: Any,
        *,
        local_opt: bool,
        meta: dict[str, Any] | None = None,
    ) -> None:
        self.dir = Path(directory)
        self.freq = int(freq)
        self.comm, self.model = comm, model
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.local_opt = local_opt and self.size > 1
        self.meta = dict(meta or {})  # written into every checkpoint (config, rule ...)

    def due(self, epoch_done: int, n_epochs: int) -> bool:
        """Checkpoint after ``epoch_done`` finished epochs? (every ``snapshot_freq``, and the last)."""
        if self.freq <= 0:
            return False
        return epoch_done % self.freq == 0 or epoch_done == n_epochs

    def save(self, epoch_done: int, step: int, extra: dict[str, Any] | None = None) -> Path:
        """Collective: write ``epoch_{epoch_done:04d}.npz`` (+ side files); returns its path."""
        path = checkpoint_path(self.dir, epoch_done)
        rngs = get_rng_states(self.model)
        if self.size > 1 and self.rank > 0:
            opt = (
                [np.asarray(a) for a in get_values(self.model.opt_state)] if self.local_opt else []
            )
            save_arrays(
                rank_state_path(path, self.rank),
                [],
                opt,
                {
                    "rank": self.rank,
                    "world_size": self.size,
                    "epoch": epoch_done,
                    "step": step,
                    "rng": rngs,
                    "local_opt": self.local_opt,
                },
            )
        if self.size > 1:
            self.comm.Barrier()
        if self.rank == 0:
            meta = {
                "epoch": epoch_done,
                "step": step,
                "world_size": self.size,
                "rng": rngs,
                "local_opt": self.local_opt,
                **self.meta,
                **(extra or {}),
            }
            save_checkpoint(path, self.model, meta)
        if self.size > 1:
            self.comm.Barrier()
        return path

    def restore(self, path: Path | None = None) -> Checkpoint:
        """Collective: load ``path`` (default: the latest) into the model on every rank.

        Rank 0 reads the file and broadcasts params and optimizer state; each rank
        then applies its side file when one exists for this world size. Raises a
        ``ConfigError`` (on every rank) when there is nothing to resume from.
        """
        from theanompi.checkpoint import apply_checkpoint

        msg: str | None = None
        ck: Checkpoint | None = None
        if self.rank == 0:
            path = Path(path) if path is not None else latest_checkpoint(self.dir)
            if path is None:
                msg = (
                    f"--resume: no checkpoint in {str(self.dir)!r}; train without --resume "
                    "first (or pass --run-dir of the run to continue)"
                )
            else:
                try:
                    ck = load_checkpoint(path)
                    apply_checkpoint(self.model, ck)
                    set_rng_states(self.model, ck.meta.get("rng", []))
                except ConfigError as err:
                    msg = str(err)
        if self.size > 1:
            msg = self.comm.bcast(msg, root=0)
        if msg:
            raise ConfigError(msg)
        if self.size > 1:
            meta = self.comm.bcast(ck.meta if ck else None, root=0)
            path = Path(self.comm.bcast(str(ck.path) if ck else None, root=0))
            bcast_values(self.model.params, self.comm)
            bcast_values(self.model.opt_state, self.comm)
            if ck is None:
                ck = Checkpoint(path=path, params=[], opt_state=[], meta=meta)
        assert ck is not None
        found = 1
        if self.size > 1 and self.rank > 0:
            side = rank_state_path(ck.path, self.rank)
            found = 0
            if side.exists():
                sc = load_checkpoint(side)
                if int(sc.meta.get("world_size", -1)) == self.size:
                    if sc.meta.get("local_opt") and sc.opt_state:
                        set_values(
                            self.model.opt_state,
                            [
                                np.array(a, dtype=v.get_value(borrow=True).dtype)
                                for a, v in zip(sc.opt_state, self.model.opt_state, strict=True)
                            ],
                        )
                    set_rng_states(self.model, sc.meta.get("rng", []))
                    found = 1
        if self.size > 1:
            from mpi4py import MPI

            found = self.comm.allreduce(found, op=MPI.MIN)
        if not found and self.rank == 0:
            print(
                f"note: {ck.path.name} has no side files for {self.size} ranks; rank-local "
                "state (momentum, dropout RNG) comes from rank 0, so the resume is not bit-exact",
                file=sys.stderr,
                flush=True,
            )
        return ck
