"""The launcher's watch over one mpirun: Ctrl-C as a step-boundary stop, no orphans, one-line failures."""

from __future__ import annotations

import codecs
import ctypes
import enum
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from theanompi.launch.banners import BELOW_MIN_NP, SIGNALED, failure_line, lost_line, never_started
from theanompi.launch.launcher_watch import (
    EXIT_INTERRUPTED,
    LAUNCHER_HOST_ENV,
    LAUNCHER_PID_ENV,
    STOP_SIGNAL,
    pid_alive,
)
from theanompi.launch.output import BANNERS_ENV, HOLD_S, TERMINAL_ENV, OutputFilter, live_output
from theanompi.launch.slurm import EXIT_REQUEUED

__all__ = [
    "STOP_GRACE_S",
    "Attempt",
    "LaunchPlan",
    "RunPhase",
    "SupervisedRun",
    "supervise",
]

STOP_GRACE_S = 60.0  # after a stop request, mpirun is told to kill the ranks after this long
WATCH_EVERY_S = 2.0  # how often a plan's watch is asked (an elastic job's discovery script)
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Attempt:
    """How one mpirun ended: ``code`` is what the launcher exits with, ``mpirun_code`` what
    mpirun returned, ``stopped`` whether the user asked to stop (Ctrl-C, SIGTERM, SIGHUP),
    ``failure`` the one-line reason when a rank died (else ``""``), ``not_started`` why
    mpirun failed before starting any rank (:func:`~theanompi.launch.banners.never_started`;
    ``""``: it started), ``lost_host`` the first host lost mid-run (its mpirun daemon died, the
    node went down; ``""``: none) and ``lost_ranks`` the ranks it ran, ``moved`` why the
    launcher's watch stopped the ranks for a relaunch elsewhere (``""``: it did not),
    ``below_min_np`` whether an elastic job's ranks left in place were too few to go on."""

    code: int
    mpirun_code: int
    stopped: bool
    failure: str
    seconds: float
    not_started: str = ""
    lost_host: str = ""
    lost_ranks: tuple[int, ...] = ()
    moved: str = ""
    below_min_np: bool = False


def _child_setup() -> None:  # runs in the child between fork and exec
    """A process group of its own (a terminal's Ctrl-C reaches the launcher only), and
    SIGTERM when the launcher dies, even by SIGKILL (``PR_SET_PDEATHSIG``, Linux)."""
    os.setpgid(0, 0)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the ranks' watch (watch_launcher) remains
        pass


def _binary(stream: Any) -> Any:
    """The byte stream under a text stream (``sys.stdout``), or an adapter to it."""
    buffer = getattr(stream, "buffer", None)
    if buffer is not None:
        return buffer

    class _Text:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # split characters

        def write(self, data: bytes) -> None:
            stream.write(self.decoder.decode(data))

        def flush(self) -> None:
            stream.flush()

    return _Text()


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False


