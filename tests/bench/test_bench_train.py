"""``tmpi bench train`` pieces that need no mpirun: the table and the data check."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from theanompi.bench.train import _sharding_lines, _state_mb_per_rank, _table, main


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


def test_sharded_rows_say_what_zero1_took_off() -> None:
    plain = _row(2, 23.0) | {"opt_state_mb_per_rank": 466.0, "step_s": 2.75}
    plain |= {"param_mb": 233.0, "peak_rss_mb": 2105.0, "peak_rss_mb_per_rank": [2105.0, 2105.0]}
    plain["peak_rss_x_params"] = 9.0
    sharded = plain | {"shard_optimizer": True, "opt_state_mb_per_rank": 233.0, "step_s": 2.15}
    sharded |= {"peak_rss_mb": 1677.0, "peak_rss_mb_per_rank": [1677.0, 1663.0]}
    lines = _table([plain, sharded]).splitlines()
    assert "ZeRO-1" not in lines[2] and "BSP N=2 (32/rank) ZeRO-1" in lines[3]
    assert " 466 " in lines[2] and " 233 " in lines[3]
    assert _sharding_lines([plain, sharded]) == [
        "N=2 ZeRO-1: peak RSS per rank 428 MB less than unsharded (optimizer state 466 -> "
        "233 MB per rank); step time 0.78x unsharded"
    ]


def test_optimizer_state_per_rank_is_its_chunk() -> None:
    import pytensor

    import theanompi as tm

    w = pytensor.shared(np.zeros((1000, 3), np.float32), name="w")  # 3000 floats: 12 KB
    b = pytensor.shared(np.zeros(3, np.float32), name="b")
    adam = tm.Adam([w, b], pytensor.shared(np.float32(0.1)))  # two slots, one scalar
    mb = 1024 * 1024
    assert _state_mb_per_rank(adam, 1) == pytest.approx((2 * 3003 * 4 + 4) / mb)
    assert _state_mb_per_rank(adam, 4) == pytest.approx((2 * 751 * 4 + 4) / mb)  # 3003 / 4 up
