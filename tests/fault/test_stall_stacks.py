"""On a stall, before the job ends, every live rank writes its Python stack to the run dir's
``stacks/rank-K.txt`` and the stall line names that folder: under ``tmpi train -n 2`` and under
a bare ``mpirun -n 2 tmpi train``, with a rank stuck in C code that holds the GIL (its own
threads starve, so only ``faulthandler``'s signal handler can report where it is).
``tests/fault/test_stall.py`` checks the same for SIGSTOPped ranks (they cannot dump)."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, Job, mpirun_argv, tiny_train_args, tmpi_argv, write_tiny_data  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

TIMEOUT = 6.0
SLACK = 8.0  # as test_stall.py, plus the ranks' answers (a heartbeat interval) and the dumps
INJECT = Path(__file__).with_name("_inject")  # its sitecustomize makes THEANOMPI_STUCK_RANK stuck


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_data(tmp_path_factory.mktemp("stacks") / "data")


@pytest.mark.parametrize("launch", ["tmpi train -n 2", "mpirun -n 2 tmpi train"])
def test_a_rank_stuck_in_c_leaves_the_stack_of_every_live_rank(
    data: Path, tmp_path: Path, launch: str
) -> None:
    run = tmp_path / "run"
    train, *args = tiny_train_args(data, run, "--stall-timeout", str(TIMEOUT))
    if launch.startswith("tmpi"):
        argv = tmpi_argv(train, "-n", "2", *args)
    else:
        argv = mpirun_argv(2, train, *args)
    env = {"PYTHONPATH": f"{INJECT}{os.pathsep}{REPO}", "THEANOMPI_STUCK_RANK": "1"}
    with Job(argv, env=env) as job:
        job.wait_for(r"^rank 1 stuck$", timeout=180)  # in its first validation
        job.t_fault = time.monotonic()
        out = job.wait(timeout=TIMEOUT + SLACK + 20)
        left, _ = job.wait_gone(timeout=10)
    assert out.returncode == 1, (out.returncode, out.stderr[-3000:])
    assert out.seconds < TIMEOUT + SLACK, (out.seconds, out.stderr[-3000:])
    lines = [ln for ln in out.stderr.splitlines() if "stall:" in ln]
    assert len(lines) == 1, out.stderr[-3000:]
    stacks = run / "stacks"
    assert re.search(r"rank 0 waited \d+ s in validation; rank 1 \(", lines[0]), lines[0]
    assert lines[0].endswith(f"; Python stacks of the live ranks in {stacks}{os.sep}"), lines[0]
    assert sorted(p.name for p in stacks.iterdir()) == ["rank-0.txt", "rank-1.txt"]
    stuck = (stacks / "rank-1.txt").read_text()
    waiting = (stacks / "rank-0.txt").read_text()
    # the stuck rank's main thread, innermost frame first: where it is stuck, and how it got there
    assert re.search(
        r"line \d+ in stuck_in_c_holding_the_gil\n.*line \d+ in validate\n", stuck, re.S
    )
    # the waiting rank: its main thread in validation's collective, its watchdog thread
    assert re.search(r"line \d+ in evaluate\n.*line \d+ in validate\n", waiting, re.S), waiting
    assert re.search(r"watchdog\.py\", line \d+ in _run\n", waiting), waiting
    assert not left, f"processes left behind: {left}"
