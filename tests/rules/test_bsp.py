"""BSP under real mpirun (N=1, 2) with the numpy FakeModel: identical replicas, bit-exact resume,
determinism, record and checkpoints, one-line failures, clean Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _train_data import write_dataset  # noqa: E402

from theanompi.io.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint  # noqa: E402
from theanompi.io.record import read_record  # noqa: E402
from theanompi.launch.mpirun import mpirun_command, mpirun_env  # noqa: E402
from theanompi.rules.bsp import BSP  # noqa: E402

SCRIPT = str(Path(__file__).with_name("mpi_bsp.py"))
REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 5 files x 4 sub-batches = 20 sub-batches: N=2 -> 10 steps, N=3 would drop 2
    return write_dataset(tmp_path_factory.mktemp("bsp") / "data", n_train=5, n_val=2, B=16, S=10)


def _load(out: Path, size: int) -> tuple[dict, list[list[np.ndarray]]]:
    with np.load(out) as z:
        summary = json.loads(str(z["summary"][()]))
        n = len([k for k in z.files if k.startswith("r0_")])
        vals = [[z[f"r{r}_{i}"] for i in range(n)] for r in range(size)]
    return summary, vals


def _run(mpirun, n: int, data: Path, run: Path, out: Path, *args: str, **kw):
    return mpirun(n, [SCRIPT, str(data), str(run), str(out), *args], timeout=120, **kw)


@pytest.mark.parametrize("sync_type", ["avg", "cdd"])
def test_two_ranks_stay_identical_and_resume_is_bit_exact(
    mpirun, data: Path, tmp_path: Path, sync_type: str
) -> None:
    common = [f"weight_exchange.sync_type={sync_type}", "weight_exchange.check_every=1"]
    straight = tmp_path / "straight"
    _run(mpirun, 2, data, straight, tmp_path / "a.npz", *common, "model.n_epochs=2")
    summary, vals = _load(tmp_path / "a.npz", 2)
    for a, b in zip(vals[0][:2], vals[1][:2], strict=True):  # params: bit-identical
        np.testing.assert_array_equal(a, b)
    assert summary["steps"] == 20 and summary["epochs"] == 2 and not summary["interrupted"]
    assert 0.0 <= summary["val_top1_err"] <= 1.0 and summary["val_n"] == 27

    ckpts = [p.name for p in list_checkpoints(straight / "checkpoints")]
    assert ckpts == ["epoch_0001.npz", "epoch_0002.npz"]
    assert (straight / "checkpoints" / "epoch_0002.rank1.npz").exists()
    ck = load_checkpoint(straight / "checkpoints" / "epoch_0002.npz")
    assert ck.epoch == 2 and ck.step == 20 and ck.meta["param_names"] == ["fc.W", "fc.b"]
    assert (
        ck.meta["config"]["weight_exchange"]["sync_type"] == sync_type and len(ck.meta["rng"]) == 1
    )
    rec = read_record(straight)
    kinds = [r["kind"] for r in rec]
    assert kinds[0] == "start" and kinds[-1] == "end" and kinds.count("epoch") == 2
    step = next(r for r in rec if r["kind"] == "step")
    for key in ("loss", "error", "images_per_s", "t_compute", "t_exchange", "t_wait", "lr"):
        assert step[key] is not None, key
    assert [r["lr"] for r in rec if r["kind"] == "epoch"] == pytest.approx([0.001, 0.0005])

    split = tmp_path / "split"
    _run(mpirun, 2, data, split, tmp_path / "b.npz", *common, "model.n_epochs=1")
    proc = _run(mpirun, 2, data, split, tmp_path / "c.npz", *common, "model.n_epochs=2", "--resume")
    assert "resumed from" in proc.stdout
    assert "not bit-exact" not in proc.stderr
    _, resumed = _load(tmp_path / "c.npz", 2)
    for r in range(2):  # params and momentum of every rank
        for a, b in zip(vals[r], resumed[r], strict=True):
            np.testing.assert_array_equal(a, b)
    rec2 = read_record(split)
    assert [r["epoch"] for r in rec2 if r["kind"] == "epoch"] == [0, 1]


def test_deterministic_mode_repeats_exactly(mpirun, data: Path, tmp_path: Path) -> None:
    args = ["randomness.deterministic=true", "model.n_epochs=1", "output.snapshot_freq=0"]
    _run(mpirun, 2, data, tmp_path / "r1", tmp_path / "a.npz", *args)
    _run(mpirun, 2, data, tmp_path / "r2", tmp_path / "b.npz", *args)
    (_, a), (_, b) = _load(tmp_path / "a.npz", 2), _load(tmp_path / "b.npz", 2)
    for x, y in zip(a[0] + a[1], b[0] + b[1], strict=True):
        np.testing.assert_array_equal(x, y)
    # snapshot_freq=0: only after the last epoch (configs/config.yaml)
    assert [p.name for p in list_checkpoints(tmp_path / "r1" / "checkpoints")] == ["epoch_0001.npz"]


@pytest.mark.parametrize("sync_type", ["avg", "cdd"])
def test_the_wait_for_a_slow_rank_is_not_counted_as_exchange(
    mpirun, data: Path, tmp_path: Path, sync_type: str
) -> None:
    """Rank 1 takes 0.15 s longer a step: rank 0 waits for it at the barrier before the
    exchange (``sync``), and its exchange is the network's time alone."""
    args = ["model.n_epochs=1", "output.snapshot_freq=0", f"weight_exchange.sync_type={sync_type}"]
    out = _run(mpirun, 2, data, tmp_path / "r", tmp_path / "a.npz", "--slow", *args).stdout
    summary, _ = _load(tmp_path / "a.npz", 2)  # rank 0's numbers
    assert summary["median_sync_s"] > 0.1, summary
    assert summary["median_exchange_s"] < 0.05, summary
    assert summary["t_sync"] > 0.1 and summary["t_exchange"] < 0.05, summary
    assert "for the slowest rank" in out, out
    steps = [r for r in read_record(tmp_path / "r") if r["kind"] == "step"]
    assert steps and all(r["t_sync"] > 0.1 for r in steps), steps


