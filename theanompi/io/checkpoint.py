"""Checkpoints: one atomic ``.npz`` per snapshot holding params, optimizer state and a JSON meta.

Layout of ``<checkpoint_dir>/epoch_0003.npz`` (written after 3 finished epochs):

* ``p000`` ... : parameter values, in ``model.params`` order;
* ``o000`` ... : optimizer state (momentum buffers ...), in ``model.opt_state`` order;
* ``b000`` ... : non-trainable buffers (batch-norm running statistics), in ``model.buffers``
  order (absent in checkpoints of models without buffers and in older checkpoints);
* ``meta``     : a 0-d unicode array holding JSON with at least ``param_names``,
  ``param_shapes``, ``opt_names``, ``opt_shapes``, ``buf_names``, ``buf_shapes``, ``epoch``,
  ``step``, and whatever the caller adds (``config``, ``rng`` states, ...).

Files are written through :func:`theanompi.io.atomic.atomic_write`, so an interrupted
save never replaces (or half-writes) a good checkpoint. Rank-local state (for
BSP ``avg`` the momentum buffers of ranks > 0 differ from rank 0's) goes in a
side file ``epoch_0003.rank1.npz`` with the same format; it is written before
the main file, which is the commit point.

Mid-epoch checkpoints (``output.checkpoint_every_steps`` / ``_minutes``) are named
``epoch_0003_step_00005.npz``: 3 finished epochs and 5 steps of the next; they sort
between ``epoch_0003.npz`` and ``epoch_0004.npz``, and :func:`latest_checkpoint` picks
the furthest of either kind.

>>> import numpy as np, tempfile, pathlib
>>> class M:  # anything with .params / .opt_state lists of arrays or shared variables
...     params = [np.ones((2, 3), np.float32)]
...     opt_state = [np.zeros((2, 3), np.float32)]
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> p = save_checkpoint(checkpoint_path(d, 1), M(), {"epoch": 1, "step": 10})
>>> ck = load_checkpoint(latest_checkpoint(d))
>>> ck.epoch, ck.step, ck.params[0].shape
(1, 10, (2, 3))
"""

from __future__ import annotations

import json
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from theanompi.errors import ConfigError, DataError
from theanompi.io.atomic import atomic_write

__all__ = [
    "Checkpoint",
    "save_checkpoint",
    "load_checkpoint",
    "apply_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "checkpoint_path",
    "rank_state_path",
    "save_arrays",
    "array_values",
    "array_names",
]

FORMAT_VERSION = 1
_NAME_RE = re.compile(r"^epoch_(\d+)(?:_step_(\d+))?\.npz$")


@dataclass
class Checkpoint:
    """A loaded checkpoint: ``params``, ``opt_state`` and ``buffers`` (lists of ndarray) and
    ``meta`` (dict)."""

    path: Path
    params: list[np.ndarray]
    opt_state: list[np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)
    buffers: list[np.ndarray] = field(default_factory=list)

    @property
    def epoch(self) -> int:
        """Finished epochs when the checkpoint was written (the epoch to run next)."""
        return int(self.meta.get("epoch", 0))

    @property
    def step(self) -> int:
        """Global step count (steps done by each rank) when the checkpoint was written."""
        return int(self.meta.get("step", 0))


def checkpoint_path(checkpoint_dir: str | Path, epoch: int, step_in_epoch: int = 0) -> Path:
    """``<checkpoint_dir>/epoch_0003.npz`` for ``epoch=3``; ``epoch_0003_step_00005.npz``
    with ``step_in_epoch=5`` (a mid-epoch checkpoint: 5 steps into the 4th epoch)."""
    name = f"epoch_{epoch:04d}" + (f"_step_{step_in_epoch:05d}" if step_in_epoch else "")
    return Path(checkpoint_dir) / f"{name}.npz"


def rank_state_path(path: str | Path, rank: int) -> Path:
    """Side file of rank-local state: ``epoch_0003.npz`` -> ``epoch_0003.rank1.npz``."""
    path = Path(path)
    return path.with_name(f"{path.stem}.rank{rank}.npz")


def array_values(items: list[Any]) -> list[np.ndarray]:
    """Values of shared variables (``get_value(borrow=True)``) or arrays, as ndarrays."""
    return [np.asarray(v.get_value(borrow=True) if hasattr(v, "get_value") else v) for v in items]


def array_names(items: list[Any], prefix: str) -> list[str]:
    """``.name`` of each item, or ``f"{prefix}{i}"`` where it has none."""
    return [getattr(v, "name", None) or f"{prefix}{i}" for i, v in enumerate(items)]


def save_arrays(
    path: str | Path,
    params: list[np.ndarray],
    opt_state: list[np.ndarray],
    meta: dict[str, Any],
    buffers: list[np.ndarray] | None = None,
) -> Path:
    """Write arrays + JSON ``meta`` atomically in the checkpoint format; return the path.

    ``meta`` must be JSON-serialisable (numpy scalars are converted).
    """
    path = Path(path)
    buffers = list(buffers or [])
    payload: dict[str, np.ndarray] = {}
    for i, a in enumerate(params):
        payload[f"p{i:03d}"] = np.asarray(a)
    for i, a in enumerate(opt_state):
        payload[f"o{i:03d}"] = np.asarray(a)
    for i, a in enumerate(buffers):
        payload[f"b{i:03d}"] = np.asarray(a)
    full = {"format": FORMAT_VERSION, "n_params": len(params), "n_opt": len(opt_state), **meta}
    if buffers:
        full["n_buf"] = len(buffers)
    payload["meta"] = np.array(json.dumps(full, default=_json_default, sort_keys=True))
    with atomic_write(path) as tmp:
        with open(tmp, "wb") as fh:
            np.savez(fh, **payload)
    return path


