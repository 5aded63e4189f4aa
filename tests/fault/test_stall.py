"""Stall watchdog under real mpirun and real signals: SIGSTOP one rank (a hung node) and the job
ends within ``--stall-timeout`` + a few seconds, exit 1, with one line naming the stopped rank."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Job, mpirun_argv, tiny_train_args, write_tiny_data  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

TIMEOUT = 6.0
SLACK = 6.0  # heartbeats (<= 0.75 s apart), staleness (2-3 s), the abort and mpirun's teardown


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_data(tmp_path_factory.mktemp("stall") / "data")


def _stall(data: Path, run: Path, n: int, victim: int, *extra: str):
    argv = mpirun_argv(
        n,
        *tiny_train_args(data, run, "--stall-timeout", str(TIMEOUT), *extra),
    )
    with Job(argv) as job:
        # mid-epoch 2: the watchdog is armed
        job.wait_for(r"epoch 2/\d+ step 5/", timeout=180)
        pid = job.rank_pid(victim)
        job.kill(pid, signal.SIGSTOP)
        try:
            out = job.wait(timeout=TIMEOUT + SLACK + 20)
        finally:
            with contextlib.suppress(ProcessLookupError):  # gone with the job, as it should
                os.kill(pid, signal.SIGCONT)
        left, _ = job.wait_gone(timeout=10)
    return out, left


@pytest.mark.parametrize(
    ("n", "victim", "rule"),
    [(2, 1, "BSP"), (3, 0, "BSP"), (3, 0, "EASGD")],  # EASGD's rank 0 is the server
)
def test_a_stopped_rank_ends_the_job_naming_it(
    data: Path, tmp_path: Path, n: int, victim: int, rule: str
) -> None:
    run = tmp_path / "r"
    out, left = _stall(data, run, n, victim, "--rule", rule)
    assert out.returncode == 1, (out.returncode, out.stderr[-3000:])
    assert out.seconds < TIMEOUT + SLACK, (out.seconds, out.stderr[-3000:])
    lines = [ln for ln in out.stderr.splitlines() if "stall:" in ln]
    assert len(lines) == 1, out.stderr[-3000:]
    m = re.search(
        r"rank (\d+) \(([^)]+)\) did not arrive within training.stall_timeout=6 s", lines[0]
    )
    assert m and int(m.group(1)) == victim, lines[0]
    # the victim stops wherever it is when the signal lands (steps take ms): any phase
    phases = (
        "the exchange|the stop agreement|the progress line|the epoch-end merge|validation|"
        "the epoch checkpoint|the rule's epoch end|the rule's finish"
    )
    assert re.search(rf"waited \d+ s in ({phases});", lines[0]), lines[0]
    assert f"rank {victim} (" in lines[0] and lines[0].count("(") == 2, lines[0]  # only it
    warn = [ln for ln in out.stderr.splitlines() if "tmpi: warning:" in ln and "waited" in ln]
    assert len(warn) == 1 and f"for rank {victim} (" in warn[0], out.stderr[-3000:]
    # every live rank left its stack (the stopped one cannot: no file); the line names them
    stacks, live = run / "stacks", [r for r in range(n) if r != victim]
    assert lines[0].endswith(f"; Python stacks of the live ranks in {stacks}{os.sep}"), lines[0]
    assert sorted(p.name for p in stacks.iterdir()) == [f"rank-{r}.txt" for r in live]
    for r in live:
        text = (stacks / f"rank-{r}.txt").read_text()
        assert re.search(r"trainer\.py\", line \d+ in fit\n", text), text
    assert not left, f"processes left behind: {left}"


def test_a_rank_stopped_in_validation_ends_the_job(data: Path, tmp_path: Path) -> None:
    """Rank 1 stops inside validation's batch loop, so rank 0 waits for it in validation's
    collectives (the slowest-rank time, the losses, the counts): the watchdog thread must
    still run there and end the job in time."""
    from theanompi.launch.mpirun import mpirun_command

    args = tiny_train_args(data, tmp_path / "v", "--stall-timeout", str(TIMEOUT))
    argv = mpirun_command(
        2, [sys.executable, str(Path(__file__).with_name("_slow_validation.py")), "1", *args]
    )
    with Job(argv) as job:
        job.wait_for(r"rank 1 validating", timeout=180)
        pid = job.rank_pid(1)
        job.kill(pid, signal.SIGSTOP)
        try:
            out = job.wait(timeout=TIMEOUT + SLACK + 20)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        left, _ = job.wait_gone(timeout=10)
    assert out.returncode == 1, (out.returncode, out.stderr[-3000:])
    assert out.seconds < TIMEOUT + SLACK, (out.seconds, out.stderr[-3000:])
    lines = [ln for ln in out.stderr.splitlines() if "stall:" in ln]
    assert len(lines) == 1, out.stderr[-3000:]
    assert re.search(r"rank 0 waited \d+ s in validation; rank 1 \(", lines[0]), lines[0]
    assert not left, f"processes left behind: {left}"
