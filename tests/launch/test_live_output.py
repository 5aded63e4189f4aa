"""The launcher passes the ranks' output on as it comes: ``\\r`` progress updates and unfinished
lines reach its stdout/stderr before the rank finishes, while every filter holds (placement tags
swallowed, MPI error reports held, mpirun's banners said in one line). Real processes and pipes:
a real 2-rank mpirun behind :func:`~theanompi.launch.supervise.supervise`, and real child
processes writing chosen bytes behind a :class:`~theanompi.launch.supervise.SupervisedRun`."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from theanompi.launch.mpirun import find_mpirun, mpirun_command
from theanompi.launch.output import live_output
from theanompi.launch.supervise import Attempt, LaunchPlan, SupervisedRun
from theanompi.launch.testing import REPO

# rank 0 redraws one line three times, a second apart, then ends it and says it is done
RANK = (
    "import os, sys, time\n"
    "if os.environ['OMPI_COMM_WORLD_RANK'] == '0':\n"
    "    for i in range(1, 4):\n"
    "        sys.stderr.write(f'\\rupdate {i}/3'); sys.stderr.flush(); time.sleep(1.0)\n"
    "    sys.stderr.write('\\n'); print('rank 0 done', file=sys.stderr, flush=True)\n"
)
LAUNCHER = (
    "import sys\n"
    "from theanompi.launch.mpirun import mpirun_command, mpirun_env\n"
    "from theanompi.launch.supervise import supervise\n"
    f"cmd = mpirun_command(2, [sys.executable, '-c', {RANK!r}])\n"
    "sys.exit(supervise(cmd, mpirun_env()).code)\n"
)


def _read_timed(proc: subprocess.Popen[bytes], timeout: float) -> list[tuple[float, bytes]]:
    """Everything ``proc`` writes on stderr, read as it comes, with the time each read came."""
    assert proc.stderr is not None
    fd, got, t_end = proc.stderr.fileno(), [], time.monotonic() + timeout
    while time.monotonic() < t_end:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            data = os.read(fd, 4096)
            if not data:
                return got
            got.append((time.monotonic(), data))
    raise AssertionError(f"still writing after {timeout} s: {b''.join(d for _, d in got)!r}")


@pytest.mark.mpi
def test_a_ranks_progress_updates_reach_the_launchers_output_as_they_come() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=os.environ | {"PYTHONPATH": str(REPO)},
        cwd=REPO,
    )
    try:
        got = _read_timed(proc, timeout=120)
    finally:
        proc.kill()
        proc.wait()
    text = b"".join(d for _, d in got)
    assert proc.returncode == 0 and b"rank 0 done" in text, text

    def first(needle: bytes) -> float:
        seen = b""
        for t, data in got:
            seen += data
            if needle in seen:
                return t
        raise AssertionError(f"{needle!r} not in {text!r}")

    # each update arrives while the rank is still sleeping before the next one
    t1, t2, done = first(b"update 1/3"), first(b"update 2/3"), first(b"rank 0 done")
    assert 0.5 < t2 - t1 < 1.9, (t2 - t1, got)
    assert done - t1 > 1.5, (done - t1, got)
    assert b"\rupdate 1/3\rupdate 2/3\rupdate 3/3\nrank 0 done\n" in text


class _Recorder:
    """A byte stream that remembers when each write came."""

    def __init__(self) -> None:
        self.writes: list[tuple[float, bytes]] = []

    def write(self, data: bytes) -> None:
        self.writes.append((time.monotonic(), bytes(data)))

    def flush(self) -> None:
        pass

    @property
    def data(self) -> bytes:
        return b"".join(d for _, d in self.writes)


def _pumped(
    pieces: list[bytes], gap: float = 0.3
) -> tuple[SupervisedRun, _Recorder, float, Attempt]:
    """A real child writes ``pieces`` to its stderr ``gap`` s apart (each its own read);
    returns the run, what came out, when the child exited, and how the run was summed up."""
    child = (
        "import sys, time\n"
        f"for piece in {pieces!r}:\n"
        "    sys.stderr.buffer.write(piece); sys.stderr.buffer.flush()\n"
        f"    time.sleep({gap})\n"
    )
    err = _Recorder()
    plan = LaunchPlan(
        cmd=(sys.executable, "-c", child), env=dict(os.environ), stdout=_Recorder(), stderr=err
    )
    run = SupervisedRun(plan)
    run.start()
    rc = run.proc.wait(timeout=60)
    exited = time.monotonic()
    return run, err, exited, run.finish(rc)


def test_unfinished_lines_and_updates_pass_at_once_and_the_bytes_are_kept() -> None:
    pieces = [
        b"\rprep 10%",
        b" ETA 3s",
        b"\rprep 20%\r",
        b"\n",
        b"plain line\n",
        b"[bsp] epo",
        b"ch 1\n",
    ]
    run, err, _, _ = _pumped(pieces)
    assert err.data == b"".join(pieces)
    # every piece came out in its own write, as it was written (none held for a line end)
    assert [d for _, d in err.writes] == pieces, err.writes
    assert "".join(run.output.tail) == b"".join(pieces).decode()


def test_a_placement_tag_split_over_writes_is_still_swallowed() -> None:
    pieces = [b"\rprogress 1 tmpi-pla", b"cement: rank 0 host h1 pid 12", b"3\n", b"next\n"]
    run, err, _, _ = _pumped(pieces)
    assert err.data == b"\rprogress 1 next\n"
    assert run.output.placed == {0: "h1"}
    assert err.writes[0][1] == b"\rprogress 1 ", "the part before the tag passes at once"


def test_an_mpi_error_report_split_over_writes_is_held_whole() -> None:
    report = b"[vm:00042] *** An error occurred in Socket closed\n"
    _, err, exited, _ = _pumped([b"before\n", report[:5], report[5:12], report[12:], b"after\n"])
    assert err.data == b"before\nafter\n" + report  # released at the end, whole
    t_report = next(t for t, d in err.writes if d == report)
    assert t_report >= exited, "held, not passed on while mpirun ran"


def test_a_banner_split_over_writes_is_said_in_one_line() -> None:
    banner = (
        b"--------------------------------------------------------------------------\n"
        b"prterun noticed that process rank 1 with PID 77 on node vm exited on\n"
        b"signal 9 (Killed).\n"
        b"--------------------------------------------------------------------------\n"
    )
    _, err, _, attempt = _pumped([b"start\n", banner[:3], banner[3:90], banner[90:]], gap=0.2)
    assert err.data == b"start\n"  # the dashes of the banner's first line never leaked
    assert attempt.failure.startswith("rank 1 (pid 77) on host vm was killed by signal 9")


def test_live_output_asks_open_mpi_5_for_raw_output() -> None:
    cmd = mpirun_command(2, [sys.executable, "-c", "pass"])
    out = live_output(cmd)
    assert out[0] == find_mpirun() and out[1:3] == ["--output", ":raw"], out
    assert out[3:] == cmd[1:]
    assert live_output([*cmd[:1], "--output", "tag", *cmd[1:]]).count("--output") == 1
    flaky = ["/bin/sh", "-c", "exit 0"]  # no mpirun in it: unchanged
    assert live_output(flaky) == flaky
    wrapped = [str(Path("/tmp/retry.sh")), *cmd]  # a wrapper in front: after the mpirun
    assert live_output(wrapped)[1:4] == [find_mpirun(), "--output", ":raw"]


_DASHES = b"-" * 74 + b"\n"


def test_slurm_ending_the_daemons_step_loses_the_other_hosts_ranks() -> None:
    """mpirun's box when Slurm ends the job step of its daemons names no host (and mpirun
    may exit 0): the run failed, on the host whose ranks were not mpirun's own."""
    here = os.uname().nodename
    tags = b"".join(
        b"tmpi-placement: rank %d host %s pid %d\n" % (r, h.encode(), 100 + r)
        for r, h in enumerate([here, here, "nodeB", "nodeB"])
    )
    box = (
        _DASHES + b"srun returned non-zero exit status (36608) from launching\n"
        b"the per-node daemon. You may debug this problem further\n" + _DASHES
    )
    _, err, _, attempt = _pumped([tags, box], gap=0.1)
    assert err.data == b""
    assert attempt.code == 1, attempt
    assert attempt.failure.startswith("lost host nodeB (ranks 2-3): its mpirun daemon died")


