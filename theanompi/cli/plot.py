"""``tmpi plot``: PNG curves of a run's record (loss, error, images/s, step time split, lr)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from theanompi.errors import DataError, UserError

__all__ = ["app", "plot", "plot_run", "curves"]

app = typer.Typer()


@app.command()
def plot(
    run_dir: Annotated[Path, typer.Argument(help="Run folder (holds record/).")],
    out: Annotated[
        Path | None, typer.Option("--out", help="PNG path [default: <run_dir>/record/curves.png].")
    ] = None,
) -> None:
    """Plot train/val loss and error curves of a run's record as a PNG."""
    path = plot_run(run_dir, out)
    typer.echo(f"wrote {path}")


_TIMES = ("compute", "exchange", "wait", "wall")  # record fields t_<name>, s per step


def curves(rows: list[dict[str, Any]]) -> dict[str, tuple[list[float], list[float]]]:
    """``name -> (x, y)`` series from record entries; x is the epoch (fractional for steps).

    Names from step windows: ``train_loss``, ``train_error``, ``images_per_s``, ``lr`` and
    ``compute_ms``, ``exchange_ms``, ``wait_ms``, ``wall_ms`` (mean ms per step in the window).
    From epoch entries (x = epochs done): ``epoch_train_loss``, ``epoch_train_error``,
    ``val_loss``, ``val_top1_err``, ``val_top5_err``, ``epoch_images_per_s``, ``epoch_lr``
    and ``epoch_compute_ms`` ... ``epoch_wall_ms``. A field missing from an entry (older
    records, EASGD's epoch-only entries) or not a number leaves its point out; a series
    with no points is absent.

    >>> c = curves([{"kind": "step", "epoch": 0, "step_in_epoch": 5, "steps_per_epoch": 10,
    ...              "images_per_s": 900.0, "t_compute": 0.03, "t_exchange": None}])
    >>> c["images_per_s"], c["compute_ms"], "exchange_ms" in c
    (([0.5], [900.0]), ([0.5], [30.0]), False)
    """
    spe = next((r.get("steps_per_epoch") for r in reversed(rows) if r.get("kind") == "start"), None)
    out: dict[str, tuple[list[float], list[float]]] = {}

    def add(name: str, x: float, y: Any, scale: float = 1.0) -> None:
        if y is None or isinstance(y, bool):
            return
        try:
            y = float(y) * scale
        except (TypeError, ValueError):
            return
        xs, ys = out.setdefault(name, ([], []))
        xs.append(float(x))
        ys.append(y)

    for r in rows:
        kind = r.get("kind")
        if not isinstance(r.get("epoch"), (int, float)):
            continue
        if kind == "step":
            n = r.get("steps_per_epoch") or spe
            frac = (r.get("step_in_epoch", 0) / n) if n else 1.0
            x = r["epoch"] + frac
            add("train_loss", x, r.get("loss"))
            add("train_error", x, r.get("error"))
            prefix = ""
        elif kind == "epoch":
            x = r["epoch"] + 1
            add("epoch_train_loss", x, r.get("train_loss"))
            add("epoch_train_error", x, r.get("train_error"))
            add("val_loss", x, r.get("val_loss"))
            add("val_top1_err", x, r.get("val_top1_err"))
            add("val_top5_err", x, r.get("val_top5_err"))
            prefix = "epoch_"
        else:
            continue
        add(f"{prefix}images_per_s", x, r.get("images_per_s"))
        add(f"{prefix}lr", x, r.get("lr"))
        for t in _TIMES:
            add(f"{prefix}{t}_ms", x, r.get(f"t_{t}"), 1e3)
    return out


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw loss, error, images/s, ms per step (compute / exchange / wait) and lr
    against epochs; return the PNG path.

    Panels whose fields the record lacks (older runs; EASGD records epochs only)
    say so instead of failing.

    ``run_dir`` is a run folder (holding ``record/record.jsonl``), a record folder or
    the ``.jsonl`` file itself. ``out`` defaults to ``curves.png`` beside the record.
    Raises ``DataError`` when there is no record or nothing to plot.
    """
    from theanompi.io.record import read_record, record_file

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
    fig = plt.figure(figsize=(14, 8.5))
    grid = fig.add_gridspec(2, 6)
    ax_l, ax_e = fig.add_subplot(grid[0, :3]), fig.add_subplot(grid[0, 3:])
    ax_i, ax_t, ax_r = (fig.add_subplot(grid[1, 2 * k : 2 * k + 2]) for k in range(3))
    panels = (
        (ax_l, ("train_loss", "epoch_train_loss", "val_loss"), "loss (cross-entropy)", "loss"),
        (
            ax_e,
            ("train_error", "epoch_train_error", "val_top1_err", "val_top5_err"),
            "error",
            "error",
        ),
        (ax_i, ("images_per_s", "epoch_images_per_s"), "images/s (whole job)", "images_per_s"),
        (ax_t, (), "ms per step", "t_compute / t_exchange / t_wait"),
        (ax_r, ("lr", "epoch_lr"), "learning rate", "lr"),
    )
    for ax, names, _, _ in panels:
        for name in names:
            if name in series:
                label, kw = _STYLE[name]
                ax.plot(*series[name], label=label, **kw)
    _draw_times(ax_t, series)
    ax_e.set_ylim(bottom=0)
    _from_zero(
        ax_i,
        [y for n in ("images_per_s", "epoch_images_per_s") for y in series.get(n, ((), ()))[1]],
    )
    lrs = [y for n in ("lr", "epoch_lr") for y in series.get(n, ((), ()))[1]]
    if lrs and min(lrs) > 0 and max(lrs) > 10 * min(lrs):
        ax_r.set_yscale("log")
    for ax, _, ylabel, needs in panels:
        _label(ax, ylabel, needs)
    fig.suptitle(_title(run_dir, rows))
    fig.tight_layout()
    from theanompi.io.atomic import atomic_write

    with atomic_write(out_path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    return out_path


def _label(ax: Any, ylabel: str, needs: str) -> None:
    """Axis labels and grid; a legend, or for an empty panel the record fields it lacks."""
    ax.set_xlabel("epoch")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.lines or ax.collections:
        ax.legend(fontsize=8)
        return
    ax.text(
        0.5,
        0.5,
        f"no {needs} in this record",
        ha="center",
        va="center",
        color="0.4",
        transform=ax.transAxes,
    )
    ax.set_xticks([])
    ax.set_yticks([])


def _title(run_dir: str | Path, rows: list[dict[str, Any]]) -> str:
    """The run's name, with the last epoch's val top-1 accuracy when the record has one."""
    title = Path(run_dir).name or str(run_dir)
    last = next((r for r in reversed(rows) if r.get("kind") == "epoch"), None)
    if last and last.get("val_top1_err") is not None:
        title += f" - val top-1 accuracy {100 * (1 - last['val_top1_err']):.1f}% after {last['epoch'] + 1} epoch(s)"
    return title


_STEPS = dict(alpha=0.4, lw=1, color="tab:blue")
_STYLE: dict[str, tuple[str, dict[str, Any]]] = {  # fixed colours: the same in every run's PNG
    "train_loss": ("train (steps)", _STEPS),
    "epoch_train_loss": ("train (epoch)", dict(marker="o", color="tab:orange")),
    "val_loss": ("val", dict(marker="s", color="tab:green")),
    "train_error": ("train top-1 (steps)", _STEPS),
    "epoch_train_error": ("train top-1 (epoch)", dict(marker="o", color="tab:orange")),
    "val_top1_err": ("val top-1", dict(marker="s", color="tab:green")),
    "val_top5_err": ("val top-5", dict(marker="^", ls="--", color="tab:red")),
    "images_per_s": ("steps", dict(_STEPS, alpha=0.6)),
    "epoch_images_per_s": ("epoch", dict(marker="o", color="tab:orange")),
    "lr": ("steps", dict(_STEPS, alpha=0.8, drawstyle="steps-pre")),
    "epoch_lr": ("epoch", dict(marker="o", ls="none", color="tab:orange")),
}
_PARTS = (("compute", "tab:blue"), ("exchange", "tab:orange"), ("wait", "tab:red"))


def _draw_times(ax: Any, series: dict[str, tuple[list[float], list[float]]]) -> None:
    """Compute / exchange / wait stacked (ms per step), step wall time as a dashed line.

    Step windows when the record has them, else epoch means. Parts whose points do not
    line up (a field missing from some entries) are drawn as plain lines instead.
    """
    prefix = "" if any(f"{p}_ms" in series for p, _ in _PARTS) else "epoch_"
    what = "per print window" if prefix == "" else "epoch means"
    parts = [(p, c, series[f"{prefix}{p}_ms"]) for p, c in _PARTS if f"{prefix}{p}_ms" in series]
    wall = series.get(f"{prefix}wall_ms")
    tops = list(wall[1]) if wall else []
    if parts and all(xy[0] == parts[0][2][0] for _, _, xy in parts):
        tops += [sum(ys) for ys in zip(*(xy[1] for _, _, xy in parts), strict=True)]
        ax.stackplot(
            parts[0][2][0],
            *(xy[1] for _, _, xy in parts),
            labels=[p for p, _, _ in parts],
            colors=[c for _, c, _ in parts],
            alpha=0.7,
        )
    else:
        for p, c, xy in parts:
            tops += xy[1]
            ax.plot(*xy, label=p, color=c)
    if wall:
        ax.plot(*wall, color="black", ls="--", lw=1, label="step wall")
    if parts or wall:
        ax.set_title(f"time per step, {what}", fontsize=9)
        _from_zero(ax, tops)


def _from_zero(ax: Any, ys: list[float]) -> None:
    """y axis from 0 to 10% above the highest point (rates and times read best from 0)."""
    top = max((y for y in ys if y == y), default=0.0)  # y == y: not NaN
    if top > 0:
        ax.set_ylim(0, 1.1 * top)
