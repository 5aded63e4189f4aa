"""``tmpi bench layers``: a real two-step profile of the small CNN, ours and PyTorch's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from theanompi.bench.layers import CONV_SPLIT, KINDS, main, memory_at_peak


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
    mem = res["memory"]
    assert sum(mem["kinds"].values()) == pytest.approx(mem["peak_mb"], rel=1e-9)
    assert mem["kinds"]["conv forward"] > 0 and mem["state_mb"] > mem["params_mb"] > 0
    assert "MB alive at the train step's peak" in text
    # the machine beside the ratios: the BLAS kernel PyTensor's OpenBLAS picked for this CPU
    assert text.startswith("machine: ") and res["machine"]["blas_kernel"] in text.splitlines()[0]
    assert res["machine"]["blas"].startswith("openblas")


def test_memory_at_peak_of_two_chained_convs() -> None:
    """x -> conv -> conv -> sum: at the second conv both outputs are alive, nothing else."""
    import numpy as np
    import pytensor
    import pytensor.tensor as pt

    from theanompi.models.ops import compile_mode, conv2d

    x = pt.tensor4("x", shape=(4, 3, 10, 10))
    w1, w2 = pt.tensor4("w1", shape=(8, 3, 3, 3)), pt.tensor4("w2", shape=(16, 8, 3, 3))
    with pytensor.config.change_flags(allow_gc=False):
        fn = pytensor.function([x, w1, w2], conv2d(conv2d(x, w1), w2).sum(), mode=compile_mode("c"))
    values = [np.ones(v.type.shape, np.float32) for v in (x, w1, w2)]
    fn(*values)
    mem = memory_at_peak(fn)
    conv_bytes = 4 * (4 * 8 * 8 * 8 + 4 * 16 * 6 * 6)
    assert mem["peak_mb"] * 2**20 == pytest.approx(conv_bytes)
    assert mem["kinds"]["conv forward"] * 2**20 == pytest.approx(conv_bytes)
    assert mem["state_mb"] * 2**20 == pytest.approx(sum(v.nbytes for v in values))


@pytest.mark.parametrize("spec", ["nope:8", "small_cnn:x"])
def test_a_bad_case_is_one_line_and_exit_2(spec: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["--case", spec]) == 2
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"tmpi bench layers: bad --case {spec!r}; use MODEL:BATCH"), out
    assert "\n" not in out
