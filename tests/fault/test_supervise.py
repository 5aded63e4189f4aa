"""The launcher's hard stop: ranks that do not stop at the first signal are killed after the
grace period, or at once on a second signal; nothing is left either way."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Job  # noqa: E402

pytestmark = pytest.mark.mpi

SCRIPT = str(Path(__file__).with_name("_supervised.py"))


def _start(grace: float) -> Job:
    job = Job([sys.executable, SCRIPT, str(grace)]).start()
    try:
        job.wait_for(r"^rank 0 up$", timeout=60)
        job.wait_for(r"^rank 1 up$", timeout=60)
    except BaseException:
        job.close()
        raise
    return job


@pytest.mark.serial
def test_ranks_that_ignore_the_stop_are_killed_after_the_grace_period() -> None:
    with _start(grace=3) as job:
        job.killpg(signal.SIGINT)  # Ctrl-C: the launcher forwards SIGUSR1, which they ignore
        job.wait_for(r"SIGINT: stopping at the next step boundary", timeout=10)
        time.sleep(1.5)
        assert job.proc.poll() is None, "stopped before the grace period ended"
        end = job.wait(timeout=20)
        left, _ = job.wait_gone(5)
        assert not left, job.describe(left)
    assert end.returncode == 130, end.stderr
    assert 3 <= end.seconds < 10, end.seconds
    assert "did not stop within 3 s; stopping them at once" in end.stderr
    assert "non-zero status" not in end.stderr  # mpirun's banner for the kill we asked for


@pytest.mark.serial
def test_a_second_ctrl_c_stops_at_once() -> None:
    with _start(grace=60) as job:
        job.killpg(signal.SIGINT)
        job.wait_for(r"stopping at the next step boundary", timeout=10)
        job.killpg(signal.SIGINT)
        end = job.wait(timeout=20)
        left, _ = job.wait_gone(5)
        assert not left, job.describe(left)
    assert end.returncode == 130, end.stderr
    assert end.seconds < 10 and "stopping at once" in end.stderr


_REPORT_BACK = """------------------------------------------------------------
A daemon failed to report back after being spawned. This could
be due to several factors, including inability to find the
daemon executable, or the executable was unable to find its
required supporting libraries. In some cases, the daemon was
able to execute, but was unable to complete a TCP connection
back to prterun:

  Local host:    nodea
  Remote host:   nodeb
  Daemon exit status: 255
------------------------------------------------------------
"""
_LOST = """--------------------------------------------------------------------------
PRTE has lost communication with a remote daemon.

  HNP daemon   : [prterun-nodea-32512@0,0] on node nodea
  Remote daemon: [prterun-nodea-32512@0,1] on node nodeb

This is usually due to either a failure of the TCP network
--------------------------------------------------------------------------
"""


def test_mpirun_banners_for_a_lost_host_name_it_and_its_ranks() -> None:
    """The two banners Open MPI 5 prints when a node's daemon dies (captured on the simulated
    cluster); "failed to report back" counts only where ranks ran (else: a start-up failure)."""
    from theanompi.launch.banners import failure_line, lost_host, lost_line, never_started

    placed = {0: "nodea", 1: "nodea", 2: "nodeb", 3: "nodeb"}
    assert lost_host(_LOST, {}) == "nodeb"
    assert lost_host(_REPORT_BACK, placed) == "nodeb"
    assert lost_host(_REPORT_BACK, {0: "nodea"}) is None
    assert never_started(_REPORT_BACK, {}) == "its daemon on nodeb never reported back"
    assert never_started(_REPORT_BACK, placed) == never_started(_REPORT_BACK) == ""
    assert lost_line("nodeb", placed).startswith("lost host nodeb (ranks 2-3): ")
    assert lost_line("nodeb", {5: "nodeb"}).startswith("lost host nodeb (rank 5): ")
    assert lost_line("nodec", placed).startswith("lost host nodec: ")
    assert failure_line("", 255) == ""  # mpirun's own error, not "killed by signal 127"
    assert "signal 9" in failure_line("", 137)
