"""``tmpi bench train`` pieces that need no mpirun: the table and the data check."""

from __future__ import annotations

from pathlib import Path

from theanompi.bench.train import _table, main


def _row(n: int, ips: float, independent: bool = False) -> dict:
    return {
        "n": n,
        "independent": independent,
        "batch_size": 32,
        "images_per_s": ips,
        "step_s": 0.07,
        "compute_s": 0.069,
        "exchange_s": 0.001,
        "wait_s": 0.0001,
    }


def test_table_shows_speed_up_and_ceiling() -> None:
    text = _table([_row(1, 450.0), _row(2, 810.0), _row(2, 900.0, True)])
    lines = text.splitlines()
    assert "BSP N=1 (32/rank)" in lines[2] and "1.00x" in lines[2]
    assert "BSP N=2 (32/rank)" in lines[3] and "1.80x" in lines[3]
    assert "2 x 1 rank, side by side" in lines[4] and "2.00x" in lines[4]


def test_missing_data_is_one_line(tmp_path: Path, capsys) -> None:
    assert main(["--data", str(tmp_path / "none"), "--ranks", "1"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tmpi: error: --data") and "make data" in err[0]
