"""Run-folder safety: never train over an old run silently; on ``--resume`` compare the configs.

``tmpi train`` into a run folder whose checkpoint dir holds checkpoints refuses with one
line unless ``--resume`` (continue it) or ``--overwrite`` (delete the old run's
checkpoints, side files, eval reports and record, and only those: any other file in the
folders stays) is given. ``--resume`` compares the
config stored in the latest checkpoint with the current one: a change of a key in
:data:`BREAKING` (what the parameters, their shapes or the data slicing depend on)
refuses, listing every such key; other changes (epochs, lr schedule, print and checkpoint
frequencies, the exchange strategy, the worker count N) are allowed and named in a note.
The folders are created and test-written first, so an unwritable run dir fails here, in
one line, before any model is built.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from theanompi.errors import ConfigError, UserError, resource_error

__all__ = [
    "BREAKING",
    "prepare_run_dir",
    "check_run_dir",
    "refuse_run_dir",
    "WaysOut",
    "FLAG_WAYS_OUT",
    "MAKE_WAYS_OUT",
    "config_changes",
    "old_run_files",
    "stored_config",
]

#: keys whose change makes a checkpoint unusable for the current config (prefixes: ``model.arch``
#: covers every ``model.arch.*``): the network and its shapes, the per-worker batch and the
#: data's stored format, and the sync rule (its checkpoint holds another kind of state).
BREAKING = (
    "model.name",
    "model.arch",
    "model.input_size",
    "model.channels",
    "model.n_classes",
    "model.batch_size",
    "data.file_batch_size",
    "data.image_size",
    "data.layout",
    "weight_exchange.sync_rule",
)

#: what a run writes in its checkpoint dir: checkpoints (``epoch_0003.npz``, mid-epoch ones
#: named by step), their rank side files, ``tmpi eval`` reports and predictions, and the
#: temp files of an interrupted atomic write (``.epoch_0003.xxxx.tmp.npz``)
_CKPT_FILE = re.compile(r"^\.?(epoch|step)_\d+[\w.-]*\.(npz|json|npy)$")
#: what a run writes in its record dir: the record, its plot, temp files of the record
_RECORD_FILE = re.compile(r"^(record\.jsonl|curves\.png|\.record\.[\w-]+\.tmp\.jsonl)$")


def _files(folder: Path, pattern: re.Pattern[str]) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_file() and pattern.match(p.name))


def old_run_files(checkpoint_dir: str | Path, record_dir: str | Path) -> list[Path]:
    """The files of an earlier run in these folders (what ``--overwrite`` deletes)."""
    return _files(Path(checkpoint_dir), _CKPT_FILE) + _files(Path(record_dir), _RECORD_FILE)


def stored_config(checkpoint: str | Path) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """``(config, meta)`` stored in a checkpoint's meta, reading only the meta entry;
    ``(None, {})`` when the file cannot be read (the resume reports that itself)."""
    try:
        with np.load(checkpoint, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"][()]))
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, json.JSONDecodeError):
        return None, {}
    config = meta.get("config")
    return (config if isinstance(config, dict) else None), meta


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):  # an empty one (arch: {}) adds no key
            out.update(_flat(v, f"{name}."))
        else:
            out[name] = v
    return out


def _breaking(name: str) -> bool:
    return any(name == b or name.startswith(b + ".") for b in BREAKING)


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """``(breaking, allowed)``: ``"key old -> new"`` for every key that differs between two
    ``Config.to_dict()`` values. A key only one side has (added to the schema since) counts
    only when it is breaking.

    >>> config_changes({"model": {"n_epochs": 6, "batch_size": 32}},
    ...                {"model": {"n_epochs": 9, "batch_size": 64}})
    (['model.batch_size 32 -> 64'], ['model.n_epochs 6 -> 9'])
    """
    a, b = _flat(old), _flat(new)
    breaking, allowed = [], []
    for name in sorted(a.keys() | b.keys()):
        if name.startswith("output.") and name.endswith("_dir"):
            continue  # where the run lives (the folder may have been moved)
        missing = object()
        va, vb = a.get(name, missing), b.get(name, missing)
        if va == vb or ((va is missing or vb is missing) and not _breaking(name)):
            continue
        text = f"{name} {'(none)' if va is missing else repr(va)} -> "
        text += "(none)" if vb is missing else repr(vb)
        (breaking if _breaking(name) else allowed).append(text)
    return breaking, allowed


def _writable(folder: Path, key: str) -> None:
    """Create ``folder`` and write a temp file in it; one-line errors naming ``key``."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmpi-write-test.", dir=folder)
        os.close(fd)
        os.unlink(tmp)
    except OSError as err:
        refused = resource_error(err, f"{key} folder", folder)
        if refused is not None:
            raise refused from None
        raise ConfigError(
            f"{key} {str(folder)[:200]!r} cannot be used as a folder ({err.strerror or err}); "
            f"point {key} (or --run-dir) at another path"
        ) from None


