"""The launcher's watch over mpirun: Ctrl-C as a step-boundary stop, no orphans, one-line failures, restarts."""

from __future__ import annotations

import codecs
import ctypes
import enum
import functools
import os
import re
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

from theanompi.launch.slurm import EXIT_REQUEUED

__all__ = [
    "Attempt",
    "pid_alive",
    "supervise",
    "run_with_restarts",
    "watch_launcher",
    "LAUNCHER_PID_ENV",
    "LAUNCHER_HOST_ENV",
    "STOP_SIGNAL",
    "STOP_GRACE_S",
    "NOT_RESTARTABLE",
    "BANNERS_ENV",
    "TERMINAL_ENV",
    "live_output",
    "never_started",
    "run_started",
]

LAUNCHER_PID_ENV = "THEANOMPI_LAUNCHER_PID"  # the ranks stop when this process is gone
LAUNCHER_HOST_ENV = "THEANOMPI_LAUNCHER_HOST"  # ... if they run on its host
#: mpirun forwards SIGUSR1 to every rank and keeps them alive; on SIGINT/SIGTERM it sends
#: SIGTERM and, 0.25 s later, SIGKILL, too soon for a step boundary and a checkpoint
STOP_SIGNAL = signal.SIGUSR1
STOP_GRACE_S = 60.0  # after a stop request, mpirun is told to kill the ranks after this long
WATCH_INTERVAL_S = 0.5
#: exit codes that a restart cannot mend: usage, data, resource (errors.py), Ctrl-C
EXIT_INTERRUPTED = 130
NOT_RESTARTABLE = frozenset({0, 2, 3, 4, EXIT_INTERRUPTED, EXIT_REQUEUED})
_PR_SET_PDEATHSIG = 1

#: set to 1 to see mpirun's own banners where the launcher prints its one-line summary instead
BANNERS_ENV = "THEANOMPI_MPI_BANNERS"
#: "1" when the ranks' output ends on a terminal (the launcher's stderr is one), "0" when not;
#: progress bars redraw one line with ``\r`` there, and print sparse lines otherwise
TERMINAL_ENV = "THEANOMPI_TERMINAL"
_READ_SIZE = 1 << 16  # bytes the pump reads at once from mpirun's pipe
# a segment of mpirun's output the pump passes on at once: a line, or an update ended by "\r"
_SEGMENT_END = re.compile(rb"\r\n?|\n")
_LINE_END = re.compile(rb"\n")  # after a stop request: whole lines only (PMIX_ERR_UNREACH)

# "prterun noticed that process rank 1 with PID 1977 on node vm exited on\nsignal 9 (Killed)."
_SIGNALED = re.compile(
    r"noticed that process rank (\d+) with PID (\d+) on node (\S+) exited on\s+signal (\d+)"
)
# mpirun's banners for a node (or its daemon, prted/orted) lost mid-run: Open MPI 5 (PRRTE)
# says "A daemon failed to report back ... Remote host: H" when the daemon's ssh (launch agent)
# ends, or "PRTE has lost communication with a remote daemon ... Remote daemon: ID on node H"
# when its connection drops first; Open MPI 4 says the latter with ORTE
_NODE_LOST = (
    re.compile(r"daemon failed to report back after being spawned.*?Remote host:\s*(\S+)", re.S),
    re.compile(
        r"has lost communication with a remote daemon\..*?Remote daemon\s*:\s*\S+ on node (\S+)",
        re.S,
    ),
)
# a rank's MPI error report ("[nodea:00000] *** An error occurred in Socket closed", ...):
# held for HOLD_S seconds, and dropped when a lost host explains it (the survivors' view)
_MPI_ERROR = re.compile(rb"^\[[^\]\s]*\] \*\*\* ")
HOLD_S = 3.0
# a survivor's banner when its TCP peer vanished: held and dropped the same way
_PEER_GONE = re.compile(rb"An MPI communication peer process has unexpectedly disconnected")
# what each rank prints when it aborts with Open MPI's mpi_abort_delay (set by mpirun.relaunch
# for jobs across nodes, so that a killed rank's node reports before its peers' aborts)
_ABORT_DELAY = re.compile(rb"^\[[^\]\s]*\] Delaying for \d+ seconds before aborting\s*$")
# each rank started by the launcher tells it where it runs, through mpirun's stderr (the
# pump swallows these lines), so a lost host can be reported with its ranks
_PLACE_TAG = "tmpi-placement:"
_PLACE = re.compile(rb"tmpi-placement: rank (\d+) host (\S+) pid (\d+)\n?")