def _say(text: str) -> None:
    """The launcher's own lines, ``tmpi:``-prefixed on stderr, apart from the ranks' output."""
    print(f"tmpi: {text}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class LaunchPlan:
    """What one supervised mpirun runs and where its output goes (torch elastic's WorkerSpec).

    ``env`` is the full environment (the launcher's pid and host added), ``stdout``/``stderr``
    the byte streams that mpirun's output is pumped to, ``banners`` whether mpirun's banners are
    shown where a one-line summary says the same (:data:`~theanompi.launch.output.BANNERS_ENV`)."""

    cmd: tuple[str, ...]
    env: Mapping[str, str]
    stdout: Any
    stderr: Any
    grace_s: float = STOP_GRACE_S
    say: Callable[[str], None] = _say
    banners: bool = False
    #: asked every :data:`WATCH_EVERY_S` while the ranks run: a reason to stop them at a step
    #: boundary for a relaunch elsewhere (an elastic job's new hosts), or None
    watch: Callable[[], str | None] | None = None

    @classmethod
    def of(
        cls,
        cmd: Sequence[str],
        env: Mapping[str, str],
        *,
        grace_s: float = STOP_GRACE_S,
        echo: Callable[[str], None] | None = None,
        watch: Callable[[], str | None] | None = None,
    ) -> LaunchPlan:
        """The plan for :func:`supervise`'s arguments: the ranks learn the launcher's pid/host."""
        full_env = dict(env) | {
            LAUNCHER_PID_ENV: str(os.getpid()),
            LAUNCHER_HOST_ENV: socket.gethostname(),
        }
        full_env.setdefault(TERMINAL_ENV, "1" if _isatty(sys.stderr) else "0")
        return cls(
            cmd=tuple(live_output(cmd)),
            env=full_env,
            stdout=_binary(sys.stdout),
            stderr=_binary(sys.stderr),
            grace_s=grace_s,
            say=echo or _say,
            banners=os.environ.get(BANNERS_ENV, "") not in ("", "0"),
            watch=watch,
        )


class RunPhase(enum.Enum):
    """Where a supervised mpirun is (torch elastic's WorkerState), for the loop and a reader."""

    STARTING = "starting"  # mpirun spawned, its output not pumped yet
    RUNNING = "running"  # pumped and watched; no stop asked
    STOPPING = "stopping"  # STOP_SIGNAL sent: the ranks stop at a step boundary before deadline
    KILLING = "killing"  # a second signal or the grace period's end: mpirun kills the ranks
    EXITED = "exited"  # mpirun returned; the pumps drain and the attempt is summed up


#: the signals that ask the supervised run to stop (first: at a step boundary; next: at once)
_WATCHED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class SupervisedRun:
    """The running state of one supervised mpirun: the process, its pump threads, the stop
    requests and their deadline; what its output says is in ``output`` (:class:`OutputFilter`).

    The main thread (the loop in :func:`_monitor`, and the signal handler) drives it; the
    pump threads only feed ``output``."""

    def __init__(self, plan: LaunchPlan) -> None:
        self.plan = plan
        self.t0 = time.monotonic()
        self.phase = RunPhase.STARTING
        self.stops = 0  # stop requests so far (SIGINT, SIGTERM, SIGHUP)
        self.moved = ""  # why the plan's watch stopped the ranks (for a relaunch elsewhere)
        self._next_watch = self.t0 + WATCH_EVERY_S
        self.deadline: float | None = None  # when a stop at a step boundary turns into a kill
        self.output = OutputFilter(banners=plan.banners)
        self.proc = subprocess.Popen(
            list(plan.cmd),
            env=dict(plan.env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=_child_setup,
        )
        self.readers: list[threading.Thread] = []

    def start(self) -> None:
        """Pump mpirun's stdout and stderr to ours, each on a thread, so neither pipe fills."""
        assert self.proc.stdout is not None and self.proc.stderr is not None
        pump = self.output.pump
        self.readers = [
            threading.Thread(target=pump, args=(self.proc.stdout, self.plan.stdout), daemon=True),
            threading.Thread(target=pump, args=(self.proc.stderr, self.plan.stderr), daemon=True),
        ]
        for reader in self.readers:
            reader.start()
        self.phase = RunPhase.RUNNING

    # -- the main thread: signals and the grace period -----------------------------------------
    def on_signal(self, signum: int, frame: Any) -> None:
        """SIGINT, SIGTERM, SIGHUP: the first stops the ranks at a step boundary, the next at once."""
        self.stops += 1
        self.output.stopping = True
        if self.proc.poll() is not None:
            return
        if self.stops == 1:
            self.plan.say(
                f"{signal.Signals(signum).name}: stopping at the next step boundary "
                f"(again to stop at once; mpirun is told to kill the ranks after "
                f"{self.plan.grace_s:g} s)"
            )
            self.deadline = time.monotonic() + self.plan.grace_s
            self.phase = RunPhase.STOPPING
            _send(self.proc, STOP_SIGNAL)
        else:
            self.plan.say("stopping at once")
            self._kill()

    def tick(self) -> None:
        """One wait of the loop: show the MPI errors held long enough, end an overdue stop,
        ask the plan's watch (every :data:`WATCH_EVERY_S`) whether to stop for a move."""
        self.output.release(older_than=HOLD_S)
        now = time.monotonic()
        if self.plan.watch is not None and now > self._next_watch:
            self._next_watch = now + WATCH_EVERY_S
            why = None if self.stops or self.moved else self.plan.watch()
            if why and self.proc.poll() is None:
                self.moved = why
                self.plan.say(f"{why}: stopping the ranks at the next step boundary to relaunch")
                self.output.stopping = True
                self.deadline = now + self.plan.grace_s
                self.phase = RunPhase.STOPPING
                _send(self.proc, STOP_SIGNAL)
        deadline = self.deadline
        if deadline is not None and time.monotonic() > deadline:
            self.plan.say(
                f"the ranks did not stop within {self.plan.grace_s:g} s; stopping them at once"
            )
            self._kill()

    def _kill(self) -> None:
        """SIGTERM to mpirun, which kills the ranks (SIGTERM, then SIGKILL 0.25 s later)."""
        self.deadline = None
        self.phase = RunPhase.KILLING
        _send(self.proc, signal.SIGTERM)

    # -- the end ---------------------------------------------------------------------------------
    def finish(self, rc: int) -> Attempt:
        """Drain the pumps and sum the attempt up: exit code, stop, one-line failure."""
        self.phase = RunPhase.EXITED
        for reader in self.readers:
            reader.join(timeout=5)
        out = self.output
        out.release(older_than=None)
        _reap_local(out.placed, out.rank_pids)
        tail = "".join(out.tail)
        # the ranks stopped at a step boundary on a signal sent to them, not to us (Slurm)
        stopped_there = rc in (EXIT_INTERRUPTED, EXIT_REQUEUED) and not SIGNALED.search(tail)
        stopped = self.stops > 0 or bool(self.moved) or (stopped_there and not out.lost)
        if stopped:
            failure = ""
        elif out.lost:  # mpirun may even exit 0 after losing a daemon (Open MPI 5.0)
            failure = lost_line(out.lost, out.placed)
        else:
            failure = failure_line(tail, rc)
        if stopped:  # the ranks' own code says whether they asked for a requeue
            code = EXIT_REQUEUED if rc == EXIT_REQUEUED else EXIT_INTERRUPTED
        elif failure:
            code = 1
        else:
            code = rc
        not_started = "" if stopped or out.placed else never_started(tail, out.placed)
        took = time.monotonic() - self.t0
        lost = "" if stopped else (out.lost or "")
        ranks = tuple(sorted(r for r, h in out.placed.items() if lost and h == lost))
        few = not stopped and BELOW_MIN_NP in tail
        return Attempt(code, rc, stopped, failure, took, not_started, lost, ranks, self.moved, few)


def _launched_by_me(pid: int) -> bool:
    """``pid`` runs and is a rank of this launcher (its environment says so: not a reused pid)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return pid_alive(pid) and f"{LAUNCHER_PID_ENV}={os.getpid()}".encode() in env


def _reap_local(placed: Mapping[int, str], pids: Mapping[int, int], wait_s: float = 2.0) -> None:
    """Ranks on this host that outlive mpirun (one sleeping in its abort delay, see
    ``mpirun.relaunch``, when mpirun ends at once because it lost a node's daemon): wait
    ``wait_s`` for them, then SIGKILL them, so that nothing is left when the launcher exits."""
    host = socket.gethostname()
    left = [pid for r, pid in pids.items() if placed.get(r) == host]
    deadline = time.monotonic() + wait_s
    while True:
        left = [pid for pid in left if _launched_by_me(pid)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _monitor(run: SupervisedRun) -> int:
    """Wait for mpirun with the stop signals taken over; never return with mpirun still running."""
    old = {s: signal.signal(s, run.on_signal) for s in _WATCHED}
    try:
        while True:
            try:
                return run.proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                run.tick()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if run.proc.poll() is None:  # an exception in this loop: never leave mpirun behind
            _send(run.proc, signal.SIGTERM)
            run.proc.wait()


def supervise(
    cmd: Sequence[str],
    env: Mapping[str, str],
    *,
    grace_s: float = STOP_GRACE_S,
    echo: Callable[[str], None] | None = None,
    watch: Callable[[], str | None] | None = None,
) -> Attempt:
    """Run ``cmd`` (an mpirun line) until it exits, as a well-behaved launcher.

    - mpirun runs in its own process group with stdin closed, so a terminal's Ctrl-C reaches
      only this launcher; it dies with the launcher (``PR_SET_PDEATHSIG``), and the ranks
      watch the launcher's pid too (:func:`~theanompi.launch.launcher_watch.watch_launcher`).
    - The first SIGINT, SIGTERM or SIGHUP becomes :data:`STOP_SIGNAL` to mpirun, which
      forwards it to every rank: training stops at the next step boundary and exits 130. A
      second one, or ``grace_s`` seconds without an exit, makes mpirun kill the ranks.
    - mpirun's stderr passes through; a rank killed by a signal, or a host lost mid-run (its
      daemon killed, the node down), becomes one line naming the rank or host (and the ranks
      it ran), and exit 1 (the documented code for a crashed rank). mpirun's banner for it is
      dropped unless ``THEANOMPI_MPI_BANNERS=1``.
    - ``watch`` (an elastic job's new hosts), asked every :data:`WATCH_EVERY_S` s, may stop the
      ranks at a step boundary as a Ctrl-C does; the attempt's ``moved`` says why.
    """
    run = SupervisedRun(LaunchPlan.of(cmd, env, grace_s=grace_s, echo=echo, watch=watch))
    run.start()
    return run.finish(_monitor(run))


def _send(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass
