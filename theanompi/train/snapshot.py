"""Checkpoints of a training run: save and restore, with per-rank side files for rank-local state."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from theanompi.errors import ConfigError, ResourceError, resource_error
from theanompi.io.checkpoint import (
    Checkpoint,
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    rank_state_path,
    save_arrays,
    save_checkpoint,
)
from theanompi.models.params import bcast_values, get_values, set_values
from theanompi.train.rng import get_rng_states, set_rng_states

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
        keep_last: int = 0,
    ) -> None:
        self.dir = Path(directory)
        self.freq = int(freq)
        self.keep_last = int(keep_last)  # 0: keep every checkpoint
        self.comm, self.model = comm, model
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.local_opt = local_opt and self.size > 1
        self.meta = dict(meta or {})  # written into every checkpoint (config, rule ...)
        #: after :meth:`restore`: this rank's rule state from its side file (arrays, meta)
        self.rank_state: tuple[list[np.ndarray], Any] | None = None

    def due(self, epoch_done: int, n_epochs: int) -> bool:
        """Checkpoint after ``epoch_done`` finished epochs? Every ``snapshot_freq`` epochs and
        after the last; ``snapshot_freq: 0``: only after the last."""
        if epoch_done == n_epochs:
            return True
        return self.freq > 0 and epoch_done % self.freq == 0

    def save(
        self,
        epoch_done: int,
        step: int,
        extra: dict[str, Any] | None = None,
        step_in_epoch: int = 0,
        rank_state: tuple[list[np.ndarray], dict[str, Any]] | None = None,
    ) -> Path:
        """Collective: write ``epoch_{epoch_done:04d}.npz`` (``..._step_{k:05d}.npz`` for a
        mid-epoch checkpoint after ``step_in_epoch`` steps of the next epoch), with the side
        files, then drop all but the last ``keep_last``; returns its path.

        ``rank_state``: this rank's own state from the rule's ``checkpoint_state`` (EASGD's
        and GOSGD's workers: own parameters, momentum, gossip weight); it goes in this
        rank's side file, rank 0's included, and :meth:`restore` hands it back.

        A full disk or a refused write on any rank raises the same one-line
        :class:`~theanompi.errors.ResourceError` on every rank, and leaves neither the
        main file nor a side file of this checkpoint behind.
        """
        path = checkpoint_path(self.dir, epoch_done, step_in_epoch)
        rngs = get_rng_states(self.model)
        ranked = self.size > 1 and self.rank > 0
        side = rank_state_path(path, self.rank) if ranked or rank_state is not None else None
        err: str | None = None
        if side is not None:
            opt = (
                [np.asarray(a) for a in get_values(self.model.opt_state)]
                if self.local_opt and ranked
                else []
            )
            own, own_meta = rank_state if rank_state is not None else ([], None)
            info = {
                "rank": self.rank,
                "world_size": self.size,
                "epoch": epoch_done,
                "step": step,
                "step_in_epoch": step_in_epoch,
                "rng": rngs,
                "local_opt": self.local_opt and ranked,
                "rule_state": own_meta,
            }
            err = _write(
                lambda: save_arrays(side, own, opt, info),
                f"rank {self.rank} checkpoint state",
                side,
            )
        err = self._first_error(err)
        if err is None and self.rank == 0:
            meta = {
                "epoch": epoch_done,
                "step": step,
                "step_in_epoch": step_in_epoch,
                "world_size": self.size,
                "rng": rngs,
                "local_opt": self.local_opt,
                **self.meta,
                **(extra or {}),
            }
            err = _write(lambda: save_checkpoint(path, self.model, meta), "checkpoint", path)
        err = self._first_error(err)
        if err is not None:
            if side is not None:
                with contextlib.suppress(OSError):
                    side.unlink()
            failed = ResourceError(err)
            failed.agreed = True  # the same on every rank
            raise failed
        if self.rank == 0:
            self._prune()
        if self.size > 1:
            self.comm.Barrier()
        return path

    def _first_error(self, err: str | None) -> str | None:
        """Collective: the lowest rank's error (or ``None``), the same on every rank."""
        if self.size == 1:
            return err
        from mpi4py import MPI

        # a buffer allreduce first: mpi4py's pickled collectives can hold the GIL while they
        # wait, which would starve the stall watchdog's thread; the text only on a failure
        flag = np.array([int(err is not None)], dtype=np.int32)
        out = np.empty_like(flag)
        self.comm.Allreduce(flag, out, op=MPI.MAX)
        if not out[0]:
            return None
        return next((e for e in self.comm.allgather(err) if e is not None), None)

    def _prune(self) -> None:
        """Rank 0: keep the last ``keep_last`` checkpoints; drop side files without a main file."""
        found = list_checkpoints(self.dir)
        drop = found[: -self.keep_last] if self.keep_last > 0 else []
        for p in drop:  # the main file first: a side file alone is never picked (and swept below)
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        mains = {p.stem for p in found} - {p.stem for p in drop}
        for p in self.dir.glob("epoch_*.rank*.npz"):
            if p.name.split(".rank")[0] not in mains:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()

    def restore(self, path: Path | None = None) -> Checkpoint:
        """Collective: load ``path`` (default: the latest) into the model on every rank; the
        temporary files of checkpoint writes that a killed run left are removed first.

        Rank 0 reads the file and broadcasts params and optimizer state; each rank
        then applies its side file when one exists for this world size. Raises a
        ``ConfigError`` (on every rank) when there is nothing to resume from.
        """
        from theanompi.io.checkpoint import apply_checkpoint

        msg: str | None = None
        ck: Checkpoint | None = None
        if self.rank == 0:
            for stale in self.dir.glob(".*.tmp.npz"):  # a write the killed run never finished
                with contextlib.suppress(OSError):
                    stale.unlink()
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
        found = self._restore_side(ck.path)
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

    def _restore_side(self, path: Path) -> int:
        """This rank's side file of ``path`` applied (momentum, RNG) and its rule state kept in
        :attr:`rank_state`; returns 0 where a rank > 0 found none for this world size."""
        self.rank_state = None
        side = rank_state_path(path, self.rank)
        found = int(self.size == 1 or self.rank == 0)
        if side.exists():
            sc = load_checkpoint(side)
            if int(sc.meta.get("world_size", -1)) == self.size:
                if sc.meta.get("rule_state") is not None:
                    self.rank_state = (sc.params, sc.meta["rule_state"])
                if self.rank > 0:
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
        return found


def _write(save: Callable[[], Any], what: str, path: Path) -> str | None:
    """Run ``save``; a full disk or refused write becomes its one-line message (else ``None``)."""
    try:
        save()
    except OSError as err:
        res = resource_error(err, what, path, "output.checkpoint_dir")
        if res is None:
            raise
        return str(res)
    return None