# mpirun's banner when it could not start at all: its PMIx server's listener did not come up
# (transient: seen once in a whole CI run, on a refused rerun's launch); no rank ran, so the
# same launch is tried again
_NOT_STARTED = re.compile(r"PMIx server's listener thread failed to start")
#: launches of one attempt that may fail to start before the launcher gives up
START_TRIES = 3


def never_started(mpirun_output: str) -> bool:
    """mpirun failed before starting any rank (its PMIx listener): the same launch may go again."""
    return bool(_NOT_STARTED.search(mpirun_output))


def run_started(cmd: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True, **kwargs)`` of an mpirun line,
    run again (up to :data:`START_TRIES` in all) while mpirun failed before starting any rank:
    the captured-output twin of the launcher's own retry, for benches and tests."""
    for _ in range(START_TRIES):
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, **kwargs)
        if proc.returncode == 0 or not never_started(proc.stderr + proc.stdout):
            break
    return proc


# mpirun's banner when the ranks end as asked after a stop request: exit 130, or killed by the
# stop signal itself (before they could install a handler) or by the hard stop
_STOPPED_BANNER = re.compile(
    rb"exited with non-zero status.*Exit code:\s+130\b|exited on\s+signal (%d|%d|%d) "
    % (STOP_SIGNAL, signal.SIGTERM, signal.SIGKILL),
    re.S,
)


@dataclass(frozen=True)
class Attempt:
    """How one mpirun ended: ``code`` is what the launcher exits with, ``mpirun_code`` what
    mpirun returned, ``stopped`` whether the user asked to stop (Ctrl-C, SIGTERM, SIGHUP),
    ``failure`` the one-line reason when a rank died (else ``""``), ``not_started`` whether
    mpirun failed before starting any rank (:data:`_NOT_STARTED`)."""

    code: int
    mpirun_code: int
    stopped: bool
    failure: str
    seconds: float
    not_started: bool = False


def _child_setup() -> None:  # runs in the child between fork and exec
    """A process group of its own (a terminal's Ctrl-C reaches the launcher only), and
    SIGTERM when the launcher dies, even by SIGKILL (``PR_SET_PDEATHSIG``, Linux)."""
    os.setpgid(0, 0)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the ranks' watch (watch_launcher) remains
        pass


def _ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    for r in sorted(set(ranks)):
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)


def _lost_host(banner: str, placed: Mapping[int, str]) -> str | None:
    """The host that mpirun's banner says was lost mid-run (its daemon died or it went down).

    "failed to report back" also means a daemon that never started (no ssh, no install on
    that node): that banner, which says what to check, stays unless ranks ran there."""
    report, lost = _NODE_LOST
    m = lost.search(banner)
    if m:
        return m.group(1)
    m = report.search(banner)
    if m and m.group(1) in placed.values():
        return m.group(1)
    return None


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


def _lost_line(host: str, placed: Mapping[int, str]) -> str:
    ranks = [r for r, h in placed.items() if h == host]
    on = f" (rank {ranks[0]})" if len(ranks) == 1 else f" (ranks {_ranges(ranks)})" if ranks else ""
    return (
        f"lost host {host}{on}: its mpirun daemon died or the node went down; "
        "mpirun stopped the other ranks"
    )


