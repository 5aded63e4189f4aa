"""End to end through the CLI: ``tmpi prep demo`` + ``tmpi prep all`` + ``tmpi train -n 2`` (small CNN),
``--resume`` (bit-exact against a straight run) and ``tmpi plot``. Failures and Ctrl-C are
tested under real mpirun in tests/rules/test_bsp.py (same abort hook, cheaper model)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from theanompi.io.checkpoint import latest_checkpoint, load_checkpoint
from theanompi.io.record import read_record

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


@pytest.fixture
def demo(digits_data: Path) -> Path:
    return digits_data


def _train(cli, data: Path, run: Path, *extra: str, env: dict[str, str] | None = None):
    return cli(
        "train",
        "-n",
        "2",
        "--data",
        str(data),
        "--run-dir",
        str(run),
        "--max-steps",
        "4",
        "--set",
        "training.print_freq=3",
        *extra,
        timeout=600,
        env=env,
    )


def test_train_resume_plot(cli, demo: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = _train(cli, demo, run, "--epochs", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[bsp] 2 rank(s), model small_cnn" in out.stdout
    assert "img/s" in out.stdout and "exchange" in out.stdout and "wait" in out.stdout
    assert "epoch 1/1 done" in out.stdout and "val loss" in out.stdout
    ck = load_checkpoint(latest_checkpoint(run / "checkpoints"))
    assert ck.epoch == 1 and ck.step == 4 and ck.meta["param_names"][0] == "conv1.W"
    assert len(ck.meta["rng"]) == 1  # the dropout generator travels with the checkpoint

    out = _train(cli, demo, run, "--epochs", "2", "--resume")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from" in out.stdout and "epoch 2/2 done" in out.stdout
    epochs = [r for r in read_record(run) if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [0, 1]

    out = cli("plot", str(run))
    assert out.returncode == 0, out.stderr
    assert (run / "record" / "curves.png").exists()

    # 2 epochs straight == 1 epoch + resume + 1 epoch, bit for bit (momentum, dropout RNG too)
    straight = tmp_path / "straight"
    out = _train(cli, demo, straight, "--epochs", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    a = load_checkpoint(straight / "checkpoints" / "epoch_0002.npz")
    b = load_checkpoint(run / "checkpoints" / "epoch_0002.npz")
    for x, y in zip(a.params + a.opt_state, b.params + b.opt_state, strict=True):
        np.testing.assert_array_equal(x, y)
    assert a.meta["rng"] == b.meta["rng"]


def test_timeline_lr_warmup_and_fp16_on_the_wire(cli, demo: Path, tmp_path: Path) -> None:
    import json

    run, trace = tmp_path / "run", tmp_path / "trace" / "timeline.json"
    out = _train(
        cli,
        demo,
        run,
        "--epochs",
        "1",
        "--strategy",
        "copper",
        "--compression",
        "fp16",
        "--timeline",
        str(trace),
        "--lr-scaling",
        "linear",
        "--warmup-epochs",
        "1",
        "--set",
        "training.lr_reference_batch=32",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "exchange copper+fp16/avg" in out.stdout and "lr x 2" in out.stdout
    rec = read_record(run)
    start = next(r for r in rec if r["kind"] == "start")
    assert start["lr_scale"] == 2 and start["warmup_steps"] == 4
    # global batch 64 = 2 x the reference: lr 0.02 x 2, reached over 4 steps from 0.02
    steps = [r for r in rec if r["kind"] == "step"]
    assert [r["lr"] for r in steps] == pytest.approx([0.035, 0.04])
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    for pid in (0, 1):
        names = {e["name"] for e in spans if e["pid"] == pid}
        assert {"compute", "exchange", "wait", "validate"} <= names, names
    assert any(e["name"] == "checkpoint" for e in spans)


def test_overlap_trains_the_same_parameters_and_shows_the_hidden_exchange(
    cli, demo: Path, tmp_path: Path
) -> None:
    import json

    runs = {}
    for overlap in ("never", "always"):
        run, trace = tmp_path / overlap, tmp_path / f"{overlap}.json"
        out = _train(
            cli,
            demo,
            run,
            "--epochs",
            "1",
            "--sync-type",
            "cdd",
            "--timeline",
            str(trace),
            "--set",
            f"weight_exchange.overlap={overlap}",
            "--set",
            "weight_exchange.bucket_mb=0.2",
        )
        assert out.returncode == 0, out.stderr[-3000:]
        runs[overlap] = load_checkpoint(latest_checkpoint(run / "checkpoints"))
        events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
        buckets = {e["args"]["bucket"] for e in events if e["name"] == "bucket exchange"}
        if overlap == "always":  # 2 ranks on one node: overlap only when asked for
            assert "hidden" in out.stdout
            assert buckets == {0, 1}  # fc2 + fc1 (1.6 MB), then the convs (77 KB)
        else:
            assert "hidden" not in out.stdout and not buckets
    # 2 ranks: a + b = b + a, so the overlapped buckets give the serial run's bits
    a, b = runs["never"], runs["always"]
    for x, y in zip(a.params + a.opt_state, b.params + b.opt_state, strict=True):
        np.testing.assert_array_equal(x, y)
