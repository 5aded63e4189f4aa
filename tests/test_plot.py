"""``plot_run`` / ``tmpi plot``: a PNG from a record; one-line errors without one."""

from __future__ import annotations

from pathlib import Path

import pytest

from theanompi.errors import DataError
from theanompi.plot import curves, plot_run
from theanompi.record import RecordWriter


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
    from theanompi.record import read_record

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
