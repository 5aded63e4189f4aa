"""GOSGD under real mpirun: the gossip mixing against a float64 replay, and training through the
Trainer (record, checkpoint of the weighted mean, resume)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _train_data import write_dataset  # noqa: E402

from theanompi.errors import ConfigError  # noqa: E402
from theanompi.io.checkpoint import list_checkpoints, load_checkpoint  # noqa: E402
from theanompi.io.record import read_record  # noqa: E402
from theanompi.rules.gosgd import GOSGD  # noqa: E402

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "mpi_easgd_train.py"  # trains any rule: sync_rule is set below
pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [2, 3, 4])
def test_gossip_mixing_matches_float64_replay(mpirun, n: int) -> None:
    out = mpirun(n, [HERE / "mpi_gosgd_mixing.py"], timeout=120)
    assert "OK" in out.stdout, out.stdout


def test_one_rank_is_a_clear_config_error() -> None:
    with pytest.raises(ConfigError, match="GOSGD needs at least 2 ranks.*-n 2"):
        GOSGD.check_world(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 6 files x 4 sub-batches of 4 = 24 sub-batches: 3 workers x 8 steps per epoch
    return write_dataset(tmp_path_factory.mktemp("gosgd") / "data", n_train=6, n_val=2, B=16, S=10)


def _train(mpirun, n: int, data: Path, run: Path, *args: str) -> dict:
    out = run.parent / f"{run.name}.json"
    mpirun(n, [TRAIN, data, run, out, "--fake", "weight_exchange.sync_rule=GOSGD", *args])
    return json.loads(out.read_text())


def test_three_workers_gossip_record_checkpoint_and_resume(
    mpirun, tiny: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    common = ["model.learning_rate=0.02", "model.lr_step=[]", "weight_exchange.gossip_p=0.7"]
    s = _train(mpirun, 3, tiny, run, *common, "model.n_epochs=3")
    assert s["epochs"] == 3 and not s["interrupted"] and s["steps"] == 3 * 3 * 8
    pushes = sum(s["pushes"].values())
    assert pushes > 0 and sum(s["received"].values()) == pushes  # nothing left in flight
    rec = read_record(run)
    start = next(r for r in rec if r["kind"] == "start")
    assert start["rule"] == "GOSGD" and start["gossip_p"] == 0.7 and start["n_workers"] == 3
    steps = [r for r in rec if r["kind"] == "step"]
    assert len(steps) == 3 * 4 and all(r["t_exchange"] is not None for r in steps)
    epochs = [r for r in rec if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [0, 1, 2]
    assert epochs[-1]["val_loss"] < epochs[0]["val_loss"]
    names = [p.name for p in list_checkpoints(run / "checkpoints")]
    assert names == ["epoch_0001.npz", "epoch_0002.npz", "epoch_0003.npz"]
    ck = load_checkpoint(run / "checkpoints" / "epoch_0003.npz")
    assert ck.meta["rule"] == "GOSGD" and ck.meta["val"]["val_loss"] == s["val_loss"]
    assert all(np.isfinite(a).all() for a in ck.params)

    s2 = _train(mpirun, 3, tiny, run, *common, "model.n_epochs=4", "--resume")
    assert s2["epochs"] == 4 and s2["steps"] == 3 * 8
    assert [r["epoch"] for r in read_record(run) if r["kind"] == "epoch"] == [0, 1, 2, 3]
