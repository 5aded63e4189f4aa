"""mpirun's banners read: a rank killed by a signal, a host lost, a launch that never started."""

from __future__ import annotations

import re
import signal
from collections.abc import Mapping, Sequence

from theanompi.launch.launcher_watch import STOP_SIGNAL
from theanompi.launch.slurm import EXIT_REQUEUED

__all__ = [
    "BELOW_MIN_NP",
    "SIGNALED",
    "REQUEUED_BANNER",
    "STOPPED_BANNER",
    "failure_line",
    "lost_host",
    "lost_line",
    "never_started",
]

# the line of an elastic job's ranks when a loss left fewer than ``elastic.min_np`` of them in
# place (train.elastic): the launcher waits for the discovery script's slots, where there is one
BELOW_MIN_NP = "rank(s) left of elastic.min_np="
# "prterun noticed that process rank 1 with PID 1977 on node vm exited on\nsignal 9 (Killed)."
SIGNALED = re.compile(
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
# under Slurm, mpirun starts its remote daemons as one job step (``srun ... prted``); when Slurm
# ends that step (the job ended under it) mpirun says "srun returned non-zero exit status (N) from
# launching the per-node daemon", naming no host, and may exit 0: every host but mpirun's is lost
_DAEMON_STEP_ENDED = re.compile(r"srun returned non-zero exit status \(\d+\) from launching")
# mpirun's banner when the ranks end as asked after a stop request: exit 130, or killed by the
# stop signal itself (before they could install a handler) or by the hard stop
STOPPED_BANNER = re.compile(
    rb"exited with non-zero status.*Exit code:\s+130\b|exited on\s+signal (%d|%d|%d) "
    % (STOP_SIGNAL, signal.SIGTERM, signal.SIGKILL),
    re.S,
)
# mpirun's banner when the ranks stopped on a signal sent to them (Slurm's preemption or
# warning) and asked for a requeue: their own line says so, with the checkpoint
REQUEUED_BANNER = re.compile(
    rb"exited with non-zero status.*Exit code:\s+%d\b" % EXIT_REQUEUED, re.S
)
# mpirun's banner when a rank exited non-zero: it only repeats a rank's own one-line error
EXITED_BANNER = re.compile(rb"exited with non-zero status")
# mpirun's banner when it could not start at all: its PMIx server's listener did not come up
# (transient: seen once in a whole CI run, on a refused rerun's launch); no rank ran, so the
# same launch is tried again
_NOT_STARTED = re.compile(r"PMIx server's listener thread failed to start")


def never_started(mpirun_output: str, placed: Mapping[int, str] | None = None) -> str:
    """Why mpirun failed before starting any rank, ``""`` where it did not (the same launch may
    go again): its PMIx listener did not come up, or a daemon never reported back while no rank
    had said where it runs (``placed`` empty; None where that is not known, as in captured
    output, so a lost node is not taken for a start)."""
    if _NOT_STARTED.search(mpirun_output):
        return "its PMIx listener"
    m = _NODE_LOST[0].search(mpirun_output)
    if m and placed == {}:
        return f"its daemon on {m.group(1)} never reported back"
    return ""


def _ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    for r in sorted(set(ranks)):
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)


def lost_host(banner: str, placed: Mapping[int, str], here: str = "") -> str | None:
    """The host that mpirun's banner says was lost mid-run (its daemon died or it went down);
    Slurm's end of the daemons' step loses the first host with ranks other than ``here``
    (mpirun's).

    "failed to report back" also means a daemon that never started (no ssh, no install on
    that node): that banner, which says what to check, stays unless ranks ran there."""
    report, lost = _NODE_LOST
    m = lost.search(banner)
    if m:
        return m.group(1)
    if _DAEMON_STEP_ENDED.search(banner):
        return next((h for _, h in sorted(placed.items()) if h != here), None)
    m = report.search(banner)
    if m and m.group(1) in placed.values():
        return m.group(1)
    return None


def lost_line(host: str, placed: Mapping[int, str]) -> str:
    """One line naming the lost host and the ranks it ran, in place of mpirun's banner."""
    ranks = [r for r, h in placed.items() if h == host]
    on = f" (rank {ranks[0]})" if len(ranks) == 1 else f" (ranks {_ranges(ranks)})" if ranks else ""
    return (
        f"lost host {host}{on}: its mpirun daemon died or the node went down; "
        "mpirun stopped the other ranks"
    )


def failure_line(stderr_text: str, mpirun_code: int) -> str:
    """One line naming the rank and host that a signal killed, from mpirun's banner."""
    m = SIGNALED.search(stderr_text)
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
