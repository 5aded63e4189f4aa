"""``tmpi bench layers``: a real two-step profile of the small CNN, ours and PyTorch's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from theanompi.bench.layers import CONV_SPLIT, KINDS, main


def test_small_cnn_table_covers_every_op(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("torch", reason="torch (the bench extra) profiles the PyTorch column")
    out = tmp_path / "layers.json"
    argv = ["--case", "small_cnn:8", "--steps", "2", "--markdown", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    rows = {
        line.split("|")[1].strip().strip("*"): line for line in text.splitlines() if "|" in line
    }
    for kind in (*KINDS, "ops total", "framework overhead", "step total"):
        assert kind in rows, f"no {kind!r} row in:\n{text}"
    assert "PyTorch side failed" not in text

    (res,) = json.loads(out.read_text())
    ours, torch = res["ours"], res["torch"]
    assert set(ours["kinds"]) == (set(KINDS) - {"conv backward"}) | set(CONV_SPLIT)
    # every Apply of the compiled step lands in exactly one kind
    assert sum(ours["kinds"].values()) == pytest.approx(ours["thunks_ms"], rel=0.01)
    assert ours["thunks_ms"] > 0 and ours["step_ms"] >= ours["thunks_ms"]
    assert all(ours["kinds"][k] > 0 for k in ("conv forward", *CONV_SPLIT, "dense forward"))
    assert torch is not None and torch["ops_ms"] > 0 and torch["step_ms"] >= torch["ops_ms"]
    assert sum(torch["kinds"].values()) == pytest.approx(torch["ops_ms"], rel=1e-6)
    assert torch["kinds"]["conv forward"] > 0 and torch["kinds"]["conv backward"] > 0


@pytest.mark.parametrize("spec", ["nope:8", "small_cnn:x"])
def test_a_bad_case_is_one_line_and_exit_2(spec: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["--case", spec]) == 2
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"tmpi bench layers: bad --case {spec!r}; use MODEL:BATCH"), out
    assert "\n" not in out