def _failure_line(stderr_text: str, mpirun_code: int) -> str:
    """One line naming the rank and host that a signal killed, from mpirun's banner."""
    m = _SIGNALED.search(stderr_text)
    if m:
        rank, pid, host, sig = m.groups()
        try:
            name = signal.Signals(int(sig)).name
        except ValueError:
            name = f"signal {sig}"
        return (
            f"rank {rank} (pid {pid}) on host {host} was killed by signal {sig} ({name}); "
            "mpirun stopped the other ranks"
        )
    if mpirun_code < 0:
        return f"mpirun itself was killed by signal {-mpirun_code}"
    if 128 < mpirun_code < 128 + 65:  # 255 is mpirun's own error, not a signal
        return f"a rank was killed by signal {mpirun_code - 128} (mpirun exit {mpirun_code})"
    return ""


def _say(text: str) -> None:
    """The launcher's own lines, ``tmpi:``-prefixed on stderr, apart from the ranks' output."""
    print(f"tmpi: {text}", file=sys.stderr, flush=True)


def _write(out: Any, data: bytes) -> None:
    """Pass ``data`` on; a closed stream of ours must not stop the draining of mpirun's."""
    try:
        out.write(data)
        out.flush()
    except (OSError, ValueError):  # our stream closed: keep draining mpirun's
        pass


@dataclass(frozen=True)
class LaunchPlan:
    """What one supervised mpirun runs and where its output goes (torch elastic's WorkerSpec).

    ``env`` is the full environment (the launcher's pid and host added), ``stdout``/``stderr``
    the byte streams that mpirun's output is pumped to, ``banners`` whether mpirun's banners are
    shown where a one-line summary says the same (:data:`BANNERS_ENV`)."""

    cmd: tuple[str, ...]
    env: Mapping[str, str]
    stdout: Any
    stderr: Any
    grace_s: float = STOP_GRACE_S
    say: Callable[[str], None] = _say
    banners: bool = False

    @classmethod
    def of(
        cls,
        cmd: Sequence[str],
        env: Mapping[str, str],
        *,
        grace_s: float = STOP_GRACE_S,
        echo: Callable[[str], None] | None = None,
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
        )


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False


