"""``tmpi eval``: top-1 / top-5 error and loss of a checkpoint on the val split, MPI-parallel.

Every rank evaluates its share of the val sub-batches (``ValLoader``: rank ``r``
of ``N`` takes sub-batches ``r, r + N, ...``; each sub-batch is the same ``b``
images for any ``N``, so each image's probabilities are the same bits for any
``N``). Counts (top-1 / top-5 hits, images, per-class hits) are integers and are
summed exactly; the loss is summed per sub-batch in float64, gathered to rank 0
indexed by the global sub-batch number and added up in that order. The result
is therefore identical for any ``N``. Padded val slots (label ``-1``) are ignored.

Rank 0 prints a table and writes a JSON report next to the checkpoint
(``epoch_0003.eval.json``, atomically); ``per_class`` adds per-class accuracy
with the synset names of ``misc/synsets.txt``; ``save_predictions`` writes the
top-5 class indices of every (non-padded) val image in val order
(``epoch_0003.top5.npy``, int32 (n_images, 5)).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from theanompi.errors import ConfigError, DataError

__all__ = [
    "run",
    "evaluate",
    "batch_metrics",
    "load_model_checkpoint",
    "report_path",
    "predictions_path",
    "format_table",
    "collective",
]

TOP_K = 5
_P_FLOOR = 1e-30  # probabilities are clipped here before the log (a 0 would give inf loss)


def collective(comm: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` on every rank; if it raises a ``UserError`` on any rank,
    rank 0 raises it (one line from the CLI) and the other ranks exit with the same code.

    For set-up steps that fail alike on all ranks (missing files, a wrong checkpoint), so
    that the user sees one error line instead of one per rank.
    """
    from theanompi.errors import UserError

    try:
        out, err = fn(*args, **kwargs), None
    except UserError as e:
        out, err = None, e
    info = None if err is None else (type(err).__name__, str(err), err.exit_code)
    infos = comm.allgather(info)
    failed = [i for i in infos if i is not None]
    if not failed:
        return out
    if comm.Get_rank() == 0:
        if err is not None:
            raise err
        name, msg, _ = failed[0]
        raise (DataError if name == "DataError" else ConfigError)(msg)
    raise SystemExit(failed[0][2])


def report_path(checkpoint: str | Path) -> Path:
    """``epoch_0003.npz`` -> ``epoch_0003.eval.json`` beside it."""
    p = Path(checkpoint)
    return p.with_name(f"{p.stem}.eval.json")


def predictions_path(checkpoint: str | Path) -> Path:
    """``epoch_0003.npz`` -> ``epoch_0003.top5.npy`` beside it."""
    p = Path(checkpoint)
    return p.with_name(f"{p.stem}.top{TOP_K}.npy")


def batch_metrics(probs: np.ndarray, y: np.ndarray, k: int = TOP_K) -> dict[str, Any]:
    """Metrics of one sub-batch; slots with ``y < 0`` (padding) are left out.

    Parameters
    ----------
    probs
        (b, K) class probabilities (or any scores whose order is the prediction).
    y
        (b,) int labels, ``-1`` for padding.
    k
        Top-k size (clipped to K).

    Returns
    -------
    dict
        ``n`` (valid images), ``top1``/``topk`` (hit counts), ``loss`` (float64 sum of
        ``-log p[y]``), ``labels``, ``hit1`` (bool per valid image), ``topk_idx``
        ((n, k) int32, best first; ties broken by the lower class index).

    >>> import numpy as np
    >>> m = batch_metrics(np.array([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]]), np.array([1, -1]), k=2)
    >>> m["n"], m["top1"], m["topk"], m["topk_idx"].tolist()
    (1, 0, 1, [[0, 1]])
    """
    probs = np.asarray(probs)
    y = np.asarray(y)
    valid = y >= 0
    p, yv = probs[valid], y[valid].astype(np.int64)
    k = min(k, p.shape[1]) if p.ndim == 2 else k
    order = np.argsort(-p, axis=1, kind="stable")[:, :k].astype(np.int32)
    hit1 = order[:, 0] == yv if len(yv) else np.zeros(0, dtype=bool)
    hitk = (order == yv[:, None]).any(axis=1) if len(yv) else np.zeros(0, dtype=bool)
    pt = np.maximum(p[np.arange(len(yv)), yv].astype(np.float64), _P_FLOOR)
    return {
        "n": int(len(yv)),
        "top1": int(hit1.sum()),
        "topk": int(hitk.sum()),
        "loss": float(np.sum(-np.log(pt))),
        "labels": yv,
        "hit1": hit1,
        "topk_idx": order,
    }