class WaysOut(NamedTuple):
    """How the user continues, replaces or moves past a run dir that holds a run: the words
    a refusal names (flags of ``tmpi train``, or make variables under ``make``)."""

    resume: str = "--resume"
    overwrite: str = "--overwrite"
    new_run: str = "--run-dir NEW"
    verb: str = "pass"


#: the ways out on ``tmpi train``'s command line
FLAG_WAYS_OUT = WaysOut()
#: the ways out on ``make train``'s command line (``RESUME=1`` -> ``--resume``, ...)
MAKE_WAYS_OUT = WaysOut("RESUME=1", "OVERWRITE=1", "RUN=runs/NEW", "rerun make with")


def _checkpoints(ckpt_dir: Path) -> list[Path]:
    return [p for p in _files(ckpt_dir, _CKPT_FILE) if p.suffix == ".npz" and p.name[0] != "."]


def _refuse_both(resume: bool, overwrite: bool, ways: WaysOut) -> None:
    if resume and overwrite:
        raise ConfigError(
            f"{ways.resume} and {ways.overwrite} contradict each other; {ways.verb} "
            f"{ways.resume} to continue the run or {ways.overwrite} to start it again"
        )


def _refuse_old_run(out: Any, ckpt_dir: Path, ckpts: list[Path], ways: WaysOut) -> None:
    """A run dir holding checkpoints, without --resume or --overwrite."""
    if not ckpts:
        return
    from theanompi.io.checkpoint import latest_checkpoint, list_checkpoints

    main = list_checkpoints(ckpt_dir)
    if main:
        what = f"{len(main)} checkpoint(s), latest {latest_checkpoint(ckpt_dir).name}"
    else:
        what = f"{len(ckpts)} checkpoint file(s), e.g. {ckpts[-1].name}"
    raise ConfigError(
        f"run dir {out.run_dir!r} already holds a run ({what}); {ways.verb} {ways.resume} to "
        f"continue it, {ways.overwrite} to replace it, or {ways.new_run} for a new run"
    )


def _compare_stored(cfg: Any, latest: Path, ways: WaysOut) -> tuple[dict[str, Any], list[str]]:
    """``--resume``: refuse a breaking config change since ``latest``; (its meta, notes),
    the meta empty when there was no config to compare."""
    stored, meta = stored_config(latest)
    if stored is None:
        return {}, [f"resume: {latest.name} stores no config; it was not compared"] if meta else []
    breaking, allowed = config_changes(stored, cfg.to_dict())
    if breaking:
        raise ConfigError(
            f"--resume: the config changed in key(s) the checkpoint {latest.name} depends on: "
            f"{'; '.join(breaking)}; restore them, or start a new run with {ways.new_run} "
            f"(or {ways.overwrite})"
        )
    from theanompi.registry import source_changed

    notes = [f"resume: changed since {latest.name}: {'; '.join(allowed)}"] if allowed else []
    changed = source_changed(meta.get("model_source"), str(cfg.model.name))
    return meta, [*notes, f"resume: {changed}"] if changed else notes