@functools.cache
def _open_mpi_major(mpirun: str) -> int:
    """The major version of Open MPI's ``mpirun`` at this path (0: not Open MPI, or unknown)."""
    try:
        out = subprocess.run(
            [mpirun, "--version"], capture_output=True, text=True, timeout=20, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    m = re.search(r"\(Open MPI\) (\d+)\.", out)
    return int(m.group(1)) if m else 0


def live_output(cmd: Sequence[str]) -> list[str]:
    """``cmd`` with Open MPI 5's ``--output :raw`` after its mpirun, so that mpirun passes the
    ranks' output on as it comes instead of holding each line until its newline (a
    ``\r`` progress bar would show only when it ends). Unchanged where the line already has
    ``--output``, or where its mpirun is not Open MPI 5 or later."""
    cmd = list(cmd)
    if any(a == "--output" or a.startswith("--output=") for a in cmd):
        return cmd
    for i, arg in enumerate(cmd):
        if Path(arg).name in ("mpirun", "mpiexec", "prterun"):
            if _open_mpi_major(arg) >= 5:
                cmd[i + 1 : i + 1] = ["--output", ":raw"]
            break
    return cmd


def _maybe_mpi_error(data: bytes) -> bool:
    """Whether a line beginning with ``data`` is, or may still turn out to be, a rank's MPI
    error report (:data:`_MPI_ERROR`)."""
    if _MPI_ERROR.match(data):
        return True
    if not data.startswith(b"["):
        return False
    end = data.find(b"]")
    if end < 0:
        return not re.search(rb"\s", data)
    return not re.search(rb"\s", data[1:end]) and b" *** ".startswith(data[end + 1 : end + 6])


def _tag_cut(data: bytes) -> int:
    """Where in ``data`` a placement tag (:data:`_PLACE_TAG`) may begin that is not complete
    yet (it needs its line end); ``len(data)`` when none may."""
    tag = _PLACE_TAG.encode()
    at = data.find(tag)
    if at >= 0:
        return at
    for k in range(max(0, len(data) - len(tag) + 1), len(data)):
        if tag.startswith(data[k:]):
            return k
    return len(data)


class _Stream:
    """One of mpirun's streams as its pump reads it: where it goes, the banner being read,
    whether the next segment begins a line, whether the line being read is a held MPI error
    report, and the start of a line that cannot be passed on yet."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.banner: list[bytes] = []  # mpirun's "-----" framed message, held until complete
        self.start = True
        self.held = False
        self.rest = b""


class RunPhase(enum.Enum):
    """Where a supervised mpirun is (torch elastic's WorkerState), for the loop and a reader."""

    STARTING = "starting"  # mpirun spawned, its output not pumped yet
    RUNNING = "running"  # pumped and watched; no stop asked
    STOPPING = "stopping"  # STOP_SIGNAL sent: the ranks stop at a step boundary before deadline
    KILLING = "killing"  # a second signal or the grace period's end: mpirun kills the ranks
    EXITED = "exited"  # mpirun returned; the pumps drain and the attempt is summed up


#: the signals that ask the supervised run to stop (first: at a step boundary; next: at once)
_WATCHED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_TAIL_LINES = 60  # mpirun's last lines kept, where its banners are looked for at the end


class SupervisedRun:
    """The running state of one supervised mpirun: its pumps' buffers (the last lines, the held
    MPI error reports), where each rank runs, the stop requests, and the first host lost.

    Two pump threads (mpirun's stdout and stderr) and the main thread (the loop in
    :func:`_monitor`, and the signal handler) share it; ``lock`` guards ``tail`` and ``held``."""

    def __init__(self, plan: LaunchPlan) -> None:
        self.plan = plan
        self.t0 = time.monotonic()
        self.phase = RunPhase.STARTING
        self.stops = 0  # stop requests so far (SIGINT, SIGTERM, SIGHUP)
        self.deadline: float | None = None  # when a stop at a step boundary turns into a kill
        self.lost: str | None = None  # the first host lost; it outranks a rank's signal
        self.killed = False  # mpirun reported a rank killed by a signal (not a stop we asked)
        self.tail: list[str] = []
        self.placed: dict[int, str] = {}  # rank -> host, as the ranks reported (watch_launcher)
        self.rank_pids: dict[int, int] = {}  # rank -> pid on its host, as the ranks reported
        self.held: list[tuple[float, Any, bytes]] = []  # the ranks' MPI error reports, for HOLD_S
        self.lock = threading.Lock()
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
        self.readers = [
            threading.Thread(
                target=self.pump, args=(self.proc.stdout, self.plan.stdout), daemon=True
            ),
            threading.Thread(
                target=self.pump, args=(self.proc.stderr, self.plan.stderr), daemon=True
            ),
        ]
        for reader in self.readers:
            reader.start()
        self.phase = RunPhase.RUNNING

    # -- the pumps (one thread per stream) -----------------------------------------------------
    def pump(self, stream: Any, out: Any) -> None:
        """mpirun's stdout or stderr to ours as it comes, less what is said in one line.

        Each read passes on at once every line and every ``\r``-ended update (a progress bar),
        and the start of an unfinished line once no filter can still claim it: a line that may
        open a banner, be an MPI error report or hold a placement tag waits for its end."""
        st = _Stream(out)
        fd = stream.fileno()
        while True:
            try:
                chunk = os.read(fd, _READ_SIZE)
            except OSError:  # our end closed
                break
            if not chunk:
                break
            # Open MPI pads the ranks' last output with NULs
            passed = self._feed(st, chunk.replace(b"\0", b""))
            if passed:
                _write(out, passed)
        last = self._filter(st.rest, st) if st.rest else None  # an unterminated last line
        left = (last or b"") + b"".join(st.banner)  # an unterminated banner: show what there is
        if left:
            _write(out, left)

    def _feed(self, st: _Stream, data: bytes) -> bytes:
        """What to pass on now of ``data`` (read after ``st.rest``): its complete segments,
        each through :meth:`_filter`, and the part of an unfinished line that may go."""
        data, st.rest = st.rest + data, b""
        passed: list[bytes] = []
        pos = 0
        for m in (_LINE_END if self.stops else _SEGMENT_END).finditer(data):
            passed.append(self._filter(data[pos : m.end()], st) or b"")
            pos = m.end()
        rest = data[pos:]
        cut = self._passable(rest, st)
        if cut:
            passed.append(self._filter(rest[:cut], st) or b"")
        st.rest = rest[cut:]
        return b"".join(passed)

    def _passable(self, rest: bytes, st: _Stream) -> int:
        """How much of an unfinished line may be passed on before its end: none in a banner, an
        MPI report or after a stop request, nor a line start that may open one; up to a
        placement tag otherwise."""
        if not rest or self.stops or st.banner or st.held:
            return 0
        if st.start and (b"-----".startswith(rest[:5]) or _maybe_mpi_error(rest)):
            return 0
        return _tag_cut(rest)

    def _filter(self, line: bytes, st: _Stream) -> bytes | None:
        """What of one segment (a line, an update ended by ``\r``, or the passable start of a
        line) to pass on now (None: swallowed, held, or part of a banner)."""
        start, st.start = st.start, line.endswith(b"\n")
        if _PLACE_TAG.encode() in line:
            line = self._take_placement(line)
        if not line:
            return None
        with self.lock:
            self.tail.append(line.decode(errors="replace"))
            del self.tail[:-_TAIL_LINES]
        if self.stops and b"PMIX_ERR_UNREACH" in line:
            return None  # mpirun's noise about ranks that stopped as asked
        if start and not self.plan.banners and _ABORT_DELAY.match(line):
            return None  # our own mpi_abort_delay's notice
        opens = start and line.startswith(b"-----")
        if opens or st.banner:
            st.banner.append(line)
            if len(st.banner) == 1 or not opens:
                return None
            text = b"".join(st.banner)
            st.banner.clear()
            if not self.plan.banners and _PEER_GONE.search(text):
                with self.lock:  # the survivors' view of a killed rank: explained at exit
                    self.held.append((time.monotonic(), st.out, text))
                return None
            return self._banner(text)
        if st.held or (start and _MPI_ERROR.match(line)):
            st.held = not st.start  # the report goes on in the next segment
            with self.lock:
                self.held.append((time.monotonic(), st.out, line))
            return None
        return line

    def _take_placement(self, line: bytes) -> bytes:
        """Note where the ranks run (:func:`watch_launcher`'s tags) and strip the tags."""
        for m in _PLACE.finditer(line):
            self.placed[int(m.group(1))] = m.group(2).decode(errors="replace")
            self.rank_pids[int(m.group(1))] = int(m.group(3))
        return _PLACE.sub(b"", line)

    def _banner(self, text: bytes) -> bytes | None:
        """A complete mpirun banner, or None where it is no news or said in one line at exit."""
        if self.stops and _STOPPED_BANNER.search(text):
            return None  # the ranks' 130 after the stop we asked for: not news
        decoded = text.decode(errors="replace")
        lost = None if self.stops else _lost_host(decoded, self.placed)
        if lost and self.lost is None:
            self.lost = lost  # the first host lost; it outranks a rank's signal
        killed = not self.stops and bool(_SIGNALED.search(decoded))
        self.killed = self.killed or killed
        if not self.plan.banners and (lost or killed):
            return None  # said in one line when mpirun exits (failure)
        return text

    def release(self, older_than: float | None) -> None:
        """Print the held MPI error reports (those held ``older_than`` s; None: all), or
        drop them once a lost host or a killed rank explains them (the survivors' "Socket
        closed")."""
        with self.lock:
            if (self.lost or self.killed) and not self.plan.banners:
                self.held.clear()
            now = time.monotonic()
            while self.held and (older_than is None or now - self.held[0][0] >= older_than):
                _, out, data = self.held.pop(0)
                _write(out, data)

    # -- the main thread: signals and the grace period -----------------------------------------
    def on_signal(self, signum: int, frame: Any) -> None:
        """SIGINT, SIGTERM, SIGHUP: the first stops the ranks at a step boundary, the next at once."""
        self.stops += 1
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
        """One wait of the loop: show the MPI errors held long enough, end an overdue stop."""
        self.release(older_than=HOLD_S)
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
        self.release(older_than=None)
        _reap_local(self.placed, self.rank_pids)
        tail = "".join(self.tail)
        # the ranks stopped at a step boundary on a signal sent to them, not to us (Slurm)
        stopped_there = rc in (EXIT_INTERRUPTED, EXIT_REQUEUED) and not _SIGNALED.search(tail)
        stopped = self.stops > 0 or (stopped_there and not self.lost)
        if stopped:
            failure = ""
        elif self.lost:  # mpirun may even exit 0 after losing a daemon (Open MPI 5.0)
            failure = _lost_line(self.lost, self.placed)
        else:
            failure = _failure_line(tail, rc)
        if stopped:  # the ranks' own code says whether they asked for a requeue
            code = EXIT_REQUEUED if rc == EXIT_REQUEUED else EXIT_INTERRUPTED
        elif failure:
            code = 1
        else:
            code = rc
        not_started = not stopped and not self.placed and never_started(tail)
        return Attempt(code, rc, stopped, failure, time.monotonic() - self.t0, not_started)


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
) -> Attempt:
    """Run ``cmd`` (an mpirun line) until it exits, as a well-behaved launcher.

    - mpirun runs in its own process group with stdin closed, so a terminal's Ctrl-C reaches
      only this launcher; it dies with the launcher (``PR_SET_PDEATHSIG``), and the ranks
      watch the launcher's pid too (:func:`watch_launcher`).
    - The first SIGINT, SIGTERM or SIGHUP becomes :data:`STOP_SIGNAL` to mpirun, which
      forwards it to every rank: training stops at the next step boundary and exits 130. A
      second one, or ``grace_s`` seconds without an exit, makes mpirun kill the ranks.
    - mpirun's stderr passes through; a rank killed by a signal, or a host lost mid-run (its
      daemon killed, the node down), becomes one line naming the rank or host (and the ranks
      it ran), and exit 1 (the documented code for a crashed rank). mpirun's banner for it is
      dropped unless ``THEANOMPI_MPI_BANNERS=1``.
    """
    run = SupervisedRun(LaunchPlan.of(cmd, env, grace_s=grace_s, echo=echo))
    run.start()
    return run.finish(_monitor(run))


def _launch(cmd: Sequence[str], env: Mapping[str, str]) -> Attempt:
    """:func:`supervise` ``cmd``, launched again (up to :data:`START_TRIES` in all) while
    mpirun fails before starting any rank: nothing ran, so nothing is lost or repeated."""
    for k in range(1, START_TRIES + 1):
        result = supervise(cmd, env)
        if not result.not_started or k == START_TRIES:
            return result
        print(
            f"tmpi: mpirun failed to start (its PMIx listener); launching again ({k + 1}/"
            f"{START_TRIES})",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(0.5 * k)
    raise AssertionError("unreachable")  # pragma: no cover


def _send(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


def run_with_restarts(
    build_cmd: Callable[[bool], Sequence[str]],
    env: Mapping[str, str],
    *,
    max_restarts: int,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    record_dir: str | os.PathLike[str] | None = None,
) -> int:
    """Run the job; after a rank failure or stall relaunch it with ``--resume``, at most
    ``max_restarts`` times (as ``torchrun --max-restarts``); return the exit code.

    ``build_cmd(resume)`` gives the mpirun line. An exit in :data:`NOT_RESTARTABLE` (success,
    a usage, data or resource error, Ctrl-C) is final. Each restart is printed as one line and
    appended to the record as ``{"kind": "restart", "attempt", "max_restarts", "exit_code",
    "reason", "resume_from"}``; without a checkpoint yet, the run starts over.
    """
    from theanompi.io.checkpoint import latest_checkpoint
    from theanompi.io.record import append_entry

    resume = False
    for attempt in range(max_restarts + 1):
        try:
            result = _launch(build_cmd(resume), env)
        except KeyboardInterrupt:  # Ctrl-C between two attempts: no mpirun is running
            return EXIT_INTERRUPTED
        if result.failure:
            print(f"tmpi: error: {result.failure}", file=sys.stderr, flush=True)
        if result.stopped or result.code in NOT_RESTARTABLE or attempt == max_restarts:
            if result.code not in NOT_RESTARTABLE and max_restarts:
                print(
                    f"tmpi: giving up after {attempt} restart(s) (--max-restarts {max_restarts})",
                    file=sys.stderr,
                    flush=True,
                )
            return result.code
        ck = latest_checkpoint(checkpoint_dir) if checkpoint_dir else None
        resume = ck is not None
        reason = result.failure or f"exit {result.code}"
        print(
            f"tmpi: restart {attempt + 1}/{max_restarts} after {reason}: "
            + (f"resuming from {ck}" if ck else "no checkpoint yet, starting over"),
            file=sys.stderr,
            flush=True,
        )
        if record_dir is not None and ck is not None:
            append_entry(
                record_dir,
                "restart",
                attempt=attempt + 1,
                max_restarts=max_restarts,
                exit_code=result.code,
                reason=reason,
                resume_from=str(ck),
                seconds=round(result.seconds, 3),
            )
    raise AssertionError("unreachable")  # pragma: no cover


# -- the ranks' side ---------------------------------------------------------------------------
def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone: its parent has not reaped it yet)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return text[text.rindex(")") + 2 :].split()[0] not in ("Z", "X")


def _stop_now(signum: int, frame: Any) -> None:
    """The stop signal where no :class:`~theanompi.launch.signals.StopFlag` listens (eval, prep):
    end this rank with 130 at once; mpirun then stops the others."""
    os._exit(EXIT_INTERRUPTED)


def watch_launcher(interval: float = WATCH_INTERVAL_S) -> bool:
    """In a rank started by ``tmpi ... -n N``: exit when the launcher is gone, and let
    :data:`STOP_SIGNAL` end the rank with 130 where no StopFlag listens (``tmpi train`` holds
    one around its run, so training stops at a step boundary instead). Returns whether a
    watch was started (only on the launcher's host)."""
    pid_text = os.environ.get(LAUNCHER_PID_ENV, "")
    if not pid_text.isdigit():
        return False
    if threading.current_thread() is threading.main_thread():
        signal.signal(STOP_SIGNAL, _stop_now)
    from theanompi.comm import rank_from_env

    host = socket.gethostname()
    try:  # where this rank runs, for the launcher (which swallows the line)
        sys.stderr.write(f"{_PLACE_TAG} rank {rank_from_env()} host {host} pid {os.getpid()}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    if os.environ.get(LAUNCHER_HOST_ENV) != host:
        return False  # another node: its mpirun daemon ends this rank when mpirun goes
    pid = int(pid_text)

    def watch() -> None:
        while pid_alive(pid):
            time.sleep(interval)
        print(
            f"tmpi: rank {rank_from_env()}: the launcher (pid {pid}) is gone; stopping",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    threading.Thread(target=watch, name="tmpi-launcher-watch", daemon=True).start()
    return True
