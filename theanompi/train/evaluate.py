"""``tmpi eval``: top-1 / top-5 error and loss of a checkpoint on the val split, MPI-parallel.

Every rank evaluates its share of the val sub-batches (``ValLoader``: rank ``r``
of ``N`` takes sub-batches ``r, r + N, ...``) with :func:`theanompi.models.metrics.evaluate`,
the code path of in-training validation: the same tie rule, loss floor and exact,
N-independent reduction (see :mod:`theanompi.models.metrics`). Padded val slots (label ``-1``)
are ignored.

Rank 0 prints a table and writes a JSON report next to the checkpoint
(``epoch_0003.eval.json``, atomically); ``per_class`` adds per-class accuracy
with the synset names of ``misc/synsets.txt``; ``save_predictions`` writes the
top-5 class indices of every (non-padded) val image in val order
(``epoch_0003.top5.npy``, int32 (n_images, 5)).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from theanompi.comm import collective
from theanompi.errors import ConfigError, DataError
from theanompi.models.metrics import TOP_K, evaluate, indexed_batches

__all__ = [
    "run",
    "load_model_checkpoint",
    "report_path",
    "predictions_path",
    "resolve_checkpoint",
    "format_table",
    "collective",
]


def report_path(checkpoint: str | Path) -> Path:
    """``epoch_0003.npz`` -> ``epoch_0003.eval.json`` beside it."""
    p = Path(checkpoint)
    return p.with_name(f"{p.stem}.eval.json")


def predictions_path(checkpoint: str | Path) -> Path:
    """``epoch_0003.npz`` -> ``epoch_0003.top5.npy`` beside it."""
    p = Path(checkpoint)
    return p.with_name(f"{p.stem}.top{TOP_K}.npy")


def load_model_checkpoint(model: Any, checkpoint: str | Path, model_name: str | None = None) -> Any:
    """Load ``checkpoint`` into ``model.params`` (optimizer state is not needed to evaluate).

    A checkpoint of another model raises a one-line ``ConfigError`` naming the parameter
    (and, when the checkpoint's meta names another model than ``model_name``, that model).
    """
    from theanompi.comm import log
    from theanompi.io.checkpoint import apply_checkpoint, load_checkpoint
    from theanompi.registry import source_changed

    ckpt = load_checkpoint(checkpoint)
    changed = model_name and source_changed(ckpt.meta.get("model_source"), model_name)
    if changed:
        log(f"note: {changed}", file=sys.stderr)
    try:
        apply_checkpoint(model, ckpt, opt_state=False)
    except ConfigError as err:
        trained = ((ckpt.meta.get("config") or {}).get("model") or {}).get("name")
        other = trained and model_name and trained != model_name
        hint = f" (it was trained with model {trained!r}, not {model_name!r})" if other else ""
        raise ConfigError(f"{err}{hint}") from None
    return ckpt


def resolve_checkpoint(cfg: Any, checkpoint: str | Path | None) -> Path:
    """The checkpoint to evaluate: ``checkpoint``, or the latest of the run; one clear
    :class:`DataError` where there is none (the launcher checks it before mpirun starts)."""
    from theanompi.io.checkpoint import latest_checkpoint

    if checkpoint is not None:
        p = Path(checkpoint)
        if not p.exists():
            raise DataError(f"checkpoint {str(p)!r} not found; check --checkpoint")
        return p
    found = latest_checkpoint(cfg.output.checkpoint_dir)
    if found is None:
        raise DataError(
            f"no checkpoint (epoch_NNNN.npz) in {cfg.output.checkpoint_dir!r}; train first "
            "(tmpi train), pass --run-dir RUN or --checkpoint FILE"
        )
    return found


def _check_val_folder(cfg: Any) -> None:
    """Clear errors for a missing data dir / val folder before the loader's deeper checks."""
    from theanompi.data.loader import data_manifest

    root = Path(cfg.data.dir)
    man = data_manifest(root)
    info = man.get("val") or {}
    folder = root / str(info.get("dir", f"val_hkl_b{man.get('batch_size', '?')}"))
    if not info or not folder.is_dir():
        raise DataError(
            f"val folder {str(folder)!r} not found; rerun `tmpi prep batch --out {root}`"
        )


def _synsets(cfg: Any, K: int) -> list[tuple[str, str]]:
    from theanompi.io.dataset import load_synsets

    try:
        rows = load_synsets(cfg.data.dir)
    except DataError:
        rows = []
    return [rows[i] if i < len(rows) else (str(i), str(i)) for i in range(K)]


def format_table(report: dict[str, Any]) -> str:
    """The eval table printed by rank 0 (one header, one row; per-class rows when present)."""
    head = f"{'top-1 error':>12} {'top-5 error':>12} {'loss':>9} {'images':>8} {'images/s':>10}"
    row = (
        f"{100 * report['top1_error']:>10.2f} % {100 * report['top5_error']:>10.2f} % "
        f"{report['loss']:>9.4f} {report['images']:>8d} {report['images_per_s']:>10.1f}"
    )
    lines = [
        f"checkpoint {report['checkpoint']} (epoch {report['epoch']}), model {report['model']}, "
        f"{report['ranks']} rank(s)",
        head,
        "-" * len(head),
        row,
    ]
    if report.get("per_class"):
        lines += ["", f"{'class':>5} {'wnid':<12} {'name':<20} {'images':>7} {'top-1 acc':>10}"]
        for c in report["per_class"]:
            acc = "-" if c["top1_accuracy"] is None else f"{100 * c['top1_accuracy']:.2f} %"
            lines.append(
                f"{c['index']:>5} {c['wnid']:<12} {c['name'][:20]:<20} {c['images']:>7} {acc:>10}"
            )
    return "\n".join(lines)


def _setup(
    cfg: Any, checkpoint: str | Path | None, model: Any, rank: int, size: int
) -> tuple[Path, Any, Any, Any]:
    """Checkpoint path, val loader, compiled model with the checkpoint loaded, checkpoint."""
    from theanompi.data import ValLoader

    ckpt_path = resolve_checkpoint(cfg, checkpoint)
    _check_val_folder(cfg)
    loader = ValLoader(cfg, rank, size)
    if model is None:
        from theanompi.models import create_model

        model = create_model(cfg.model)
    ckpt = load_model_checkpoint(model, ckpt_path, str(cfg.model.name))  # before compile
    model.build(loader.batch_size, backend=cfg.training.backend)
    return ckpt_path, loader, model, ckpt


def _per_class_rows(cfg: Any, res: dict[str, Any], K: int) -> list[dict[str, Any]]:
    """Per-class image counts and top-1 accuracy, with the synset names, for the report."""
    names = _synsets(cfg, K)
    return [
        {
            "index": c,
            "wnid": names[c][0],
            "name": names[c][1],
            "images": int(res["class_images"][c]),
            "top1_correct": int(res["class_top1"][c]),
            "top1_accuracy": (
                float(res["class_top1"][c] / res["class_images"][c])
                if res["class_images"][c]
                else None
            ),
        }
        for c in range(K)
    ]


def _write_report(
    cfg: Any,
    res: dict[str, Any],
    ckpt_path: Path,
    ckpt: Any,
    loader: Any,
    size: int,
    K: int,
    per_class: bool,
    save_predictions: bool,
) -> dict[str, Any]:
    """Rank 0: check the image count, build the report, write it (and the predictions)."""
    from theanompi.io.atomic import write_json, write_npy

    if res["images"] != loader.n_images:
        raise DataError(
            f"evaluated {res['images']} val images but the labels list {loader.n_images}; "
            "rerun `tmpi prep labels`"
        )
    report = {
        "checkpoint": str(ckpt_path),
        "epoch": ckpt.epoch,
        "model": str(cfg.model.name),
        "data": str(cfg.data.dir),
        "ranks": size,
        "batch_size": loader.batch_size,
        **{
            k: res[k]
            for k in ("images", "top1_error", "top5_error", "loss", "seconds", "images_per_s")
        },
    }
    if per_class:
        report["per_class"] = _per_class_rows(cfg, res, K)
    if save_predictions:
        pp = predictions_path(ckpt_path)
        write_npy(pp, res["predictions"].astype(np.int32))
        report["predictions"] = str(pp)
    rp = report_path(ckpt_path)
    report["report"] = str(rp)
    write_json(rp, report)
    return report


def run(
    cfg: Any,
    checkpoint: str | Path | None = None,
    per_class: bool = False,
    save_predictions: bool = False,
    *,
    model: Any = None,
    comm: Any = None,
    quiet: bool = False,
) -> dict[str, Any]:
    """Evaluate a checkpoint on the val split over all ranks of ``comm``.

    Parameters
    ----------
    cfg
        Validated :class:`theanompi.config.Config` (data dir, model section, checkpoint dir).
    checkpoint
        Checkpoint file; default: the latest in ``cfg.output.checkpoint_dir``.
    per_class
        Add per-class top-1 accuracy (with synset names) to the table and report.
    save_predictions
        Write the top-5 class indices of every val image (``.top5.npy`` beside the checkpoint).
    model
        A model object to use instead of ``create_model(cfg.model)`` (anything following
        the ``Model`` protocol: ``params`` as shared variables, ``build``, ``predict``).
    comm
        Communicator (default ``MPI.COMM_WORLD``).
    quiet
        Do not print the table.

    Returns
    -------
    dict
        The report (same on every rank): ``top1_error``, ``top5_error``, ``loss``,
        ``images``, ``images_per_s``, ``seconds``, ``checkpoint``, ``report`` (JSON path), ...
    """
    from mpi4py import MPI

    from theanompi.comm import log
    from theanompi.train.startup import check_nodes

    comm = MPI.COMM_WORLD if comm is None else comm
    rank, size = comm.Get_rank(), comm.Get_size()
    collective(comm, check_nodes, comm, str(cfg.data.dir), None)  # same data on every node
    ckpt_path, loader, model, ckpt = collective(comm, _setup, cfg, checkpoint, model, rank, size)

    K = int(model.n_classes)
    # the code path of in-training validation (theanompi.models.metrics.validate): same numbers
    res = evaluate(
        model, indexed_batches(loader), comm, n_classes=K, keep_predictions=save_predictions
    )
    report: dict[str, Any] | None = None
    if rank == 0:
        assert res is not None
        report = _write_report(
            cfg, res, ckpt_path, ckpt, loader, size, K, per_class, save_predictions
        )
        if not quiet:
            log(format_table(report))
            log(
                f"wrote {report['report']}"
                + (f" and {report['predictions']}" if save_predictions else "")
            )
    return comm.bcast(report, root=0)