def test_one_rank_runs_and_reports_dropped_remainder(mpirun, data: Path, tmp_path: Path) -> None:
    proc = _run(
        mpirun,
        1,
        data,
        tmp_path / "r",
        tmp_path / "a.npz",
        "model.n_epochs=1",
        "data.prefetch=false",
        "training.max_steps=3",
    )
    summary, _ = _load(tmp_path / "a.npz", 1)
    assert summary["steps"] == 3
    assert (
        "0 sub-batch(es) (0 images) dropped" in proc.stdout
        and "capped by max_steps=3" in proc.stdout
    )
    assert "img/s" in proc.stdout and "compute" in proc.stdout and "wait" in proc.stdout


@pytest.mark.parametrize("where", ["step", "loader"])
def test_a_raising_rank_stops_the_job_with_one_line(
    mpirun, data: Path, tmp_path: Path, where: str
) -> None:
    t0 = time.monotonic()
    proc = _run(
        mpirun,
        2,
        data,
        tmp_path / "r",
        tmp_path / "a.npz",
        "model.n_epochs=50",
        check=False,
        env={"THEANOMPI_FAIL": f"{where}:1:2"},
    )
    assert time.monotonic() - t0 < 30
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("tmpi: error on rank")]
    assert lines and lines[0].startswith(
        f"tmpi: error on rank 1/2: InjectedFailure: injected failure in {where} at step 2"
    ), proc.stderr


def test_rank_with_a_different_model_is_refused(mpirun, data: Path, tmp_path: Path) -> None:
    proc = _run(mpirun, 2, data, tmp_path / "r", tmp_path / "a.npz", "--skew", check=False)
    assert proc.returncode == 2
    errs = [ln for ln in proc.stderr.splitlines() if ln.startswith("tmpi: error:")]
    assert (
        len(errs) == 1
        and "rank 1 holds param #2 'extra.b' (3,) float32 but rank 0 holds nothing" in errs[0]
    )


def test_resume_without_checkpoint_is_a_config_error(mpirun, data: Path, tmp_path: Path) -> None:
    proc = _run(mpirun, 2, data, tmp_path / "r", tmp_path / "a.npz", "--resume", check=False)
    assert proc.returncode == 2 and "--resume: no checkpoint in" in proc.stderr


def test_a_stop_request_stops_cleanly_and_resume_continues(
    mpirun, data: Path, tmp_path: Path
) -> None:
    """SIGUSR1 to mpirun: what ``tmpi train -n N`` and a bare mpirun's terminal relay send on
    Ctrl-C (tests/fault/test_bare_mpirun_ctrl_c.py). A SIGINT to a bare mpirun without a
    terminal is not a stop request: mpirun kills the ranks 0.25-0.5 s later, and a run that
    saved within that was only fast, not clean (it failed under load)."""
    run = tmp_path / "r"
    cmd = mpirun_command(
        2,
        [
            sys.executable,
            SCRIPT,
            str(data),
            str(run),
            str(tmp_path / "a.npz"),
            "model.n_epochs=100000",
            "training.print_freq=1000",
        ],
    )
    env = mpirun_env(os.environ | {"PYTHONPATH": str(REPO)})
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(list_checkpoints(run / "checkpoints")) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "no checkpoints written"
            time.sleep(0.2)
        proc.send_signal(signal.SIGUSR1)  # mpirun forwards it to every rank, kills nobody
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    last = latest_checkpoint(run / "checkpoints")
    ck = load_checkpoint(last)  # valid, not torn
    assert ck.epoch >= 2
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")], (
        "temp files left"
    )
    end = [r for r in read_record(run) if r["kind"] == "end"]
    assert end and end[-1]["interrupted"] is True
    out = _run(
        mpirun, 2, data, run, tmp_path / "b.npz", f"model.n_epochs={ck.epoch + 1}", "--resume"
    )
    assert f"epoch {ck.epoch + 1}/{ck.epoch + 1} done" in out.stdout


@pytest.mark.parametrize("kw", [{"sync_type": "sum"}, {"overlap": "yes"}, {"hierarchical": "on"}])
def test_a_bsp_built_by_hand_refuses_an_unknown_choice(kw: dict[str, str]) -> None:
    ((key, value),) = kw.items()
    with pytest.raises(ValueError, match=f"unknown {key} '{value}'; choose from"):
        BSP("ar", **{"sync_type": "cdd"} | kw)
