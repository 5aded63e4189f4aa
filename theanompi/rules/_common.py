"""Helpers shared by the training rules (BSP, EASGD): values, broadcasts, checks, timing, progress,
validation, RNG state, Ctrl-C handling and snapshots.

Everything takes an explicit communicator (``comm``), so a rule can run these
on ``COMM_WORLD`` or on a sub-communicator (e.g. EASGD's workers only).
"""

from __future__ import annotations

import hashlib
import signal
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from theanompi.checkpoint import (
    Checkpoint,
    array_names,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    rank_state_path,
    save_arrays,
    save_checkpoint,
)
from theanompi.errors import ConfigError

__all__ = [
    "wtime",
    "get_values",
    "set_values",
    "bcast_values",
    "check_same_layout",
    "value_digests",
    "assert_identical",
    "rng_vars",
    "get_rng_states",
    "set_rng_states",
    "seed_rngs",
    "StepStats",
    "Progress",
    "evaluate_probs",
    "validate",
    "StopFlag",
    "build_model",
    "Snapshotter",
    "fmt_ms",
]


def wtime() -> float:
    """``MPI.Wtime()`` (seconds)."""
    from mpi4py import MPI

    return MPI.Wtime()


# -- values ------------------------------------------------------------------------------


def get_values(vars_: Sequence[Any]) -> list[np.ndarray]:
    """Current values of shared variables (``borrow=True``: no copy, do not keep them)."""
    return [v.get_value(borrow=True) for v in vars_]


def set_values(vars_: Sequence[Any], arrays: Sequence[np.ndarray]) -> None:
    """``v.set_value(a, borrow=True)`` for each pair."""
    for v, a in zip(vars_, arrays, strict=True):
        v.set_value(a, borrow=True)


def bcast_values(vars_: Sequence[Any], comm: Any, root: int = 0) -> None:
    """Overwrite every rank's shared variables with ``root``'s values (``comm.Bcast``)."""
    if comm.Get_size() == 1:
        return
    for v in vars_:
        a = np.array(v.get_value(borrow=True), copy=True, order="C")
        comm.Bcast(a, root=root)
        v.set_value(a, borrow=True)


def _layout(vars_: Sequence[Any]) -> list[tuple[str, tuple[int, ...], str]]:
    vals = [v.get_value(borrow=True) for v in vars_]
    return [
        (n, tuple(a.shape), str(a.dtype))
        for n, a in zip(array_names(list(vars_), "param"), vals, strict=True)
    ]


def check_same_layout(vars_: Sequence[Any], comm: Any, what: str = "param") -> None:
    """Every rank must hold the same names, shapes and dtypes in the same order.

    Compares a digest over ``comm`` (one ``allgather``); on a mismatch every rank
    raises the same one-line ``ConfigError`` naming the rank and the parameter.
    """
    mine = _layout(vars_)
    digest = hashlib.sha1(repr(mine).encode()).hexdigest()
    digests = comm.allgather(digest)
    if len(set(digests)) == 1:
        return
    bad = next(r for r, d in enumerate(digests) if d != digests[0])
    layouts = comm.allgather(mine if comm.Get_rank() in (0, bad) else None)
    ref, other = layouts[0], layouts[bad]
    for i in range(max(len(ref), len(other))):
        a = ref[i] if i < len(ref) else None
        b = other[i] if i < len(other) else None
        if a != b:
            raise ConfigError(
                f"rank {bad} holds {what} #{i} {_fmt_layout(b)} but rank 0 holds {_fmt_layout(a)}; "
                "every rank must build the same model config"
            )
    raise ConfigError(f"rank {bad} holds a different {what} list than rank 0")  # pragma: no cover


def _fmt_layout(entry: tuple[str, tuple[int, ...], str] | None) -> str:
    if entry is None:
        return "nothing"
    return f"{entry[0]!r} {entry[1]} {entry[2]}"


def value_digests(arrays: Sequence[np.ndarray]) -> list[str]:
    """A short BLAKE2 digest of each array's bytes."""
    return [
        hashlib.blake2b(memoryview(np.ascontiguousarray(a)).cast("B"), digest_size=8).hexdigest()
        for a in arrays
    ]