def evaluate(
    model: Any,
    batches: Iterable[tuple[int, np.ndarray, np.ndarray]],
    comm: Any = None,
    n_classes: int | None = None,
    keep_predictions: bool = False,
) -> dict[str, Any] | None:
    """Evaluate ``model.predict`` on this rank's sub-batches and reduce over ``comm``.

    Parameters
    ----------
    model
        Anything with ``predict(x) -> (b, K) probabilities`` and ``n_classes``.
    batches
        This rank's ``(k, x, y)``: ``k`` the global sub-batch index (fixes the
        summation order), ``x`` float32 (b, C, H, W), ``y`` int32 (b,), ``-1`` = padding.
    comm
        Communicator over which the work is split (default ``MPI.COMM_WORLD``).
    n_classes
        Class count for the per-class table (default ``model.n_classes``).
    keep_predictions
        Gather the top-5 indices of every image to rank 0 (in sub-batch order).

    Returns
    -------
    dict or None
        On rank 0: ``images``, ``top1_error``, ``top5_error``, ``loss``, ``seconds``,
        ``images_per_s``, ``class_images`` / ``class_top1`` (int arrays) and, when asked,
        ``predictions`` ((n, 5) int32). ``None`` on the other ranks.
    """
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    K = int(n_classes if n_classes is not None else model.n_classes)
    counts = np.zeros(3, dtype=np.int64)  # images, top-1 hits, top-5 hits
    class_n = np.zeros(K, dtype=np.int64)
    class_hit = np.zeros(K, dtype=np.int64)
    losses: list[tuple[int, float]] = []
    preds: list[tuple[int, np.ndarray]] = []
    comm.Barrier()
    t0 = MPI.Wtime()
    for k, x, y in batches:
        m = batch_metrics(model.predict(x), y)
        counts += (m["n"], m["top1"], m["topk"])
        np.add.at(class_n, m["labels"], 1)
        np.add.at(class_hit, m["labels"][m["hit1"]], 1)
        losses.append((int(k), m["loss"]))
        if keep_predictions:
            preds.append((int(k), m["topk_idx"]))
    seconds = comm.allreduce(MPI.Wtime() - t0, op=MPI.MAX)
    tot = np.zeros_like(counts)
    comm.Reduce(counts, tot, op=MPI.SUM, root=0)
    cls = np.zeros((2, K), dtype=np.int64)
    comm.Reduce(np.stack([class_n, class_hit]), cls, op=MPI.SUM, root=0)
    all_losses = comm.gather(losses, root=0)
    all_preds = comm.gather(preds, root=0) if keep_predictions else None
    if comm.Get_rank() != 0:
        return None
    ordered = sorted((kl for part in all_losses for kl in part), key=lambda t: t[0])
    loss_sum = 0.0
    for _, s in ordered:  # fixed order: the same float64 sum for any N
        loss_sum += s
    n, h1, h5 = (int(v) for v in tot)
    out: dict[str, Any] = {
        "images": n,
        "top1_error": 1.0 - h1 / n if n else float("nan"),
        "top5_error": 1.0 - h5 / n if n else float("nan"),
        "loss": loss_sum / n if n else float("nan"),
        "seconds": seconds,
        "images_per_s": n / seconds if seconds > 0 else float("nan"),
        "class_images": cls[0],
        "class_top1": cls[1],
    }
    if keep_predictions:
        parts = sorted((kp for part in all_preds for kp in part), key=lambda t: t[0])
        k_out = min(TOP_K, K)
        out["predictions"] = (
            np.concatenate([p for _, p in parts]) if parts else np.zeros((0, k_out), np.int32)
        )
    return out


