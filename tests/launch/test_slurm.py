"""Slurm's side of a job without a Slurm cluster: restart detection, the exit code of a stop,
``--on-signal`` (a real signal to a real job); ``tests/cluster/test_slurm.py`` has the cluster."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fault"))
from harness import Job, mpirun_argv, tiny_train_args, tmpi_argv, write_tiny_data  # noqa: E402

from theanompi.io.checkpoint import latest_checkpoint, load_checkpoint  # noqa: E402
from theanompi.launch.slurm import (  # noqa: E402
    EXIT_REQUEUED,
    EXIT_STOPPED,
    job_id,
    requeue_after_stop,
    restart_count,
    stop_code,
)


def test_restart_count_and_job_come_from_slurm_only() -> None:
    assert restart_count({}) == 0 and job_id({}) is None
    assert restart_count({"SLURM_RESTART_COUNT": "2"}) == 0  # not inside a job
    env = {"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "2"}
    assert restart_count(env) == 2 and job_id(env) == "41"


def test_stop_code_outside_slurm_follows_on_signal() -> None:
    assert stop_code(None, {}) == EXIT_STOPPED  # no job: checkpoint and 130, as before
    assert stop_code("checkpoint", {"SLURM_JOB_ID": "7"}) == EXIT_STOPPED
    assert stop_code("requeue", {}) == EXIT_REQUEUED
    assert requeue_after_stop(EXIT_REQUEUED, {}) == EXIT_REQUEUED  # nothing to requeue


def test_bad_on_signal_is_one_line_exit_2(tmp_path: Path) -> None:
    data = write_tiny_data(tmp_path / "data")
    args = tiny_train_args(data, tmp_path / "run", "--on-signal", "retry", epochs=1)
    with Job(tmpi_argv(*args)) as job:
        end = job.wait(timeout=120)
    assert end.returncode == 2
    assert end.stderr.strip() == (
        "tmpi: error: --on-signal 'retry': choose one of checkpoint, requeue"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.mpi
@pytest.mark.slow
def test_on_signal_requeue_stops_with_a_checkpoint_and_exit_75(tmp_path: Path) -> None:
    """SIGUSR1 to a bare mpirun (as Slurm sends it to the job's processes): every rank stops
    at a step boundary, the checkpoint is written, and the job exits 75 to be run again."""
    data = write_tiny_data(tmp_path / "data")
    run = tmp_path / "run"
    argv = mpirun_argv(2, *tiny_train_args(data, run, "--on-signal", "requeue"))
    with Job(argv) as job:
        job.wait_for(r"epoch 2/\d+ done", timeout=180)
        job.kill(job.mpirun_pid(), signal.SIGUSR1)
        end = job.wait(timeout=60)
    assert end.returncode == EXIT_REQUEUED, end.stderr[-2000:]
    ck = latest_checkpoint(run / "checkpoints")
    assert ck is not None and "_step_" in ck.name  # the stop's mid-epoch checkpoint
    load_checkpoint(ck)