def assert_identical(vars_: Sequence[Any], comm: Any, step: int) -> None:
    """Debug check (``check_every``): raise ``RuntimeError`` on every rank if any rank's values
    differ from rank 0's, naming the first differing parameter."""
    if comm.Get_size() == 1:
        return
    mine = value_digests(get_values(vars_))
    everyone = comm.allgather(mine)
    names = array_names(list(vars_), "param")
    for r, theirs in enumerate(everyone[1:], 1):
        for i, (d0, d) in enumerate(zip(everyone[0], theirs, strict=True)):
            if d0 != d:
                raise RuntimeError(
                    f"ranks diverged after step {step}: rank {r} differs from rank 0 in {names[i]!r}"
                )


# -- RNG state of the model (dropout) ----------------------------------------------------


def rng_vars(model: Any) -> list[Any]:
    """Shared variables holding a ``numpy.random.Generator`` reachable from ``model``.

    Uses ``model.rng_vars`` when the model provides it, else walks its attributes
    (layers, lists, dicts) in definition order.
    """
    if hasattr(model, "rng_vars"):
        return list(model.rng_vars)
    found: dict[int, Any] = {}
    seen: set[int] = set()

    def walk(obj: Any, depth: int) -> None:
        if depth > 12 or id(obj) in seen:
            return
        seen.add(id(obj))
        if hasattr(obj, "get_value") and hasattr(obj, "set_value"):
            try:
                val = obj.get_value(borrow=True)
            except Exception:  # noqa: BLE001 - not a readable shared variable
                return
            if isinstance(val, np.random.Generator):
                found.setdefault(id(obj), obj)
            return
        if isinstance(obj, dict):
            for v in obj.values():
                walk(v, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, depth + 1)
        elif type(obj).__module__.startswith("theanompi.") and hasattr(obj, "__dict__"):
            for k, v in vars(obj).items():
                if not k.startswith("_fn"):
                    walk(v, depth + 1)

    walk(model, 0)
    return list(found.values())


def get_rng_states(model: Any) -> list[dict[str, Any]]:
    """JSON-able bit-generator states of :func:`rng_vars`."""
    return [v.get_value(borrow=True).bit_generator.state for v in rng_vars(model)]


def set_rng_states(model: Any, states: Sequence[dict[str, Any]]) -> None:
    """Restore states saved by :func:`get_rng_states` (count must match)."""
    vs = rng_vars(model)
    if len(vs) != len(states):
        raise ConfigError(
            f"checkpoint holds {len(states)} RNG state(s) but the model has {len(vs)}; "
            "use the model config the checkpoint was trained with"
        )
    for v, st in zip(vs, states, strict=True):
        g = np.random.default_rng()
        g.bit_generator.state = st
        v.set_value(g, borrow=True)


def seed_rngs(model: Any, seed: int, rank: int) -> None:
    """Give each model RNG (dropout) a stream determined by ``(seed, rank, index)``."""
    for i, v in enumerate(rng_vars(model)):
        v.set_value(np.random.default_rng([int(seed), int(rank), i]), borrow=True)


# -- timing, progress ----------------------------------------------------------------------


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


@dataclass
class StepStats:
    """Per-step numbers of one rank: loss, error, and seconds in compute / exchange / data wait."""

    loss: list[float] = field(default_factory=list)
    err: list[float] = field(default_factory=list)
    compute: list[float] = field(default_factory=list)
    exchange: list[float] = field(default_factory=list)
    wait: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)

    def add(
        self, loss: float, err: float, compute: float, exchange: float, wait: float, wall: float
    ) -> None:
        self.loss.append(float(loss))
        self.err.append(float(err))
        self.compute.append(compute)
        self.exchange.append(exchange)
        self.wait.append(wait)
        self.wall.append(wall)

    def __len__(self) -> int:
        return len(self.loss)

    def since(self, start: int) -> StepStats:
        """The steps from index ``start`` on."""
        return StepStats(
            *(
                getattr(self, k)[start:]
                for k in ("loss", "err", "compute", "exchange", "wait", "wall")
            )
        )

    def mean(self, key: str) -> float:
        v = getattr(self, key)
        return float(np.mean(v)) if v else float("nan")

    def median(self, key: str) -> float:
        v = getattr(self, key)
        return float(statistics.median(v)) if v else float("nan")

    def split(self) -> dict[str, float]:
        """Mean seconds per step in compute / exchange / wait, and the mean step wall time."""
        return {f"t_{k}": self.mean(k) for k in ("compute", "exchange", "wait", "wall")}


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
            f"{fmt_ms(split['t_compute'])}, exchange {fmt_ms(split['t_exchange'])}, wait "
            f"{fmt_ms(split['t_wait'])} per step | lr {lr:.4g}"
        )
        return entry

    def log(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)


# -- validation ----------------------------------------------------------------------------


