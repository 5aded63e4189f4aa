"""Real signals to real jobs: the launcher, mpirun and ranks of ``tmpi train|eval -n 2``.

Each test starts a job in its own session (tests/fault/harness.py), waits for a progress
line, sends one signal and checks the exit code, the time to exit, the processes left
behind and what the run dir holds.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    Exit,
    Job,
    checkpoint_files,
    mpirun_argv,
    tiny_train_args,
    tmpi_argv,
    write_tiny_data,
)

from theanompi.io.checkpoint import latest_checkpoint, load_checkpoint  # noqa: E402
from theanompi.io.record import read_record  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

GONE_S = 10.0  # every process of the job must be gone this long after the fault


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_data(tmp_path_factory.mktemp("fault") / "data")


def _train(data: Path, run: Path, *extra: str, n: int = 2, epochs: int = 100000) -> list[str]:
    args = tiny_train_args(data, run, *extra, epochs=epochs)
    return tmpi_argv(args[0], "-n", str(n), *args[1:])


def _assert_gone(job: Job) -> float:
    left, secs = job.wait_gone(GONE_S)
    assert not left, f"left behind {secs:.1f} s after the fault: {job.describe(left)}"
    return secs


def _run_to_its_end(argv: list[str], fail: str) -> Exit:
    """The job with ``THEANOMPI_FAIL=fail``, waited for to its end, no process of it left."""
    with Job(argv, env={"THEANOMPI_FAIL": fail}) as job:
        end = job.wait(timeout=300)
        _assert_gone(job)
    return end


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_signal_to_the_launcher_leaves_no_process(data: Path, tmp_path: Path, sig: int) -> None:
    run = tmp_path / "run"
    with Job(_train(data, run)) as job:
        job.wait_for(r"epoch 2/\d+ done", timeout=180)
        ranks = [job.rank_pid(0), job.rank_pid(1)]
        job.kill(job.pid, sig)
        end = job.wait(timeout=30)
        secs = _assert_gone(job)
        assert all(p not in job.pids() for p in ranks)
    if sig == signal.SIGTERM:  # a polite stop: at a step boundary, recorded, resumable
        assert end.returncode == 130, end.stderr[-2000:]
        assert "(continue with --resume)" in end.stdout
        assert read_record(run)[-1]["interrupted"] is True
    else:
        assert end.returncode == -signal.SIGKILL
    assert secs < GONE_S
    load_checkpoint(latest_checkpoint(run / "checkpoints"))  # what is there is whole
    assert not [f for f in checkpoint_files(run) if f.startswith(".")], "temp files left"


@pytest.mark.parametrize("command", ["eval", "prep"])
def test_sigkill_to_the_eval_or_prep_launcher_leaves_no_process(
    data: Path, tmp_path: Path, command: str
) -> None:
    run = tmp_path / "run"
    if command == "eval":
        with Job(_train(data, run, epochs=1)) as job:
            assert job.wait(timeout=180).returncode == 0, job.stderr[-2000:]
        args = tiny_train_args(data, run)
        argv = tmpi_argv("eval", "-n", "2", *args[1:7], *args[9:])  # no --epochs
    else:
        with Job(tmpi_argv("prep", "demo", "--out", str(tmp_path / "tree"))) as job:
            assert job.wait(timeout=180).returncode == 0, job.stderr[-2000:]
        src, out = str(tmp_path / "tree"), str(tmp_path / "out")
        argv = tmpi_argv("prep", "all", "-n", "2", "--src", src, "--out", out, "--size", "32")
    with Job(argv) as job:
        job.rank_pid(1)  # the ranks are up (importing, compiling or working)
        job.mpirun_pid()
        job.kill(job.pid, signal.SIGKILL)
        assert job.wait(timeout=30).returncode == -signal.SIGKILL  # killed, not finished
        _assert_gone(job)


@pytest.mark.parametrize("how", ["launcher", "mpirun", "easgd"])
def test_ctrl_c_stops_at_a_step_boundary(data: Path, tmp_path: Path, how: str) -> None:
    """A terminal's Ctrl-C (SIGINT to the whole process group), or SIGUSR1 to a bare mpirun
    (which forwards it; on SIGINT it would kill the ranks 0.25 s later); with EASGD the
    server keeps serving until the workers have stopped."""
    run = tmp_path / "run"
    args = tiny_train_args(data, run)
    rule = ["--rule", "EASGD"] if how == "easgd" else []
    n = 3 if how == "easgd" else 2
    argv = mpirun_argv(2, *args) if how == "mpirun" else _train(data, run, *rule, n=n)
    with Job(argv) as job:
        job.wait_for(r"epoch 3/\d+ done", timeout=180)
        if how == "mpirun":
            job.kill(job.mpirun_pid(), signal.SIGUSR1)
        else:
            job.killpg(signal.SIGINT)
        end = job.wait(timeout=30)  # not the launcher's 60 s hard stop
        _assert_gone(job)
    assert end.returncode == 130, end.stderr[-2000:]
    line = next(ln for ln in end.stdout.splitlines() if "interrupted at epoch" in ln)
    assert "last checkpoint:" in line and line.endswith("(continue with --resume)")
    assert "Traceback" not in end.stderr
    rec = read_record(run)
    assert rec[-1]["kind"] == "end" and rec[-1]["interrupted"] is True
    ck = load_checkpoint(latest_checkpoint(run / "checkpoints"))
    assert ck.epoch >= 3
    # the run continues from there
    with Job(_train(data, run, *rule, "--resume", n=n, epochs=ck.epoch + 1)) as job:
        end = job.wait(timeout=180)
    assert end.returncode == 0, end.stderr[-2000:]
    assert f"epoch {ck.epoch + 1}/{ck.epoch + 1} done" in end.stdout


@pytest.mark.serial
def test_a_killed_rank_ends_the_job_with_exit_1_and_one_line(data: Path, tmp_path: Path) -> None:
    with Job(_train(data, tmp_path / "run")) as job:
        job.wait_for(r"epoch 2/\d+ done", timeout=180)
        pid = job.rank_pid(1)
        job.kill(pid, signal.SIGKILL)
        end = job.wait(timeout=30)
        _assert_gone(job)
    assert end.returncode == 1, end.stderr[-2000:]
    lines = [ln for ln in end.stderr.splitlines() if ln.startswith("tmpi: error:")]
    assert len(lines) == 1, end.stderr
    assert f"rank 1 (pid {pid}) on host " in lines[0] and "signal 9 (SIGKILL)" in lines[0]
    assert end.seconds < 10


def test_max_restarts_resumes_after_a_killed_rank(data: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    with Job(_train(data, run, "--max-restarts", "1", epochs=30)) as job:
        job.wait_for(r"epoch 3/30 done", timeout=180)
        job.kill(job.rank_pid(1), signal.SIGKILL)
        job.wait_for(r"^tmpi: restart 1/1 after rank 1 .* resuming from ", timeout=30)
        end = job.wait(timeout=300)
        _assert_gone(job)
    assert end.returncode == 0, end.stderr[-3000:]
    assert "epoch 30/30 done" in end.stdout and "resumed from" in end.stdout
    rec = read_record(run)
    restarts = [r for r in rec if r["kind"] == "restart"]
    assert len(restarts) == 1
    r = restarts[0]
    assert r["attempt"] == 1 and r["max_restarts"] == 1 and r["exit_code"] == 1
    assert "rank 1" in r["reason"] and "SIGKILL" in r["reason"]
    epochs = [e["epoch"] for e in rec if e["kind"] == "epoch"]
    assert epochs == list(range(30))  # each epoch once: the unfinished one was re-run
    assert rec[-1]["kind"] == "end" and rec[-1]["interrupted"] is False


def test_max_restarts_gives_up_after_k(data: Path, tmp_path: Path) -> None:
    """A rank that fails at every start is restarted K times, then the job exits 1."""
    run = tmp_path / "run"
    end = _run_to_its_end(_train(data, run, "--max-restarts", "2", epochs=3), "step:1:3")
    assert end.returncode == 1, end.stderr[-3000:]
    assert end.stderr.count("tmpi: restart ") == 2
    assert "giving up after 2 restart(s)" in end.stderr


def test_a_run_killed_between_a_checkpoint_and_its_record_line_loses_no_line(
    data: Path, tmp_path: Path
) -> None:
    """Rank 0 fails just after epoch 2's checkpoint (step 20: 10 steps an epoch), before the
    record's line of epoch 2: the restart resumes after epoch 2, and the line comes back from
    the checkpoint (the elastic test lost it this way once in a suite run)."""
    run = tmp_path / "run"
    end = _run_to_its_end(_train(data, run, "--max-restarts", "1", epochs=4), "checkpointed:0:20")
    assert end.returncode == 0, end.stderr[-3000:]
    assert "resumed from" in end.stdout and "epoch_0002.npz" in end.stdout, end.stdout
    rec = read_record(run)
    epochs = [e for e in rec if e["kind"] == "epoch"]
    assert [e["epoch"] for e in epochs] == [0, 1, 2, 3]
    second = epochs[1]
    assert second["step"] == 20 and second["checkpoint"].endswith("epoch_0002.npz"), second
    assert {"train_loss", "val_top1_err", "lr", "seconds", "time"} <= second.keys(), second
