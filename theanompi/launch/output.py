"""mpirun's output as the launcher passes it on: live, less what is said in one line."""

from __future__ import annotations

import functools
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from theanompi.launch.banners import (
    EXITED_BANNER,
    REQUEUED_BANNER,
    SIGNALED,
    STOPPED_BANNER,
    lost_host,
)
from theanompi.launch.launcher_watch import PLACE_TAG

__all__ = ["BANNERS_ENV", "HOLD_S", "TERMINAL_ENV", "OutputFilter", "live_output"]

#: set to 1 to see mpirun's own banners where the launcher prints its one-line summary instead
BANNERS_ENV = "THEANOMPI_MPI_BANNERS"
#: "1" when the ranks' output ends on a terminal (the launcher's stderr is one), "0" when not;
#: progress bars redraw one line with ``\r`` there, and print sparse lines otherwise
TERMINAL_ENV = "THEANOMPI_TERMINAL"
_READ_SIZE = 1 << 16  # bytes the pump reads at once from mpirun's pipe
# a segment of mpirun's output the pump passes on at once: a line, or an update ended by "\r"
_SEGMENT_END = re.compile(rb"\r\n?|\n")
_LINE_END = re.compile(rb"\n")  # after a stop request: whole lines only (PMIX_ERR_UNREACH)
# a rank's MPI error report ("[nodea:00000] *** An error occurred in Socket closed", ...):
# held for HOLD_S seconds, and dropped when a lost host explains it (the survivors' view)
_MPI_ERROR = re.compile(rb"^\[[^\]\s]*\] \*\*\* ")
HOLD_S = 3.0
# a survivor's banner when its TCP peer vanished: held and dropped the same way
_PEER_GONE = re.compile(rb"An MPI communication peer process has unexpectedly disconnected")
# what each rank prints when it aborts with Open MPI's mpi_abort_delay (set by mpirun.relaunch
# for jobs across nodes, so that a killed rank's node reports before its peers' aborts)
_ABORT_DELAY = re.compile(rb"^\[[^\]\s]*\] Delaying for \d+ seconds before aborting\s*$")
# Open MPI's libnbc, when a nonblocking collective meets a lost or revoked peer, and libevent's
# warning about the lost peer's socket (under ULFM, elastic training: the ranks' own line says
# who was lost), each followed by a blank line
_LOST_PEER_NOISE = re.compile(
    rb"^(NBC_Progress: an error \d+ was found|Error in NBC_Start_round|\[warn\] Epoll \w+\(\d+\) on fd)"
)
# the ranks' placement tags (launcher_watch.watch_launcher), swallowed by the pumps
_PLACE = re.compile(rb"tmpi-placement: rank (\d+) host (\S+) pid (\d+)\n?")
_TAIL_LINES = 60  # mpirun's last lines kept, where its banners are looked for at the end


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


def _write(out: Any, data: bytes) -> None:
    """Pass ``data`` on; a closed stream of ours must not stop the draining of mpirun's."""
    try:
        out.write(data)
        out.flush()
    except (OSError, ValueError):  # our stream closed: keep draining mpirun's
        pass


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
    """Where in ``data`` a placement tag (:data:`PLACE_TAG`) may begin that is not complete
    yet (it needs its line end); ``len(data)`` when none may."""
    tag = PLACE_TAG.encode()
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
        self.blank_after = False  # the next segment, when a blank line, is a dropped report's