def evaluate_probs(probs: np.ndarray, y: np.ndarray) -> tuple[float, int, int, int]:
    """Sums over the real labels (``y >= 0``) of a batch: (nll, top-1 errors, top-5 errors, count).

    Top-k error counts a label as missed when k or more classes score strictly higher.
    """
    keep = y >= 0
    if not keep.any():
        return 0.0, 0, 0, 0
    p, t = probs[keep].astype(np.float64), y[keep]
    true = p[np.arange(len(t)), t]
    higher = (p > true[:, None]).sum(axis=1)
    nll = float(-np.log(np.maximum(true, 1e-12)).sum())
    return nll, int((higher >= 1).sum()), int((higher >= 5).sum()), int(keep.sum())


def validate(model: Any, loader: Any, comm: Any | None) -> dict[str, float]:
    """Val loss, top-1 / top-5 error over the whole val split, summed over ``comm``'s ranks.

    ``loader`` is this rank's :class:`~theanompi.data.ValLoader`; padded slots
    (label -1) are ignored. ``comm=None`` validates locally (one process). Returns
    ``{"val_loss", "val_top1_err", "val_top5_err", "val_n", "val_seconds"}``.
    """
    t0 = wtime()
    sums = np.zeros(4, dtype=np.float64)
    with loader.batches() as it:
        for x, y in it:
            sums += evaluate_probs(model.predict(x), y)
    if comm is not None and comm.Get_size() > 1:
        from mpi4py import MPI

        out = np.empty_like(sums)
        comm.Allreduce(sums, out, op=MPI.SUM)
        sums = out
    n = max(sums[3], 1.0)
    return {
        "val_loss": sums[0] / n,
        "val_top1_err": sums[1] / n,
        "val_top5_err": sums[2] / n,
        "val_n": int(sums[3]),
        "val_seconds": wtime() - t0,
    }


# -- Ctrl-C ---------------------------------------------------------------------------------


class StopFlag:
    """Turns SIGINT/SIGTERM into a flag that every rank checks at the same step.

    A second Ctrl-C restores the default behaviour (``KeyboardInterrupt`` at once).
    Use as a context manager around the training loop; ``any(comm)`` is a
    one-int allreduce that tells every rank whether any rank was interrupted.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        if self.requested:  # second signal: give up waiting for the step boundary
            self._restore()
            raise KeyboardInterrupt
        self.requested = True
        self.signum = signum

    def any(self, comm: Any) -> bool:
        if comm.Get_size() == 1:
            return self.requested
        from mpi4py import MPI

        return bool(comm.allreduce(int(self.requested), op=MPI.MAX))

    def _restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()

    def __enter__(self) -> StopFlag:
        import threading

        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()


# -- model ----------------------------------------------------------------------------------


def build_model(cfg: Any, input_shape: tuple[int, int, int], model: Any | None = None) -> Any:
    """``create_model(cfg.model)`` (or the given model), checked against the data's input shape
    and compiled for ``cfg.model.batch_size``."""
    if model is None:
        from theanompi.models import create_model

        model = create_model(cfg.model)
    if tuple(model.input_shape) != tuple(input_shape):
        raise ConfigError(
            f"model {cfg.model.name!r} takes inputs {tuple(model.input_shape)} but the data gives "
            f"{tuple(input_shape)}; set model.input_size / channels to match"
        )
    model.build(int(cfg.model.batch_size))
    return model


# -- snapshots ------------------------------------------------------------------------------


class Snapshotter:
    """Save and restore a training run's checkpoints, with per-rank side files.

    ``local_opt``: the optimizer state differs between ranks (BSP ``avg`` with
    N > 1), so ranks > 0 store theirs in ``epoch_NNNN.rank<r>.npz`` (written
    before the main file, which is the commit point). RNG states are always
    rank-local. Without side files a resume uses rank 0's state everywhere.
    """

    def __init__(self, cfg: Any, comm: Any, model: Any, *, local_opt: bool) -> None:
        self.cfg, self.comm, self.model = cfg, comm, model
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.dir = Path(cfg.output.checkpoint_dir)
        self.local_opt = local_opt and self.size > 1

    def due(self, epoch_done: int, n_epochs: int) -> bool:
        """Checkpoint after ``epoch_done`` finished epochs? (every ``snapshot_freq``, and the last)."""
        freq = int(self.cfg.output.snapshot_freq)
        if freq <= 0:
            return False
        return epoch_done % freq == 0 or epoch_done == n_epochs

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
                "config": self.cfg.to_dict(),
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
