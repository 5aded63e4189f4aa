"""``tmpi plot``: PNG curves of a run's record (train/val loss and top-1 error per step and epoch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from theanompi.errors import DataError, UserError
from theanompi.record import read_record, record_file

__all__ = ["plot_run", "curves"]


def curves(rows: list[dict[str, Any]]) -> dict[str, tuple[list[float], list[float]]]:
    """``name -> (x, y)`` series from record entries; x is the epoch (fractional for steps).

    Names: ``train_loss``, ``train_error`` (step windows), ``epoch_train_loss``,
    ``epoch_train_error``, ``val_loss``, ``val_top1_err``, ``val_top5_err``.
    """
    spe = next((r.get("steps_per_epoch") for r in reversed(rows) if r.get("kind") == "start"), None)
    out: dict[str, tuple[list[float], list[float]]] = {}

    def add(name: str, x: float, y: Any) -> None:
        if y is None:
            return
        xs, ys = out.setdefault(name, ([], []))
        xs.append(float(x))
        ys.append(float(y))

    for r in rows:
        kind = r.get("kind")
        if kind == "step" and "epoch" in r:
            n = r.get("steps_per_epoch") or spe
            frac = (r.get("step_in_epoch", 0) / n) if n else 1.0
            x = r["epoch"] + frac
            add("train_loss", x, r.get("loss"))
            add("train_error", x, r.get("error"))
        elif kind == "epoch" and "epoch" in r:
            x = r["epoch"] + 1
            add("epoch_train_loss", x, r.get("train_loss"))
            add("epoch_train_error", x, r.get("train_error"))
            add("val_loss", x, r.get("val_loss"))
            add("val_top1_err", x, r.get("val_top1_err"))
            add("val_top5_err", x, r.get("val_top5_err"))
    return out


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw loss (left) and error (right) against epochs; return the PNG path.

    ``run_dir`` is a run folder (holding ``record/record.jsonl``), a record folder or
    the ``.jsonl`` file itself. ``out`` defaults to ``curves.png`` beside the record.
    Raises ``DataError`` when there is no record or nothing to plot.
    """
    f = record_file(run_dir)
    rows = read_record(f)
    if not rows:
        raise DataError(f"no training record at {f}; train first (tmpi train --run-dir {run_dir})")
    series = curves(rows)
    if not series:
        raise DataError(f"{f} has no step or epoch entries yet; plot again after a few steps")
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise UserError("tmpi plot needs matplotlib; pip install matplotlib") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_path = Path(out) if out is not None else f.parent / "curves.png"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax_l, ax_e) = plt.subplots(1, 2, figsize=(11, 4))
    style = {
        "train_loss": ("train (steps)", dict(alpha=0.4, lw=1)),
        "epoch_train_loss": ("train (epoch)", dict(marker="o")),
        "val_loss": ("val", dict(marker="s")),
        "train_error": ("train top-1 (steps)", dict(alpha=0.4, lw=1)),
        "epoch_train_error": ("train top-1 (epoch)", dict(marker="o")),
        "val_top1_err": ("val top-1", dict(marker="s")),
        "val_top5_err": ("val top-5", dict(marker="^", ls="--")),
    }
    for ax, names, ylabel in (
        (ax_l, ("train_loss", "epoch_train_loss", "val_loss"), "loss (cross-entropy)"),
        (ax_e, ("train_error", "epoch_train_error", "val_top1_err", "val_top5_err"), "error"),
    ):
        for name in names:
            if name in series:
                label, kw = style[name]
                xs, ys = series[name]
                ax.plot(xs, ys, label=label, **kw)
        ax.set_xlabel("epoch")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    ax_e.set_ylim(bottom=0)
    title = Path(run_dir).name or str(run_dir)
    last = next((r for r in reversed(rows) if r.get("kind") == "epoch"), None)
    if last and last.get("val_top1_err") is not None:
        title += f" - val top-1 accuracy {100 * (1 - last['val_top1_err']):.1f}% after {last['epoch'] + 1} epoch(s)"
    fig.suptitle(title)
    fig.tight_layout()
    from theanompi.io import atomic_write

    with atomic_write(out_path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    return out_path