def save_checkpoint(path: str | Path, model: Any, meta: dict[str, Any]) -> Path:
    """Save ``model.params``, ``model.opt_state`` and ``model.buffers`` with ``meta`` (epoch,
    step, config, rng ...).

    ``model`` is anything with ``params`` and ``opt_state`` lists of shared
    variables or arrays (an EASGD server may pass its centre variable this way), and
    optionally ``buffers``. Names and shapes are added to the meta. Returns the path written.
    """
    params = list(model.params)
    opt = list(getattr(model, "opt_state", []) or [])
    bufs = list(getattr(model, "buffers", []) or [])
    pv, ov, bv = array_values(params), array_values(opt), array_values(bufs)
    full = {
        "param_names": array_names(params, "param"),
        "param_shapes": [list(a.shape) for a in pv],
        "opt_names": array_names(opt, "opt"),
        "opt_shapes": [list(a.shape) for a in ov],
        **meta,
    }
    if bufs:
        full["buf_names"] = array_names(bufs, "buffer")
        full["buf_shapes"] = [list(a.shape) for a in bv]
    return save_arrays(path, pv, ov, full, bv)


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint written by :func:`save_checkpoint`; ``DataError`` if missing or corrupt."""
    path = Path(path)
    if not path.exists():
        raise DataError(
            f"checkpoint {str(path)!r} not found; check the path or list the checkpoint dir"
        )
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"][()]))
            params = [z[f"p{i:03d}"] for i in range(int(meta["n_params"]))]
            opt = [z[f"o{i:03d}"] for i in range(int(meta["n_opt"]))]
            bufs = [z[f"b{i:03d}"] for i in range(int(meta.get("n_buf", 0)))]
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, json.JSONDecodeError) as err:
        raise DataError(
            f"checkpoint {str(path)!r} is unreadable ({type(err).__name__}: {err}); "
            "delete it to fall back to the previous one"
        ) from None
    return Checkpoint(path=path, params=params, opt_state=opt, meta=meta, buffers=bufs)


def _check_match(
    where: str, kind: str, names: list[str], model_items: list[Any], arrays: list[np.ndarray]
) -> None:
    model_names = array_names(model_items, kind)
    model_vals = array_values(model_items)
    for i, (mn, mv) in enumerate(zip(model_names, model_vals, strict=False)):
        if i >= len(arrays):
            raise ConfigError(
                f"{where}: model {kind} {mn!r} is missing from the checkpoint; "
                "it was written by a different model config"
            )
        if i < len(names) and names[i] != mn:
            raise ConfigError(
                f"{where}: {kind} #{i} is {names[i]!r} in the checkpoint but {mn!r} "
                "in the model; use the model config the checkpoint was trained with"
            )
        if tuple(arrays[i].shape) != tuple(mv.shape):
            raise ConfigError(
                f"{where}: {kind} {mn!r} has shape {tuple(arrays[i].shape)} in the "
                f"checkpoint but {tuple(mv.shape)} in the model; use the model "
                "config the checkpoint was trained with"
            )
    if len(arrays) > len(model_vals):
        extra = names[len(model_vals)] if len(names) > len(model_vals) else f"#{len(model_vals)}"
        raise ConfigError(
            f"{where}: checkpoint {kind} {extra!r} does not exist in the model; "
            "use the model config the checkpoint was trained with"
        )


def apply_checkpoint(model: Any, ckpt: Checkpoint, *, opt_state: bool = True) -> None:
    """Copy the checkpoint's params and buffers (and ``opt_state``) into the model's shared
    variables.

    Names (in order) and shapes must match; a mismatch raises a one-line
    ``ConfigError`` naming the parameter (or buffer: a checkpoint without batch-norm
    statistics does not fit a model with them, nor the other way round). Values are cast
    to the variable's dtype.
    """
    where = f"checkpoint {ckpt.path.name}"
    _check_match(where, "param", ckpt.meta.get("param_names", []), list(model.params), ckpt.params)
    bufs = list(getattr(model, "buffers", []) or [])
    _check_match(where, "buffer", ckpt.meta.get("buf_names", []), bufs, ckpt.buffers)
    groups = [(list(model.params), ckpt.params), (bufs, ckpt.buffers)]
    if opt_state:
        items = list(getattr(model, "opt_state", []) or [])
        _check_match(where, "opt", ckpt.meta.get("opt_names", []), items, ckpt.opt_state)
        groups.append((items, ckpt.opt_state))
    for items, arrays in groups:
        for var, arr in zip(items, arrays, strict=True):
            if hasattr(var, "set_value"):
                cur = var.get_value(borrow=True)
                var.set_value(np.array(arr, dtype=cur.dtype, copy=True), borrow=True)
            else:
                np.copyto(var, arr, casting="same_kind")


def list_checkpoints(checkpoint_dir: str | Path) -> list[Path]:
    """All ``epoch_NNNN.npz`` and ``epoch_NNNN_step_KKKKK.npz`` in the folder, oldest first
    (by epoch, then step in the epoch; temp files and side files ignored)."""
    d = Path(checkpoint_dir)
    if not d.is_dir():
        return []
    found = [
        ((int(m.group(1)), int(m.group(2) or 0)), p)
        for p in d.iterdir()
        if (m := _NAME_RE.match(p.name))
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """The furthest checkpoint (highest epoch, then step in the epoch), or ``None``."""
    found = list_checkpoints(checkpoint_dir)
    return found[-1] if found else None


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable in checkpoint meta: {type(obj).__name__}")
