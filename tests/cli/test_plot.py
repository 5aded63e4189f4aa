"""``plot_run`` / ``tmpi plot``: a PNG from a record; one-line errors without one."""

from __future__ import annotations

from pathlib import Path

import pytest

from theanompi.cli.plot import curves, plot_run
from theanompi.errors import DataError
from theanompi.io.record import RecordWriter


def _record(run: Path) -> None:
    with RecordWriter(run / "record") as rec:
        rec.write("start", steps_per_epoch=4)
        for e in range(3):
            for k in (2, 4):
                rec.write("step", epoch=e, step_in_epoch=k, loss=2.0 / (e + 1), error=0.5 / (e + 1))
            rec.write(
                "epoch",
                epoch=e,
                train_loss=1.0 / (e + 1),
                train_error=0.3 / (e + 1),
                val_loss=1.1 / (e + 1),
                val_top1_err=0.2 / (e + 1),
                val_top5_err=0.0,
            )


def test_curves_place_steps_between_epochs(tmp_path: Path) -> None:
    _record(tmp_path)
    from theanompi.io.record import read_record

    c = curves(read_record(tmp_path))
    assert c["train_loss"][0] == [0.5, 1.0, 1.5, 2.0, 2.5, 3.0]
    assert c["val_top1_err"][0] == [1.0, 2.0, 3.0]


def test_plot_writes_a_png(tmp_path: Path) -> None:
    _record(tmp_path)
    out = plot_run(tmp_path)
    assert out == tmp_path / "record" / "curves.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    other = plot_run(tmp_path / "record" / "record.jsonl", tmp_path / "x" / "c.png")
    assert other.exists()


def test_plot_without_record_is_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no training record"):
        plot_run(tmp_path)


def test_tmpi_plot_cli(cli, tmp_path: Path) -> None:
    _record(tmp_path)
    out = cli("plot", str(tmp_path), "--out", str(tmp_path / "p.png"))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "p.png").exists() and "wrote" in out.stdout
    bad = cli("plot", str(tmp_path / "none"))
    assert bad.returncode == 3 and bad.stderr.startswith("tmpi: error: no training record")


def _timed_record(run: Path, *, steps: bool = True, times: bool = True) -> None:
    """Steps with images/s, lr and compute/exchange/wait/wall seconds; EASGD-like without."""
    with RecordWriter(run / "record") as rec:
        rec.write("start", steps_per_epoch=4)
        for e in range(2):
            lr = 0.1 if e == 0 else 0.01
            t = dict(t_compute=0.030, t_exchange=0.004, t_wait=0.001, t_wall=0.036) if times else {}
            for k in (2, 4) if steps else ():
                rec.write(
                    "step",
                    epoch=e,
                    step_in_epoch=k,
                    loss=1.0,
                    error=0.5,
                    images_per_s=1000.0 + k,
                    lr=lr,
                    **t,
                )
            rec.write(
                "epoch",
                epoch=e,
                train_loss=1.0,
                val_top1_err=0.2,
                images_per_s=900.0 + e,
                lr=lr,
                **t,
            )


def test_curves_speed_time_split_and_lr(tmp_path: Path) -> None:
    _timed_record(tmp_path)
    from theanompi.io.record import read_record

    c = curves(read_record(tmp_path))
    assert c["images_per_s"] == ([0.5, 1.0, 1.5, 2.0], [1002.0, 1004.0, 1002.0, 1004.0])
    assert c["epoch_images_per_s"] == ([1.0, 2.0], [900.0, 901.0])
    assert c["lr"][1] == [0.1, 0.1, 0.01, 0.01] and c["epoch_lr"] == ([1.0, 2.0], [0.1, 0.01])
    for prefix in ("", "epoch_"):
        ms = {p: c[f"{prefix}{p}_ms"][1][0] for p in ("compute", "exchange", "wait", "wall")}
        assert ms == pytest.approx({"compute": 30.0, "exchange": 4.0, "wait": 1.0, "wall": 36.0})
    assert c["compute_ms"][0] == c["train_loss"][0]


def test_curves_leave_out_missing_and_non_numeric_fields(tmp_path: Path) -> None:
    _record(tmp_path)  # an older record: loss and error only
    from theanompi.io.record import read_record

    old = curves(read_record(tmp_path))
    assert not {"images_per_s", "lr", "compute_ms", "epoch_images_per_s", "epoch_lr"} & set(old)
    rows = [
        {
            "kind": "step",
            "epoch": 0,
            "step_in_epoch": 1,
            "steps_per_epoch": 2,
            "t_compute": 0.01,
            "t_exchange": None,
            "lr": "n/a",
            "images_per_s": True,
        },
        {"kind": "step", "epoch": 0, "step_in_epoch": 2, "steps_per_epoch": 2, "t_exchange": 0.002},
        {"kind": "step", "step_in_epoch": 2, "t_compute": 1.0},  # no epoch: skipped
        {"kind": "end", "epoch": 3, "images_per_s": 5.0},
    ]
    c = curves(rows)
    assert c == {"compute_ms": ([0.5], [10.0]), "exchange_ms": ([1.0], [2.0])}


@pytest.mark.parametrize(
    "kind", ["epochs only, no times (EASGD)", "steps without times", "times misaligned"]
)
def test_plot_records_missing_fields(tmp_path: Path, kind: str) -> None:
    if kind == "times misaligned":
        with RecordWriter(tmp_path / "record") as rec:
            rec.write("step", epoch=0, step_in_epoch=1, steps_per_epoch=2, t_compute=0.01)
            rec.write(
                "step",
                epoch=0,
                step_in_epoch=2,
                steps_per_epoch=2,
                t_compute=0.01,
                t_exchange=0.003,
                t_wall=0.02,
            )
    else:
        _timed_record(tmp_path, steps=kind.startswith("steps"), times=False)
    out = plot_run(tmp_path, tmp_path / "c.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_timed_record(tmp_path: Path) -> None:
    _timed_record(tmp_path)
    out = plot_run(tmp_path)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 30_000
