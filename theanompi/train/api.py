"""The front door's training calls: ``load_config`` as ``tmpi train`` builds the config, and ``fit``,
which trains it under the current MPI job as ``tmpi train`` does."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["load_config", "fit", "as_percent", "PERCENT_KEYS"]

#: the summary's figures that :func:`fit` gives in percent (``run`` gives fractions)
PERCENT_KEYS = ("val_top1_err", "val_top5_err")


def load_config(
    model: str | os.PathLike[str] | None = None,
    run: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Any:
    """The validated, frozen run config, as ``tmpi train --model MODEL --config RUN --set
    KEY=VALUE ...`` builds it.

    Parameters
    ----------
    model
        A model config: a name under ``configs/`` (``"digits"``), a YAML path, a registered
        model, ``package.module:Class`` or ``path/to/file.py:Class``.
    run
        The run config YAML (default ``configs/config.yaml``, shipped with the package).
    overrides
        ``{"section.key": value}``, e.g. ``{"data.dir": "data/digits", "model.n_epochs": 2}``;
        ``None`` values are ignored, paths may be ``Path`` objects.

    Raises
    ------
    ConfigError
        One line naming the key and the fix (``tmpi`` exits 2 with it).
    """
    from theanompi.config import load_config as _load

    over = {k: (str(v) if isinstance(v, os.PathLike) else v) for k, v in (overrides or {}).items()}
    return _load(None if run is None else Path(run), model, over)


def fit(
    cfg: Any, model: Any = None, *, resume: bool = False, overwrite: bool = False
) -> dict[str, Any]:
    """Train ``cfg`` on the ranks of the current job, as ``tmpi train`` does.

    The same progress lines, checkpoints, record and run-dir rules: :func:`theanompi.init`
    first (PyTensor, MPI, the abort hook: one rank's exception ends the job), the rule's
    world-size check, a Ctrl-C (SIGINT, SIGTERM, the launcher's stop) that stops at a step
    boundary with a checkpoint, and the stall watchdog (``training.stall_timeout``).
    Collective: every rank calls it. Run it with ``tmpi run -n N script.py`` or ``mpirun
    -n N python script.py``.

    Parameters
    ----------
    cfg
        A config from :func:`load_config`.
    model
        An already created model (default: the one ``cfg.model`` names).
    resume, overwrite
        As ``tmpi train --resume`` / ``--overwrite``: continue from the run dir's latest
        checkpoint, or start again in a run dir that holds a run.

    Returns
    -------
    dict
        :func:`theanompi.train.run.run`'s summary, the same on every rank, except that
        ``val_top1_err`` and ``val_top5_err`` are in **percent**, as every figure
        ``tmpi`` prints (``run`` and the record keep fractions); ``None`` without validation.

    Raises
    ------
    SystemExit
        Code 130 when a stop request ended the training (the checkpoint is written; ``resume=True``
        continues), as ``tmpi train`` exits 130.
    UserError
        A bad config, run dir or data: one line and its exit code under ``tmpi run``.
    """
    from theanompi.comm import world
    from theanompi.config import check_world_size
    from theanompi.distributed import init
    from theanompi.launch.signals import StopFlag
    from theanompi.train.run import run

    init()
    check_world_size(cfg, world().Get_size())
    with StopFlag():  # a stop during set-up waits for the loop's first step boundary
        summary = run(cfg, resume=resume, overwrite=overwrite, model=model)
    summary = as_percent(summary)
    if summary.get("interrupted"):
        raise SystemExit(130)
    return summary


def as_percent(summary: Mapping[str, Any]) -> dict[str, Any]:
    """``summary`` with :data:`PERCENT_KEYS` times 100 (``None`` kept)."""
    out = dict(summary)
    for key in PERCENT_KEYS:
        if out.get(key) is not None:
            out[key] = 100.0 * float(out[key])
    return out