def refuse_run_dir(
    cfg: Any, *, resume: bool, overwrite: bool, ways: WaysOut = FLAG_WAYS_OUT
) -> None:
    """The refusals of :func:`prepare_run_dir`, read-only (the launcher's check before
    mpirun starts): both flags together, a run dir holding a run without either, and on
    ``resume`` a breaking config change. Creates, writes and deletes nothing."""
    _refuse_both(resume, overwrite, ways)
    if overwrite:
        return
    ckpt_dir = Path(cfg.output.checkpoint_dir)
    if not resume:
        _refuse_old_run(cfg.output, ckpt_dir, _checkpoints(ckpt_dir), ways)
        return
    from theanompi.io.checkpoint import latest_checkpoint

    latest = latest_checkpoint(ckpt_dir)
    if latest is not None:
        _compare_stored(cfg, latest, ways)


def prepare_run_dir(cfg: Any, *, resume: bool, overwrite: bool, n_workers: int) -> list[str]:
    """Check (and on ``overwrite`` clear) the run folders of ``cfg``; returns notes to print.

    Runs on one rank (no MPI). Raises ``ConfigError`` (exit 2) for a run dir holding
    an old run without ``--resume``/``--overwrite``, for both flags together, and for a
    breaking config change on resume; ``ResourceError`` (exit 4) for an unwritable folder.
    """
    out = cfg.output
    ckpt_dir, rec_dir = Path(out.checkpoint_dir), Path(out.record_dir)
    ways = FLAG_WAYS_OUT
    _refuse_both(resume, overwrite, ways)
    for folder, key in (
        (Path(out.run_dir), "output.run_dir"),
        (ckpt_dir, "output.checkpoint_dir"),
        (rec_dir, "output.record_dir"),
    ):
        _writable(folder, key)
    from theanompi.io.checkpoint import latest_checkpoint

    notes: list[str] = []
    if overwrite:
        old = old_run_files(ckpt_dir, rec_dir)
        for p in old:
            p.unlink(missing_ok=True)
        if old:
            notes.append(
                f"--overwrite: deleted the old run's {len(old)} file(s) in {out.run_dir} "
                "(checkpoints, side files, eval reports, record); other files were kept"
            )
        return notes
    if not resume:
        _refuse_old_run(out, ckpt_dir, _checkpoints(ckpt_dir), ways)
        return notes
    latest = latest_checkpoint(ckpt_dir)
    if latest is None:
        return notes  # the resume itself says there is nothing to resume from
    meta, notes = _compare_stored(cfg, latest, ways)
    if not meta:
        return notes
    old_n = int(meta.get("world_size", n_workers) or n_workers)
    if old_n != n_workers:
        b = int(cfg.model.batch_size)
        notes.append(
            f"resume: {old_n} -> {n_workers} worker(s): the global batch becomes "
            f"{b * n_workers} (was {b * old_n}) and the steps per epoch change; the run "
            "goes on from the checkpoint but is not bit-exact with an uninterrupted one"
        )
    return notes


def check_run_dir(comm: Any, cfg: Any, *, resume: bool, overwrite: bool, n_workers: int) -> None:
    """Collective :func:`prepare_run_dir`: rank 0 checks and prints its notes (stderr).

    An error is raised on every rank, of the same class, marked ``agreed`` so that the CLI
    prints it once (rank 0) and every rank exits with its code.
    """
    from theanompi import errors

    result: tuple[str, str, int] | list[str] = []
    err: UserError | None = None
    if comm.Get_rank() == 0:
        try:
            result = prepare_run_dir(cfg, resume=resume, overwrite=overwrite, n_workers=n_workers)
        except UserError as e:
            err, result = e, (type(e).__name__, str(e), e.exit_code)
    if comm.Get_size() > 1:
        result = comm.bcast(result, root=0)
    if isinstance(result, tuple):
        if err is None:
            name, msg, code = result
            cls = getattr(errors, name, None)
            err = cls(msg) if isinstance(cls, type) and issubclass(cls, UserError) else None
            if err is None:
                err = UserError(msg)
                err.exit_code = code
        err.agreed = True
        raise err
    if comm.Get_rank() == 0:
        for note in result:
            print(f"note: {note}", file=sys.stderr, flush=True)
