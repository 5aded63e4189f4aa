"""Fault injection for real jobs: start one in its own session, wait for a line, signal a rank.

A :class:`Job` runs a command (``tmpi train -n 2 ...`` or ``mpirun -n 2 python -m
theanompi.cli train ...``) with ``start_new_session=True`` and a marker in its environment,
streams both output streams into memory, and can

- wait for a line matching a regex (:meth:`Job.wait_for`),
- find the pid of a rank (``OMPI_COMM_WORLD_RANK`` in ``/proc/<pid>/environ``), of
  ``mpirun`` or of the launcher (:meth:`Job.rank_pid`, :meth:`Job.mpirun_pid`, :attr:`Job.pid`),
- send a real signal to one of them or to the whole process group, as a terminal's Ctrl-C
  does (:meth:`Job.kill`, :meth:`Job.killpg`), and remember when (the fault time),
- wait for the exit (:meth:`Job.wait`: exit code and seconds from the fault) and for every
  process of the job to be gone (:meth:`Job.wait_gone`: leftovers, seconds).

Every process that carries the job's marker is SIGKILLed when the job is closed, so a
failing test never leaves training ranks behind. Use as a context manager.

>>> import sys
>>> with Job([sys.executable, "-c", "print('ready', flush=True); import time; time.sleep(30)"]) as j:
...     _ = j.wait_for(r"^ready$", timeout=20)
...     j.kill(j.pid, 15)
...     j.wait(timeout=20).returncode
-15
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Job",
    "Exit",
    "MARKER_ENV",
    "REPO",
    "marked_pids",
    "checkpoint_files",
    "tmpi_argv",
    "mpirun_argv",
    "write_tiny_data",
    "tiny_train_args",
]

REPO = Path(__file__).resolve().parents[2]
MARKER_ENV = "THEANOMPI_FAULT_JOB"  # every process of a job inherits it (mpirun passes env on)
MPIRUN_NAMES = {"mpirun", "mpiexec", "prterun", "prte", "orterun"}


def tmpi_argv(*args: str) -> list[str]:
    """The ``tmpi`` CLI of this checkout: ``python -m theanompi.cli <args>``."""
    return [sys.executable, "-m", "theanompi.cli", *args]


def mpirun_argv(n: int, *args: str) -> list[str]:
    """``mpirun -n n ... python -m theanompi.cli <args>`` (the user's own mpirun line)."""
    from theanompi.launch.mpirun import mpirun_command

    return mpirun_command(n, tmpi_argv(*args))


MODEL_YAML = Path(__file__).with_name("model_tiny_mlp.yaml")


def write_tiny_data(out: Path) -> Path:
    """The tests' tiny dataset (tests/_train_data.py): 5 train files of 16 images 8x8, 2 val."""
    sys.path.insert(0, str(REPO / "tests"))
    from _train_data import write_dataset

    return write_dataset(out, n_train=5, n_val=2, B=16, S=8)


def tiny_train_args(data: Path, run_dir: Path, *extra: str, epochs: int = 100000) -> list[str]:
    """``train`` arguments for the tiny MLP on :func:`write_tiny_data` (10 steps an epoch at
    N=2, a few ms each): without ``-n``, so that both ``tmpi train -n N`` and a bare
    ``mpirun -n N tmpi train`` can use them."""
    return [
        "train",
        "--model",
        str(MODEL_YAML),
        "--data",
        str(data),
        "--run-dir",
        str(run_dir),
        "--epochs",
        str(epochs),
        "--set",
        "data.file_batch_size=16",
        "--set",
        "data.image_size=8",
        "--set",
        "training.print_freq=5",
        *extra,
    ]


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, a zombie, or not ours
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a process, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def marked_pids(marker: str) -> list[int]:
    """Live (not zombie) processes whose environment carries ``MARKER_ENV=marker``."""
    out = []
    for pid in _all_pids():
        if pid == os.getpid():
            continue
        st = _stat(pid)
        if st is None or st[0] in "ZX":
            continue
        if _environ(pid).get(MARKER_ENV) == marker:
            out.append(pid)
    return sorted(out)


def checkpoint_files(run_dir: str | os.PathLike[str]) -> list[str]:
    """Names of the files in ``<run_dir>/checkpoints`` (sorted; temp files included)."""
    d = Path(run_dir) / "checkpoints"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


@dataclass
class Exit:
    """How a job ended: exit code (negative: killed by that signal), seconds from the fault
    (or from the start when no fault was sent), and both streams."""

    returncode: int
    seconds: float
    stdout: str
    stderr: str


class Job:
    """A command started in a new session with a marker; see the module docstring.

    Parameters
    ----------
    argv
        The command.
    env
        Extra environment (on top of ``os.environ``, ``PYTHONPATH`` = the repo, root-safe MPI).
    cwd
        Working directory (default: the repo).
    echo
        Also copy the job's output lines to this process's stderr (debugging).
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        echo: bool = False,
    ) -> None:
        from theanompi.launch.mpirun import mpirun_env

        self.argv = [str(a) for a in argv]
        self.marker = uuid.uuid4().hex
        self.env = mpirun_env(
            os.environ
            | {"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", MARKER_ENV: self.marker}
            | (env or {})
        )
        self.cwd = str(cwd or REPO)
        self.echo = echo
        self.lines: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._cond = threading.Condition()
        self._readers: list[threading.Thread] = []
        self.proc: subprocess.Popen[str] | None = None
        self._starts = 0
        self.t_start = 0.0
        self.t_fault: float | None = None
        self.t_exit: float | None = None

    # -- start and output -------------------------------------------------------------
    def start(self) -> Job:
        self._starts += 1
        self.t_start = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        for name, stream in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr)):
            t = threading.Thread(target=self._read, args=(name, stream), daemon=True)
            t.start()
            self._readers.append(t)
        return self

    def _start_again(self) -> bool:
        """After the job exited: start it again if mpirun never started a rank (its PMIx
        listener failed, an Open MPI transient that ``tmpi``'s launcher also retries), at most
        ``START_TRIES - 1`` times; whether it did."""
        from theanompi.launch.banners import never_started
        from theanompi.launch.restart import START_TRIES

        if self._starts >= START_TRIES or self.lines["stdout"]:
            return False
        if not never_started("\n".join(self.lines["stderr"])):
            return False
        print("harness: mpirun never started a rank; starting the job again", file=sys.stderr)
        self.lines = {"stdout": [], "stderr": []}
        self._readers = []
        self.start()
        return True

    def _read(self, name: str, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            if self.echo:
                print(f"[{name}] {line}", end="", file=sys.stderr, flush=True)
            with self._cond:
                self.lines[name].append(line.rstrip("\n"))
                self._cond.notify_all()

    @property
    def pid(self) -> int:
        """The started process (the launcher, or mpirun itself)."""
        assert self.proc is not None, "Job not started"
        return self.proc.pid

    @property
    def stdout(self) -> str:
        with self._cond:
            return "\n".join(self.lines["stdout"])

    @property
    def stderr(self) -> str:
        with self._cond:
            return "\n".join(self.lines["stderr"])

    def wait_for(self, pattern: str, timeout: float = 120, stream: str = "any") -> re.Match[str]:
        """The first line (of ``stream``: stdout, stderr or any) matching ``pattern``;
        AssertionError with the output so far when the job exits or ``timeout`` passes first."""
        rx = re.compile(pattern)
        names = ("stdout", "stderr") if stream == "any" else (stream,)
        seen = dict.fromkeys(names, 0)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for name in names:
                    lines = self.lines[name]
                    for line in lines[seen[name] :]:
                        m = rx.search(line)
                        if m:
                            return m
                    seen[name] = len(lines)
                exited = self.proc is not None and self.proc.poll() is not None
                left = deadline - time.monotonic()
                if exited and all(not t.is_alive() for t in self._readers):
                    if self._start_again():
                        seen = dict.fromkeys(names, 0)
                        continue
                    why = f"job exited {self.proc.returncode}"  # type: ignore[union-attr]
                    break
                if left <= 0:
                    why = f"{timeout} s passed"
                    break
                self._cond.wait(min(left, 0.2))
        raise AssertionError(
            f"no line matching {pattern!r} ({why})\n--- stdout ---\n{self.stdout[-3000:]}"
            f"\n--- stderr ---\n{self.stderr[-3000:]}"
        )

    # -- processes --------------------------------------------------------------------
    def pids(self) -> list[int]:
        """Every live process of the job (by marker: orphans re-parented to init included)."""
        return marked_pids(self.marker)

    def rank_pid(self, rank: int, timeout: float = 60) -> int:
        """The pid of MPI rank ``rank`` (the process whose environment names that rank)."""
        deadline = time.monotonic() + timeout
        while True:
            found = [
                p
                for p in self.pids()
                if _environ(p).get("OMPI_COMM_WORLD_RANK") == str(rank)
                and Path(_cmdline(p)[0] if _cmdline(p) else "").name.startswith("python")
            ]
            if found:
                return min(found)  # the rank itself, not a helper it forked
            if self.proc is not None and self.proc.poll() is not None and not self.pids():
                for t in self._readers:  # the whole output, then say it
                    t.join(5)
                if self._start_again():
                    continue
                raise AssertionError(
                    f"rank {rank} never found: the job exited {self.proc.returncode}\n"
                    f"--- stdout ---\n{self.stdout[-2000:]}\n--- stderr ---\n{self.stderr[-2000:]}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"rank {rank} not found among {self.pids()}")
            time.sleep(0.1)

    def mpirun_pid(self, timeout: float = 60) -> int:
        """The pid of mpirun (the started process itself when the job is a bare mpirun line)."""
        deadline = time.monotonic() + timeout
        while True:
            for p in self.pids():
                cmd = _cmdline(p)
                if cmd and Path(cmd[0]).name in MPIRUN_NAMES:
                    return p
            if time.monotonic() > deadline:
                raise AssertionError(f"no mpirun among {self.pids()}")
            time.sleep(0.1)

    # -- faults -----------------------------------------------------------------------
    def kill(self, pid: int, sig: int) -> None:
        """Send ``sig`` to one process; the first signal sent marks the fault time."""
        if self.t_fault is None:
            self.t_fault = time.monotonic()
        os.kill(pid, sig)

    def killpg(self, sig: int) -> None:
        """Send ``sig`` to the job's process group, as a terminal does on Ctrl-C (SIGINT)."""
        if self.t_fault is None:
            self.t_fault = time.monotonic()
        os.killpg(self.pid, sig)

    def wait(self, timeout: float = 60) -> Exit:
        """Wait for the started process to exit; AssertionError after ``timeout`` seconds."""
        assert self.proc is not None
        try:
            self.proc.wait(timeout=timeout)
            for t in self._readers:
                t.join(timeout=5)
            while self._start_again():
                self.proc.wait(timeout=timeout)
                for t in self._readers:
                    t.join(timeout=5)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"job still running {timeout} s after the fault\n--- stdout ---\n"
                f"{self.stdout[-3000:]}\n--- stderr ---\n{self.stderr[-3000:]}"
            ) from None
        self.t_exit = time.monotonic()
        for t in self._readers:
            t.join(timeout=5)
        return Exit(
            self.proc.returncode,
            self.t_exit - (self.t_fault or self.t_start),
            self.stdout,
            self.stderr,
        )

    def wait_gone(self, timeout: float = 10) -> tuple[list[int], float]:
        """Wait until no process of the job is alive; ``(leftover pids, seconds from the fault)``
        where the leftovers are those still alive after ``timeout`` seconds from the fault."""
        t0 = self.t_fault or self.t_start
        if self.proc is not None:
            self.proc.poll()  # reap the started process if it has exited
        while True:
            left = self.pids()
            now = time.monotonic()
            if not left or now - t0 > timeout:
                return left, now - t0
            time.sleep(0.05)

    def describe(self, pids: Sequence[int]) -> str:
        return "; ".join(f"{p}: {' '.join(_cmdline(p))[:120]}" for p in pids)

    # -- teardown ---------------------------------------------------------------------
    def close(self) -> None:
        """SIGKILL every process of the job (group and marker) and reap the started one."""
        if self.proc is None:
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for p in self.pids():
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - a process in D state
            pass
        for t in self._readers:  # they end at EOF, now that every writer is gone
            t.join(timeout=5)

    def __enter__(self) -> Job:
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
