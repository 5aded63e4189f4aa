"""Batch-norm running statistics (``model.buffers``) under real mpirun: per rank while training,
their float64 mean over the workers at each epoch end under BSP, EASGD and GOSGD, used by
validation, saved in checkpoints, restored on every rank by a resume; and the checkpoint
format's buffers (old checkpoints without them, one-line mismatch errors)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _train_data import write_dataset  # noqa: E402

from theanompi.errors import ConfigError  # noqa: E402
from theanompi.io.checkpoint import (  # noqa: E402
    apply_checkpoint,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    save_arrays,
    save_checkpoint,
)

SCRIPT = str(Path(__file__).with_name("mpi_bn_stats.py"))
KINDS = ("first", "trained", "validated", "final")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 5 files x 4 sub-batches of 4: N=2 -> 10 steps per epoch, N=3 -> 6 (2 dropped)
    return write_dataset(tmp_path_factory.mktemp("bn") / "data", n_train=5, n_val=2, B=16, S=8)


def _run(mpirun, n: int, data: Path, run: Path, out: Path, *args: str, n_buf: int = 2) -> dict:
    mpirun(n, [SCRIPT, str(data), str(run), str(out), *args], timeout=300)
    with np.load(out) as z:
        summary = json.loads(str(z["summary"][()]))
        vals = {(r, k): [z[f"r{r}_{k}_{i}"] for i in range(n_buf)] for r in range(n) for k in KINDS}
    return {"summary": summary, **vals}


def _mean64(per_rank: list[list[np.ndarray]]) -> list[np.ndarray]:
    """The independent reference: float64 mean over ranks, cast back to float32."""
    return [
        np.mean([np.asarray(v[i], np.float64) for v in per_rank], axis=0).astype(np.float32)
        for i in range(len(per_rank[0]))
    ]


def _check_averaged(
    got: dict, workers: list[int], run: Path, names: tuple[str, ...] = ("bn.mean", "bn.var")
) -> None:
    trained = [got[(r, "trained")] for r in workers]
    # the ranks saw different batches: their own statistics differ before the average
    assert not np.allclose(trained[0][0], trained[1][0])
    want = _mean64(trained)
    for r in workers:
        for kind in ("final", "validated"):  # every worker ends on, and validated with, the mean
            for a, b in zip(got[(r, kind)], want, strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)
    ck = load_checkpoint(latest_checkpoint(run / "checkpoints"))
    assert ck.meta["buf_names"] == list(names)
    for a, b in zip(ck.buffers, got[(workers[0], "final")], strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_bsp_averages_buffers_over_ranks_at_epoch_end(mpirun, data, tmp_path, n) -> None:
    run = tmp_path / "run"
    got = _run(mpirun, n, data, run, tmp_path / "a.npz", "model.n_epochs=1")
    assert got["summary"]["epochs"] == 1
    _check_averaged(got, list(range(n)), run)


@pytest.mark.mpi
def test_bsp_averages_real_batchnorm_layers(mpirun, data, tmp_path) -> None:
    """The same with a compiled net of two BatchNorm layers (their running statistics are
    updated by the train function, not by numpy)."""
    run = tmp_path / "run"
    got = _run(mpirun, 2, data, run, tmp_path / "a.npz", "model.n_epochs=1", "--real", n_buf=4)
    _check_averaged(got, [0, 1], run, ("bn1.mean", "bn1.var", "bn2.mean", "bn2.var"))


@pytest.mark.mpi
@pytest.mark.parametrize("rule,n,workers", [("EASGD", 3, [1, 2]), ("GOSGD", 2, [0, 1])])
def test_easgd_and_gosgd_validate_and_save_the_workers_mean(
    mpirun, data, tmp_path, rule, n, workers
) -> None:
    run = tmp_path / "run"
    args = [f"weight_exchange.sync_rule={rule}", "model.n_epochs=1"]
    got = _run(mpirun, n, data, run, tmp_path / "a.npz", *args)
    _check_averaged(got, workers, run)


@pytest.mark.mpi
def test_resume_restores_the_checkpoints_buffers_on_every_rank(mpirun, data, tmp_path) -> None:
    run = tmp_path / "run"
    first = _run(mpirun, 2, data, run, tmp_path / "a.npz", "model.n_epochs=1")
    ck = load_checkpoint(checkpoint_path(run / "checkpoints", 1))
    assert ck.buffers and not np.array_equal(ck.buffers[0], 0)
    got = _run(mpirun, 2, data, run, tmp_path / "b.npz", "model.n_epochs=2", "--resume")
    assert got["summary"]["epochs"] == 2
    for r in range(2):  # the values the resumed run starts from: the checkpoint's, everywhere
        for a, b in zip(got[(r, "first")], ck.buffers, strict=True):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(first[(r, "final")], ck.buffers, strict=True):
            np.testing.assert_array_equal(a, b)
    _check_averaged(got, [0, 1], run)


class _Arrays:
    """A model as the checkpoint module sees one: lists of named shared variables."""

    def __init__(self, with_buffers: bool) -> None:
        import pytensor

        self.params = [pytensor.shared(np.arange(3, dtype=np.float32), name="fc.W")]
        self.opt_state = [pytensor.shared(np.zeros(3, np.float32), name="fc.W.v")]
        self.buffers = (
            [pytensor.shared(np.full(2, 7, np.float32), name="bn.mean")] if with_buffers else []
        )


def test_checkpoint_buffers_round_trip_and_mismatch_is_one_line(tmp_path) -> None:
    from theanompi.models import create_model

    section = {
        "name": "resnet50",
        "input_size": 32,
        "channels": 3,
        "n_classes": 4,
        "arch": {"width": 0.0625},
    }
    m = create_model(section)
    rng = np.random.default_rng(0)
    want = [rng.normal(0, 1, b.get_value().shape).astype(np.float32) for b in m.buffers]
    for b, v in zip(m.buffers, want, strict=True):
        b.set_value(v)
    path = save_checkpoint(tmp_path / "epoch_0001.npz", m, {"epoch": 1, "step": 3})
    fresh = create_model(section)
    assert not np.array_equal(fresh.buffers[0].get_value(), want[0])
    apply_checkpoint(fresh, load_checkpoint(path), opt_state=False)
    for b, v in zip(fresh.buffers, want, strict=True):
        np.testing.assert_array_equal(b.get_value(), v)

    with_bn = save_checkpoint(tmp_path / "a.npz", _Arrays(True), {"epoch": 1})
    without = save_checkpoint(tmp_path / "b.npz", _Arrays(False), {"epoch": 1})
    with pytest.raises(ConfigError, match=r"buffer 'bn.mean' does not exist in the model"):
        apply_checkpoint(_Arrays(False), load_checkpoint(with_bn))
    with pytest.raises(ConfigError, match=r"buffer 'bn.mean' is missing from the checkpoint"):
        apply_checkpoint(_Arrays(True), load_checkpoint(without))
    # a checkpoint written before buffers existed (no n_buf, no b000) still loads
    old = save_arrays(tmp_path / "old.npz", [np.ones(3, np.float32)], [], {"param_names": ["fc.W"]})
    ck = load_checkpoint(old)
    assert ck.buffers == [] and "n_buf" not in ck.meta
    target = _Arrays(False)
    target.opt_state = []
    apply_checkpoint(target, ck)
    np.testing.assert_array_equal(target.params[0].get_value(), np.ones(3, np.float32))
