"""Ctrl-C on a terminal running a bare ``mpirun -n N tmpi train`` (no launcher): a real pty
whose foreground group is mpirun's, and a real ^C typed into it. Open MPI puts each rank in a
process group of its own, so the ^C would reach mpirun alone, which kills the ranks 0.25 s
later; the first rank holds the terminal while it trains (``launch.signals.Terminal``) and
passes the ^C on to mpirun as SIGUSR1: every rank stops at a step boundary, saves, exits 130."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Job, mpirun_argv, tiny_train_args, write_tiny_data  # noqa: E402

from theanompi.io.checkpoint import latest_checkpoint, load_checkpoint  # noqa: E402
from theanompi.io.record import read_record  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


class TerminalJob(Job):
    """A :class:`Job` whose session has a pty as its controlling terminal, on its stdin (as a
    shell's foreground job): ``ctrl_c()`` types ^C, which the terminal turns into SIGINT to its
    foreground process group."""

    def start(self) -> TerminalJob:
        self.master, slave = os.openpty()
        self.t_start = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            cwd=self.cwd,
            stdin=slave,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
        )
        os.close(slave)
        for name, stream in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr)):
            t = threading.Thread(target=self._read, args=(name, stream), daemon=True)
            t.start()
            self._readers.append(t)
        return self

    def foreground(self) -> int:
        return os.tcgetpgrp(self.master)

    def ctrl_c(self) -> None:
        self.t_fault = self.t_fault or time.monotonic()
        os.write(self.master, b"\x03")

    def close(self) -> None:
        super().close()
        os.close(self.master)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_data(tmp_path_factory.mktemp("ctrl_c") / "data")


@pytest.mark.parametrize(("rule", "n"), [("BSP", 2), ("EASGD", 3)])
def test_ctrl_c_under_a_bare_mpirun_saves_and_exits_130(
    data: Path, tmp_path: Path, rule: str, n: int
) -> None:
    """EASGD: rank 0, which holds the terminal, is the server: the workers stop too."""
    run = tmp_path / "run"
    with TerminalJob(mpirun_argv(n, *tiny_train_args(data, run, "--rule", rule))) as job:
        job.wait_for(r"epoch 2/\d+ (step 5/|done)", timeout=180)
        mpirun = job.mpirun_pid()
        assert os.getpgid(mpirun) == mpirun  # a shell's foreground job: mpirun leads its group
        rank0 = job.rank_pid(0)
        assert job.foreground() == os.getpgid(rank0) != mpirun  # rank 0 holds the terminal
        job.ctrl_c()
        end = job.wait(timeout=30)
        left, _ = job.wait_gone(timeout=10)
    assert end.returncode == 130, end.stderr[-3000:]
    assert "exited on signal" not in end.stderr, end.stderr[-3000:]  # every rank exited 130
    line = next(ln for ln in end.stdout.splitlines() if "interrupted at epoch" in ln)
    assert "last checkpoint:" in line and line.endswith("(continue with --resume)"), line
    assert "Traceback" not in end.stderr, end.stderr[-3000:]
    rec = read_record(run)
    assert rec[-1]["kind"] == "end" and rec[-1]["interrupted"] is True
    assert load_checkpoint(latest_checkpoint(run / "checkpoints")).epoch >= 1
    assert not left, f"processes left behind: {left}"