def test_the_box_of_ranks_that_stopped_for_a_requeue_is_dropped() -> None:
    """Ranks stopped on Slurm's signal (not the launcher's) exit 75 after their own line with
    the checkpoint: mpirun's box about that exit code says nothing more."""
    line = b"[bsp] interrupted at epoch 3 step 34; last checkpoint: c.npz\n"
    box = (
        _DASHES + b"prterun detected that one or more processes exited with non-zero status,\n"
        b"thus causing the job to be terminated. The first process to do so was:\n\n"
        b"   Process name: [prterun-nodeA-16667@1,1]\n   Exit code:    75\n" + _DASHES
    )
    _, err, _, _ = _pumped([line, box], gap=0.1)
    assert err.data == line
    other = box.replace(b"75\n", b"1\n")
    _, err, _, _ = _pumped([line, other], gap=0.1)
    assert err.data == line + other, "another exit code's box stays"


def test_open_mpis_noise_about_a_lost_peer_is_dropped_and_blank_lines_kept() -> None:
    """Elastic training: libnbc's and libevent's lines when a lost peer's collective is aborted
    (and the blank line after each) are dropped; the ranks' own line says who was lost."""
    pieces = [
        b"\n",
        b"NBC_Progress: an error 75 was found during schedule 0x5654 at row-offset 0 - aborting"
        b" the schedule\n",
        b"\n",
        b"Error in NBC_Start_round() (-1)\n",
        b"[warn] Epoll ADD(4) on fd 18 failed. Old events were 0; read change was 0 (none)\n",
        b"\n",
        b"[bsp] elastic: lost rank 3 (vm); 3 of 4 ranks go on\n",
        b"\n",
    ]
    _, err, _, _ = _pumped(pieces, gap=0.05)
    assert err.data == b"\n[bsp] elastic: lost rank 3 (vm); 3 of 4 ranks go on\n\n"