def load_model_checkpoint(model: Any, checkpoint: str | Path, model_name: str | None = None) -> Any:
    """Load ``checkpoint`` into ``model.params`` (optimizer state is not needed to evaluate).

    A checkpoint of another model raises a one-line ``ConfigError`` naming the parameter
    (and, when the checkpoint's meta names another model than ``model_name``, that model).
    """
    from theanompi.checkpoint import apply_checkpoint, load_checkpoint

    ckpt = load_checkpoint(checkpoint)
    try:
        apply_checkpoint(model, ckpt, opt_state=False)
    except ConfigError as err:
        trained = ((ckpt.meta.get("config") or {}).get("model") or {}).get("name")
        other = trained and model_name and trained != model_name
        hint = f" (it was trained with model {trained!r}, not {model_name!r})" if other else ""
        raise ConfigError(f"{err}{hint}") from None
    return ckpt


def _resolve_checkpoint(cfg: Any, checkpoint: str | Path | None) -> Path:
    from theanompi.checkpoint import latest_checkpoint

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
    from prep.io import read_manifest

    root = Path(cfg.data.dir)
    if not (root / "misc" / "manifest.json").exists():
        raise DataError(
            f"no prep output in {str(root)!r} (misc/manifest.json missing); run `make data` "
            "or `tmpi prep all --src IMAGES --out DIR`, or pass --data DIR"
        )
    man = read_manifest(root)
    info = man.get("val") or {}
    folder = root / str(info.get("dir", f"val_hkl_b{man.get('batch_size', '?')}"))
    if not info or not folder.is_dir():
        raise DataError(
            f"val folder {str(folder)!r} not found; rerun `tmpi prep batch --out {root}`"
        )


def _synsets(cfg: Any, K: int) -> list[tuple[str, str]]:
    from prep.io import load_synsets

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
    from theanompi.data import ValLoader
    from theanompi.io import write_json, write_npy

    comm = MPI.COMM_WORLD if comm is None else comm
    rank, size = comm.Get_rank(), comm.Get_size()

    def setup(model: Any) -> tuple[Path, Any, Any, Any]:
        ckpt_path = _resolve_checkpoint(cfg, checkpoint)
        _check_val_folder(cfg)
        loader = ValLoader(cfg, rank, size)
        if model is None:
            from theanompi.models import create_model

            model = create_model(cfg.model)
        ckpt = load_model_checkpoint(model, ckpt_path, str(cfg.model.name))  # before compiling
        model.build(loader.batch_size)
        return ckpt_path, loader, model, ckpt

    ckpt_path, loader, model, ckpt = collective(comm, setup, model)

    def my_batches() -> Iterable[tuple[int, np.ndarray, np.ndarray]]:
        with loader.batches() as it:
            for i, (x, y) in enumerate(it):
                yield rank + i * size, x, y  # global index in ValLoader's sub-batch order

    K = int(model.n_classes)
    res = evaluate(model, my_batches(), comm, n_classes=K, keep_predictions=save_predictions)
    report: dict[str, Any] | None = None
    if rank == 0:
        assert res is not None
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
            names = _synsets(cfg, K)
            report["per_class"] = [
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
        if save_predictions:
            pp = predictions_path(ckpt_path)
            write_npy(pp, res["predictions"].astype(np.int32))
            report["predictions"] = str(pp)
        rp = report_path(ckpt_path)
        report["report"] = str(rp)
        write_json(rp, report)
        if not quiet:
            log(format_table(report))
            log(f"wrote {rp}" + (f" and {report['predictions']}" if save_predictions else ""))
    return comm.bcast(report, root=0)
