"""EASGD under real mpirun: the elastic update against float64 numpy, arrival-order serving
(a slow worker does not block a fast one), training that lowers the loss, checkpoints, record,
resume, and clear errors for unsupported set-ups."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _train_data import write_dataset  # noqa: E402

from theanompi.errors import ConfigError  # noqa: E402
from theanompi.io.checkpoint import list_checkpoints, load_checkpoint  # noqa: E402
from theanompi.io.record import read_record  # noqa: E402
from theanompi.models.params import ParamBuffer  # noqa: E402
from theanompi.rules.easgd import EASGD, elastic_delta  # noqa: E402

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "mpi_easgd_train.py"


def test_elastic_delta_is_the_same_bits_on_both_sides() -> None:
    rng = np.random.default_rng(0)
    w, c = rng.normal(size=(2, 1000)).astype(np.float32)
    d = elastic_delta(w, c, 0.3)
    w2, c2 = w - d, c + d
    np.testing.assert_allclose(w2, w - 0.3 * (w.astype(np.float64) - c), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(c2, c + 0.3 * (w.astype(np.float64) - c), rtol=1e-6, atol=1e-6)
    # the pair moves toward each other and keeps its sum
    np.testing.assert_allclose(w2 + c2, w + c, rtol=1e-6, atol=1e-6)


def test_param_buffer_round_trip() -> None:
    import pytensor

    vals = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array([7.0, 8.0], np.float32)]
    ps = [pytensor.shared(v.copy(), name=f"p{i}") for i, v in enumerate(vals)]
    buf = ParamBuffer(ps)
    np.testing.assert_array_equal(buf.gather(), [0, 1, 2, 3, 4, 5, 7, 8])
    buf.data *= 2
    buf.scatter()
    np.testing.assert_array_equal(ps[0].get_value(), vals[0] * 2)
    np.testing.assert_array_equal(ps[1].get_value(), vals[1] * 2)


@pytest.mark.mpi
@pytest.mark.parametrize("n", [3])
def test_elastic_exchanges_match_float64_replay(mpirun, n: int) -> None:
    out = mpirun(n, [HERE / "mpi_easgd_elastic.py"], timeout=60)
    assert "OK" in out.stdout, out.stdout


@pytest.mark.mpi
def test_slow_worker_does_not_block_fast_worker(mpirun) -> None:
    out = mpirun(3, [HERE / "mpi_easgd_slow.py"], timeout=60)
    ex = {int(k): int(v) for k, v in re.findall(r"(\d+): (\d+)", out.stdout)}
    # served in turn, the fast worker could do at most one more exchange than the slow one
    assert ex[2] >= 2 * ex[1] + 2, out.stdout


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 6 files x 4 sub-batches of 4 = 24 sub-batches: 2 workers x 12 steps per epoch
    return write_dataset(tmp_path_factory.mktemp("easgd") / "data", n_train=6, n_val=2, B=16, S=10)


def _train(mpirun, n: int, data: Path, run: Path, *args: str) -> dict:
    out = run.parent / f"{run.name}.json"
    mpirun(n, [TRAIN, data, run, out, "--fake", *args], timeout=120)
    return json.loads(out.read_text())


@pytest.mark.mpi
def test_two_workers_lower_the_loss_checkpoint_record_and_resume(
    mpirun, tiny: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    common = ["model.learning_rate=0.02", "model.lr_step=[]", "weight_exchange.avg_freq=2"]
    s = _train(mpirun, 3, tiny, run, *common, "model.n_epochs=3")
    assert s["n_workers"] == 2 and s["epochs"] == 3 and not s["interrupted"]
    assert s["steps"] == 2 * 3 * 12 and s["exchanges"] == {"1": 18, "2": 18}
    epochs = [r for r in read_record(run) if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [0, 1, 2]
    assert epochs[-1]["val_loss"] < epochs[0]["val_loss"]
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"]
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == [
        "epoch_0001.npz",
        "epoch_0002.npz",
        "epoch_0003.npz",
    ]
    ck = load_checkpoint(run / "checkpoints" / "epoch_0003.npz")
    assert ck.epoch == 3 and ck.meta["rule"] == "EASGD" and ck.meta["val"]["val_n"] == 27

    s2 = _train(mpirun, 3, tiny, run, *common, "model.n_epochs=5", "--resume")
    assert s2["epochs"] == 5 and s2["steps"] == 2 * 2 * 12  # epochs 4 and 5 only
    epochs = [r["epoch"] for r in read_record(run) if r["kind"] == "epoch"]
    assert epochs == [0, 1, 2, 3, 4]
    assert s2["val_loss"] < s["val_loss"] * 1.05


@pytest.mark.mpi
def test_three_workers_share_the_epoch(mpirun, tiny: Path, tmp_path: Path) -> None:
    # 24 sub-batches over 3 disjoint shards = 8 steps each; avg_freq=3 -> 2 exchanges each
    s = _train(mpirun, 4, tiny, tmp_path / "run", "model.n_epochs=1", "weight_exchange.avg_freq=3")
    assert s["n_workers"] == 3 and s["steps"] == 24
    assert s["exchanges"] == {"1": 2, "2": 2, "3": 2}


def test_sync_start_false_is_a_clear_config_error() -> None:
    with pytest.raises(ConfigError, match="sync_start=false .* not supported.*one mpirun"):
        EASGD(sync_start=False)


def test_one_rank_is_a_clear_config_error() -> None:
    with pytest.raises(ConfigError, match="server rank and at least one worker.*-n 2"):
        EASGD.check_world(1)


def test_cli_train_easgd_sync_start_false_one_line(cli) -> None:
    out = cli("train", "-n", "2", "--rule", "EASGD", "--set", "weight_exchange.sync_start=false")
    assert out.returncode == 2, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("tmpi: error")]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("tmpi: error: weight_exchange.sync_start=false")
    assert "not supported" in lines[0]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The prep demo dataset (sklearn digits, 32 x 32), built with the real prep CLI."""
    import subprocess

    root = tmp_path_factory.mktemp("easgd_demo")
    for args in (
        ["demo", "--out", str(root / "tree")],
        ["all", "--src", str(root / "tree"), "--out", str(root / "data"), "--size", "32"],
    ):
        out = subprocess.run(
            [sys.executable, "-m", "theanompi.cli", "prep", *args],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=HERE.parents[1],
        )
        assert out.returncode == 0, out.stderr[-2000:]
    return root / "data"


@pytest.mark.mpi
@pytest.mark.slow
def test_small_cnn_two_workers_on_the_demo_dataset(mpirun, demo: Path, tmp_path: Path) -> None:
    # the full target (6 epochs, >= 90%) is measured in docs/easgd.md; 2 epochs reach ~87-91%
    out = tmp_path / "s.json"
    args = [TRAIN, demo, tmp_path / "run", out, "model.n_epochs=2", "model.lr_step=[]"]
    mpirun(3, args, timeout=600)
    s = json.loads(out.read_text())
    assert s["epochs"] == 2 and s["n_workers"] == 2 and s["val_n"] == 256
    assert s["val_top1_err"] <= 0.25, s