class OutputFilter:
    """What the launcher learns from mpirun's output and passes on of it (torch elastic's
    TailLog, apart from the processes): the last lines, the held MPI error reports, where each
    rank runs, the first host lost and whether a rank was killed.

    ``banners``: show mpirun's banners where a one-line summary says the same. The run sets
    ``stopping`` on a stop request, after which mpirun's noise about it is no news. Two pump
    threads (mpirun's stdout and stderr) and the main thread share it; ``lock`` guards
    ``tail`` and ``held``."""

    def __init__(self, banners: bool = False) -> None:
        self.banners = banners
        self.stopping = False  # a stop was asked (SIGINT, SIGTERM, SIGHUP)
        self.lost: str | None = None  # the first host lost; it outranks a rank's signal
        self.killed = False  # mpirun reported a rank killed by a signal (not a stop we asked)
        self.said_error = False  # a rank printed its one-line error ("tmpi: error...")
        self.tail: list[str] = []
        self.placed: dict[int, str] = {}  # rank -> host, as the ranks reported (watch_launcher)
        self.rank_pids: dict[int, int] = {}  # rank -> pid on its host, as the ranks reported
        self.held: list[tuple[float, Any, bytes]] = []  # the ranks' MPI error reports, for HOLD_S
        self.lock = threading.Lock()

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
        for m in (_LINE_END if self.stopping else _SEGMENT_END).finditer(data):
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
        if not rest or self.stopping or st.banner or st.held:
            return 0
        if st.start and (b"-----".startswith(rest[:5]) or _maybe_mpi_error(rest)):
            return 0
        return _tag_cut(rest)

    def _filter(self, line: bytes, st: _Stream) -> bytes | None:
        """What of one segment (a line, an update ended by ``\r``, or the passable start of a
        line) to pass on now (None: swallowed, held, or part of a banner)."""
        start, st.start = st.start, line.endswith(b"\n")
        if PLACE_TAG.encode() in line:
            line = self._take_placement(line)
        if not line:
            return None
        with self.lock:
            self.tail.append(line.decode(errors="replace"))
            del self.tail[:-_TAIL_LINES]
        if start and line.startswith(b"tmpi: error"):
            self.said_error = True
        if (self.stopping or self.said_error) and b"PMIX_ERR_UNREACH" in line:
            return None  # mpirun's noise about ranks that stopped as asked or as they said
        if start and not self.banners and _ABORT_DELAY.match(line):
            return None  # our own mpi_abort_delay's notice
        after, st.blank_after = st.blank_after, False
        if (
            start
            and not self.banners
            and (_LOST_PEER_NOISE.match(line) or (after and line == b"\n"))
        ):
            st.blank_after = line != b"\n"
            return None
        opens = start and line.startswith(b"-----")
        if opens or st.banner:
            st.banner.append(line)
            if len(st.banner) == 1 or not opens:
                return None
            text = b"".join(st.banner)
            st.banner.clear()
            if not self.banners and REQUEUED_BANNER.search(text):
                return None  # the ranks stopped on Slurm's signal; their line said where
            exited = not self.stopping and EXITED_BANNER.search(text)
            if not self.banners and (_PEER_GONE.search(text) or exited):
                # the survivors' view of a killed rank, or a rank's exit that its own error
                # line may explain (it can reach us after the banner): decided at release
                with self.lock:
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
        if self.stopping and STOPPED_BANNER.search(text):
            return None  # the ranks' 130 after the stop we asked for: not news
        decoded = text.decode(errors="replace")
        lost = None if self.stopping else lost_host(decoded, self.placed, socket.gethostname())
        if lost and self.lost is None:
            self.lost = lost  # the first host lost; it outranks a rank's signal
        killed = not self.stopping and bool(SIGNALED.search(decoded))
        self.killed = self.killed or killed
        if not self.banners and (lost or killed):
            return None  # said in one line when mpirun exits (failure)
        return text

    def release(self, older_than: float | None) -> None:
        """Print the held MPI error reports (those held ``older_than`` s; None: all), or
        drop them once a lost host or a killed rank explains them (the survivors' "Socket
        closed"), and mpirun's exit box once a rank's one-line error did."""
        with self.lock:
            if (self.lost or self.killed) and not self.banners:
                self.held.clear()
            if self.said_error:  # mpirun's box after a rank's one line says nothing more
                self.held = [h for h in self.held if not EXITED_BANNER.search(h[2])]
            now = time.monotonic()
            while self.held and (older_than is None or now - self.held[0][0] >= older_than):
                _, out, data = self.held.pop(0)
                _write(out, data)
