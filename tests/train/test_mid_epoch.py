"""Mid-epoch checkpoints, keep_last, snapshot_freq 0 and the numerical guard, under real mpirun:
a job SIGKILLed mid-epoch resumes from its last step checkpoint and ends bit-identical to an
uninterrupted run; a nan stops every rank with one line and no nan checkpoint."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fault"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _train_data import write_dataset  # noqa: E402
from harness import Job, mpirun_argv, tiny_train_args, write_tiny_data  # noqa: E402

from theanompi.io.checkpoint import (  # noqa: E402
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    rank_state_path,
)
from theanompi.io.record import read_record  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.slow]
GUARD = str(Path(__file__).with_name("mpi_guard.py"))


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_data(tmp_path_factory.mktemp("mid") / "data")


def _train(data: Path, run: Path, *extra: str, epochs: int, timeout: float = 300):
    with Job(mpirun_argv(2, *tiny_train_args(data, run, *extra, epochs=epochs))) as job:
        out = job.wait(timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _arrays(path: Path) -> list[np.ndarray]:
    ck = load_checkpoint(path)
    return ck.params + ck.opt_state


def _no_orphans(ckpt_dir: Path) -> None:
    mains = {p.name for p in list_checkpoints(ckpt_dir)}
    for p in ckpt_dir.glob("*.rank*.npz"):
        assert p.name.split(".rank")[0] + ".npz" in mains, f"side file without main: {p.name}"
    assert not [p for p in ckpt_dir.iterdir() if p.name.startswith(".")], "temp files left"


def test_sigkill_mid_epoch_then_resume_is_bit_exact(data: Path, tmp_path: Path) -> None:
    every = ("--set", "output.checkpoint_every_steps=3", "--set", "output.keep_last=3")
    run = tmp_path / "killed"
    argv = mpirun_argv(2, *tiny_train_args(data, run, *every, epochs=100000))
    # rank 0 SIGKILLs itself as epoch 2's sixth step starts (0-based global step 15): after
    # the checkpoint of its third step, before the next; rank 1 waits in that step's exchange
    # until mpirun ends the job. A kill timed by the job's output ("step 5/10") could land
    # after the epoch's end on a loaded machine, the relay of its lines lagging (measured)
    with Job(argv, env={"THEANOMPI_FAIL": "kill:0:15"}) as job:
        out = job.wait(timeout=180)
    assert out.returncode != 0, out.stdout[-2000:]
    # everything of the job is gone here (the harness SIGKILLs leftovers)
    ckpts = list_checkpoints(run / "checkpoints")
    assert 1 <= len(ckpts) <= 3, [p.name for p in ckpts]  # keep_last=3 (+ none half-written)
    last = load_checkpoint(latest_checkpoint(run / "checkpoints"))
    e, k = last.epoch, int(last.meta["step_in_epoch"])
    assert (e, k, last.step) == (1, 3, 13) and last.meta["mid_epoch"], (e, k, last.step)

    resumed = _train(data, run, *every, "--resume", epochs=e + 1)
    assert f"resumed from {last.path}" in resumed.stdout
    straight = tmp_path / "straight"
    _train(data, straight, *every, epochs=e + 1)
    name = f"epoch_{e + 1:04d}.npz"
    a, b = run / "checkpoints" / name, straight / "checkpoints" / name
    for x, y in zip(_arrays(a), _arrays(b), strict=True):  # params and momentum, rank 0
        np.testing.assert_array_equal(x, y)
    for x, y in zip(  # rank 1's momentum and dropout state (side files)
        _arrays(rank_state_path(a, 1)), _arrays(rank_state_path(b, 1)), strict=True
    ):
        np.testing.assert_array_equal(x, y)
    val = [
        [r["val_loss"] for r in read_record(d) if r["kind"] == "epoch" and r["epoch"] == e]
        for d in (run, straight)
    ]
    assert val[0] == val[1] and len(val[0]) == 1  # the same validation of the same weights
    _no_orphans(run / "checkpoints")
    assert len(list_checkpoints(run / "checkpoints")) == 3


def test_keep_last_and_snapshot_freq_zero(data: Path, tmp_path: Path) -> None:
    run = tmp_path / "r"
    _train(
        data,
        run,
        "--set",
        "output.snapshot_freq=0",
        "--set",
        "output.checkpoint_every_steps=4",
        "--set",
        "output.keep_last=2",
        epochs=2,
    )
    d = run / "checkpoints"
    # 10 steps an epoch: step checkpoints at 4 and 8 of each epoch, the epoch one only at the end
    assert [p.name for p in list_checkpoints(d)] == ["epoch_0001_step_00008.npz", "epoch_0002.npz"]
    assert sorted(p.name for p in d.glob("*.rank1.npz")) == [
        "epoch_0001_step_00008.rank1.npz",
        "epoch_0002.rank1.npz",
    ]
    assert latest_checkpoint(d).name == "epoch_0002.npz"
    ck = load_checkpoint(d / "epoch_0001_step_00008.npz")
    assert (ck.epoch, ck.step, ck.meta["step_in_epoch"]) == (1, 18, 8)


@pytest.fixture(scope="module")
def fake_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("guard") / "data", n_train=5, n_val=2, B=16, S=10)


@pytest.mark.parametrize(
    ("rule", "poison_step", "every", "expect"),
    [
        ("BSP", 12, 0, r"loss became nan/inf at step 13 \(epoch 2\) on rank 0; .*epoch_0001\.npz"),
        ("BSP", 14, 4, r"parameter 'fc.W' became nan/inf by step 14 \(epoch 2\) .*epoch_0001\.npz"),
        # N=3: rank 0 serves; the workers stop and end the job (the server would wait forever)
        (
            "EASGD",
            12,
            0,
            r"loss became nan/inf at step 13 \(epoch 2\) on rank 1; .*epoch_0001\.npz",
        ),
    ],
)
def test_a_nan_stops_every_rank_with_one_line(
    mpirun, fake_data: Path, tmp_path: Path, rule: str, poison_step: int, every: int, expect: str
) -> None:
    run = tmp_path / "r"
    args = [GUARD, fake_data, run, "1", str(poison_step), "model.n_epochs=4"]
    args += [f"output.checkpoint_every_steps={every}", f"weight_exchange.sync_rule={rule}"]
    proc = mpirun(3 if rule == "EASGD" else 2, args, check=False, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    # under a bare mpirun, Open MPI's abort banner is written beside our line and may leave a
    # stray space or NUL in front of it (seen under load): the line itself must be there, once
    errs = [
        ln.lstrip(" \0")
        for ln in proc.stderr.splitlines()
        if ln.lstrip(" \0").startswith("tmpi: error")
    ]
    assert len(errs) == 1 and re.search(expect, errs[0]), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    for p in (run / "checkpoints").glob("*.npz"):  # nothing non-finite was ever saved
        for a in _arrays(p):
            assert np.isfinite(a).all(), p.name
    _no_orphans(run / "checkpoints")
