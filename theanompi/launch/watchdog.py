"""Stall watchdog: names the rank(s) a collective waits for, warns at half the timeout, dumps
every live rank's Python stack, aborts."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["Watchdog", "DEFAULT_STALL_TIMEOUT", "DUMP_SIGNAL", "HUB", "dump_plan"]

DEFAULT_STALL_TIMEOUT = 300.0
_TAG = 7301  # heartbeats, on a communicator of their own (a dup of the job's)
_DUMP_TAG = 7302  # "dump your stack", from the rank that ends the job, to every other rank
_SIGNAL_TAG = 7303  # "signal these ranks of your host to dump theirs" (those that did not answer)
_DUMPED_TAG = 7304  # "done", back to the rank that ends the job
_DIGEST_TAG = 7305  # the hub's digest of every rank's last heartbeat, to each rank
#: the rank every heartbeat goes to and whose digest of them goes back to every rank: 2(N-1)
#: messages an interval in the whole job, not N(N-1)
HUB = 0
#: a rank writes its Python stack (every thread) to ``<stacks_dir>/rank-K.txt`` on this signal,
#: with ``faulthandler`` in the signal handler itself: a rank stuck in C code holding the GIL
#: dumps too. SIGUSR1 is the stop request (:mod:`theanompi.launch.signals`); mpirun forwards
#: both to every rank, so ``kill -USR2 <mpirun pid>`` dumps every rank's stack on demand
DUMP_SIGNAL = signal.SIGUSR2
DUMP_WAIT_S = 2.0  # how long signalled ranks' dumps are waited for before the job is ended


def dump_plan(
    me: int, hosts: Sequence[str], silent: Sequence[int], answered: set[int]
) -> tuple[list[int], dict[int, list[int]]]:
    """Who signals the ``silent`` ranks (those that did not dump their stack when asked: their
    threads are starved or stopped) when rank ``me`` ends the job. Pids are per host: ``me``
    signals those of its own host, and asks one rank of each other host that ``answered``
    (the lowest) to signal that host's. ``hosts[r]`` is rank r's host. Returns ``(ranks me
    signals, {rank asked: the ranks it signals})``; a host where no rank answered is left out.

    >>> dump_plan(1, ["a", "a", "b", "b", "b", "c"], [0, 3, 5], {2, 4})
    ([0], {2: [3]})
    """
    local = [r for r in silent if hosts[r] == hosts[me]]
    asked: dict[int, list[int]] = {}
    for host in dict.fromkeys(hosts[r] for r in silent if hosts[r] != hosts[me]):
        helpers = sorted(r for r in answered if hosts[r] == host)
        if helpers:
            asked[helpers[0]] = [r for r in silent if hosts[r] == host]
    return local, asked


def _stopped(pid: int) -> bool:
    """True when ``pid`` is stopped (SIGSTOP) or gone: it will not dump now."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone, or no /proc: ask the kernel whether it is there
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    return text[text.rindex(")") + 2 :].split()[0] in ("T", "t", "Z", "X")


class Watchdog:
    """Heartbeats on a side channel so that a rank blocked in a collective can name who is late.

    A rank blocked in an MPI collective cannot talk on that communicator, so every rank runs a
    daemon thread that, every ``interval`` seconds, sends a small heartbeat to the hub (rank
    :data:`HUB`) on a duplicate of the job's communicator: ``(seq, phase, waiting since,
    armed)``; the hub sends every rank its digest of the last heartbeats and their ages, so
    each rank knows every other's state with 2(N-1) messages an interval in the whole job
    (each rank to every other: N(N-1)). A silent hub is blamed by the others (its news of
    them is old), the lowest rank it last heard reporting. The loop marks each collective (or
    blocking exchange) with :meth:`enter` / :meth:`leave`, which only store a tuple, so a step
    costs two attribute writes.

    When this rank has waited in a phase for more than ``timeout`` seconds (counting starts
    at :meth:`arm`, after the first step, so compilation never trips it), the *missing* ranks
    are the phase's peers that are silent (no heartbeat for ``stale`` seconds: stopped, hung
    in C, dead) or, for a collective, not waiting in the same phase (same ``seq``). The
    lowest rank that is waiting and not missing prints one line naming them, their host and
    the phase, and calls ``Abort(1)``. At ``timeout / 2`` it prints one warning, as Horovod's
    stall check does.

    Parameters
    ----------
    comm
        The job's communicator (every rank, servers included); ranks are named in it.
    timeout
        Seconds; ``<= 0`` or a one-rank job disables the watchdog (no thread, no messages).
    interval
        Seconds between heartbeats (default ``min(1, timeout / 8)``).
    stacks_dir
        Folder (the run dir's ``stacks``) where each rank writes its Python stack on
        :data:`DUMP_SIGNAL`, as ``rank-K.txt`` (appended; left only when written). Before it
        ends the job the reporting rank makes every live rank dump (:func:`dump_plan`) and
        names the folder in its line. ``None``: no dumps.
    """

    def __init__(
        self,
        comm: Any,
        timeout: float,
        *,
        interval: float | None = None,
        stacks_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.timeout = float(timeout)
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.enabled = self.timeout > 0 and self.size > 1
        self.interval = float(interval or min(1.0, max(self.timeout, 0.1) / 8))
        # news of a rank comes through the hub: up to two intervals old when it arrives
        self.stale = max(5 * self.interval, 2.0)
        self.sent = 0  # heartbeats and digests this rank sent (tests, pipelines/watchdog_load.py)
        #: rank -> (when the hub got its last heartbeat, by this process's clock; the heartbeat)
        self.heard: dict[int, tuple[float, tuple[int, str, float, bool]]] = {}
        self._state: tuple[str, int, float, tuple[int, ...] | None, bool] | None = None
        self._seq = 0
        self._armed = False
        self._started = 0.0  # when the thread began (or began again) to listen
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.hosts: list[str] = []
        self.pids: list[int] = []  # per rank; 0 where the rank does not dump its stack
        self.stacks_dir = None if stacks_dir is None else Path(stacks_dir)
        self._stack_file: Any = None
        self.comm: Any = None
        if self.enabled:
            from mpi4py import MPI

            if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
                self.enabled = False  # a side thread may not call MPI; no watchdog
            else:
                me = (MPI.Get_processor_name(), os.getpid() if self._register_dump() else 0)
                self.hosts, self.pids = (list(x) for x in zip(*comm.allgather(me), strict=True))
                self.comm = comm.Dup()

    # -- the loop's side: cheap ----------------------------------------------------------
    def arm(self) -> None:
        """Start counting waits (call after the first step: compilation is over)."""
        self._armed = True

    def enter(
        self, phase: str, peers: Sequence[int] | None = None, *, collective: bool = True
    ) -> None:
        """This rank now waits in ``phase`` for ``peers`` (ranks of the job; default: all).

        ``collective``: every peer enters the same phases in the same order (the sequence
        numbers match); ``False`` for a point-to-point wait (an EASGD exchange with the server).
        """
        self._seq += 1
        self._state = (
            phase,
            self._seq,
            time.monotonic(),
            tuple(peers) if peers else None,
            collective,
        )

    def leave(self) -> None:
        """The phase entered last is over."""
        self._state = None

    @contextmanager
    def waiting(
        self, phase: str, peers: Sequence[int] | None = None, *, collective: bool = True
    ) -> Iterator[None]:
        """:meth:`enter` before the block, :meth:`leave` after it, even when it raises."""
        self.enter(phase, peers, collective=collective)
        try:
            yield
        finally:
            self.leave()

    # -- life cycle ----------------------------------------------------------------------
    def start(self) -> Watchdog:
        """Start the heartbeat thread (no-op when disabled)."""
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tmpi-watchdog", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread (the job is over; no collective); drop an empty stack file."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval + 1)
            self._thread = None
        self._unregister_dump()

    # -- stack dumps -----------------------------------------------------------------------
    def _stack_path(self, rank: int) -> Path:
        assert self.stacks_dir is not None
        return self.stacks_dir / f"rank-{rank}.txt"

    def _register_dump(self) -> bool:
        """Dump this rank's stack to its file on :data:`DUMP_SIGNAL` (a folder that cannot be
        written, or a signal someone else handles: no dump)."""
        handler = signal.getsignal(DUMP_SIGNAL)
        if self.stacks_dir is None or handler not in (signal.SIG_DFL, signal.SIG_IGN, None):
            return False
        try:
            self.stacks_dir.mkdir(parents=True, exist_ok=True)
            file = open(self._stack_path(self.rank), "a")  # noqa: SIM115 - kept open
        except OSError:
            return False
        try:
            faulthandler.register(DUMP_SIGNAL, file=file, all_threads=True)
        except (OSError, ValueError, RuntimeError):
            file.close()
            return False
        self._stack_file = file
        return True

    def _unregister_dump(self) -> None:
        """Stop dumping on :data:`DUMP_SIGNAL`, which is ignored from now on (a late one from
        a rank that ends the job must not kill this one); drop the file if empty."""
        if self._stack_file is None:
            return
        faulthandler.unregister(DUMP_SIGNAL)
        try:
            signal.signal(DUMP_SIGNAL, signal.SIG_IGN)
        except ValueError:  # not the main thread: the default (end the process) stays
            pass
        self._stack_file.close()
        self._stack_file = None
        path = self._stack_path(self.rank)
        try:
            if path.stat().st_size == 0:
                path.unlink()
                self.stacks_dir.rmdir()  # type: ignore[union-attr]  # the last rank's empties it
        except OSError:
            pass

    def _dump_self(self) -> None:
        """Write this rank's stack (every thread) to its file, from a thread holding the GIL."""
        if self._stack_file is not None:
            faulthandler.dump_traceback(file=self._stack_file, all_threads=True)

    def _signal_dumps(self, ranks: Sequence[int], deadline: float) -> None:
        """Send :data:`DUMP_SIGNAL` to ``ranks`` (of this host) and wait, until ``deadline``,
        for each one that can run (not stopped) to write its stack; drop the files left empty."""
        sizes: dict[int, int] = {}
        for r in ranks:
            try:
                sizes[r] = self._size(r)
                os.kill(self.pids[r], DUMP_SIGNAL)
            except (ProcessLookupError, PermissionError):
                del sizes[r]
        waiting = dict(sizes)
        while waiting and time.monotonic() < deadline:
            for r in [r for r, n in waiting.items() if self._size(r) > n or _stopped(self.pids[r])]:
                del waiting[r]
            time.sleep(0.02)
        for r, n in sizes.items():
            if n == 0 and self._size(r) == 0:  # stopped or gone: no stack, no empty file
                self._stack_path(r).unlink(missing_ok=True)

    def _size(self, rank: int) -> int:
        try:
            return self._stack_path(rank).stat().st_size
        except OSError:
            return 0

    def _answers(self, waiting: set[int], deadline: float) -> set[int]:
        """The ranks of ``waiting`` that say "done" (:data:`_DUMPED_TAG`) before ``deadline``."""
        from mpi4py import MPI

        status, done = MPI.Status(), set()
        while waiting - done and time.monotonic() < deadline:
            while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_DUMPED_TAG, status=status):
                done.add(status.Get_source())
                self.comm.recv(source=status.Get_source(), tag=_DUMPED_TAG)
            time.sleep(0.02)
        return done & waiting

    def _dump_stacks(self) -> str:
        """Before this rank ends the job: every live rank writes its stack, and the stall
        line names the folder (returned; ``""`` without dumps).

        Each rank is asked to dump itself, from its watchdog thread with the GIL held, which
        reads the other threads' stacks safely; the ranks that do not answer within a
        heartbeat interval (a thread holding the GIL in C starves that thread; SIGSTOP) are
        sent :data:`DUMP_SIGNAL`, whose handler dumps without the GIL (:func:`dump_plan`).
        A few seconds at most."""
        if self.stacks_dir is None or not any(self.pids):
            return ""
        others = [r for r in range(self.size) if r != self.rank and self.pids[r]]
        requests = [self.comm.isend(None, dest=r, tag=_DUMP_TAG) for r in others]
        self._dump_self()
        answered = self._answers(set(others), time.monotonic() + self.interval + 0.5)
        silent = [r for r in others if r not in answered]
        local, asked = dump_plan(self.rank, self.hosts, silent, answered)
        requests += [self.comm.isend(rs, dest=r, tag=_SIGNAL_TAG) for r, rs in asked.items()]
        deadline = time.monotonic() + DUMP_WAIT_S
        self._signal_dumps(local, deadline)
        self._answers(set(asked), deadline + self.interval + 0.5)
        for req in requests:
            req.Test()
        return f"; Python stacks of the live ranks in {self.stacks_dir}{os.sep}"

    def _serve_dumps(self, status: Any) -> None:
        """Requests of the rank that ends the job: dump this rank's stack, or signal the
        ranks of this host it names; answer "done" either way."""
        from mpi4py import MPI

        comm = self.comm
        while comm.Iprobe(source=MPI.ANY_SOURCE, tag=_DUMP_TAG, status=status):
            src = status.Get_source()
            comm.recv(source=src, tag=_DUMP_TAG)
            self._dump_self()
            comm.send(None, dest=src, tag=_DUMPED_TAG)  # tiny: sent eagerly, never blocks
        while comm.Iprobe(source=MPI.ANY_SOURCE, tag=_SIGNAL_TAG, status=status):
            src = status.Get_source()
            ranks = comm.recv(source=src, tag=_SIGNAL_TAG)
            self._signal_dumps(ranks, time.monotonic() + DUMP_WAIT_S)
            comm.send(None, dest=src, tag=_DUMPED_TAG)

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the thread ----------------------------------------------------------------------
    def _beat(self, now: float) -> tuple[int, str, float, bool]:
        """``(seq, phase, seconds waited or -1 when not waiting, armed)``."""
        st = self._state
        if st is None or not self._armed:
            return (self._seq, "", -1.0, self._armed)
        return (st[1], st[0], now - st[2], self._armed)

    def _exchange(self, beat: Any, heard: dict[int, Any], pending: dict[int, list[Any]]) -> None:
        """One interval's messages: a rank sends its heartbeat to the hub and takes the hub's
        digest (every rank's last heartbeat and its age there); the hub takes the heartbeats
        and sends the digest to every rank. At most 64 sends wait per peer (a stopped peer
        stops draining; the others go on hearing)."""
        from mpi4py import MPI

        comm, status = self.comm, MPI.Status()
        for r, reqs in pending.items():
            pending[r] = [q for q in reqs if not q.Test()]

        def send(obj: Any, dest: int, tag: int) -> None:
            if len(pending.setdefault(dest, [])) < 64:
                pending[dest].append(comm.isend(obj, dest=dest, tag=tag))
                self.sent += 1

        if self.rank != HUB:
            send(beat, HUB, _TAG)
            while comm.Iprobe(source=HUB, tag=_DIGEST_TAG, status=status):
                digest = comm.recv(source=HUB, tag=_DIGEST_TAG)
                t = time.monotonic()
                for r, item in enumerate(digest):
                    if item is not None and r != self.rank:
                        age, news = item
                        if r not in heard or heard[r][0] < t - age:
                            heard[r] = (t - age, news)
            return
        while comm.Iprobe(source=MPI.ANY_SOURCE, tag=_TAG, status=status):
            src = status.Get_source()
            heard[src] = (time.monotonic(), comm.recv(source=src, tag=_TAG))
        now = time.monotonic()
        digest: list[Any] = [None] * self.size
        digest[HUB] = (0.0, beat)
        for r, (t, news) in heard.items():
            digest[r] = (now - t, news)
        for r in range(self.size):
            if r != HUB:
                send(digest, r, _DIGEST_TAG)

    def _run(self) -> None:
        from mpi4py import MPI

        me = self.rank
        others = [r for r in range(self.size) if r != me]
        heard = self.heard
        pending: dict[int, list[Any]] = {}
        started = self._started = time.monotonic()
        warned = False
        status = MPI.Status()
        last = time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            if now - last > self.stale:  # this process was stopped (SIGSTOP) or starved: it
                heard.clear()  # cannot judge the others from its old news; listen first
                started = self._started = now
                warned = False
            last = now
            self._exchange(self._beat(now), heard, pending)
            if self._stack_file is not None:
                self._serve_dumps(status)
            st = self._state
            if st is None or not self._armed:
                continue
            phase, seq, t_enter, peers, collective = st
            waited = now - t_enter
            if waited < self.timeout / 2:
                continue
            missing = self._missing(now, started, heard, seq, phase, peers, collective)
            if waited < self.timeout:
                if not warned and missing and self._decider(now, heard, missing):
                    warned = True
                    print(
                        f"tmpi: warning: rank {me} has waited {waited:.0f} s in {phase} for "
                        f"{self._names(missing)}; the job stops at {self.timeout:g} s "
                        "(training.stall_timeout)",
                        file=sys.stderr,
                        flush=True,
                    )
                continue
            # the chosen decider did not act (after listening long enough to know)
            late = waited > self.timeout + 2 * self.stale and now - started > 2 * self.stale
            if not missing:
                if not late:
                    continue
                missing = [r for r in (peers or others) if r != me]
            if now - started < 2 * self.stale:
                continue  # just (re)started listening: wait for fresh news before blaming
            if late or self._decider(now, heard, missing):
                stacks = self._dump_stacks()  # before the job ends, while all live
                print(
                    f"tmpi: error: stall: rank {me} waited {waited:.0f} s in {phase}; "
                    f"{self._names(missing)} did not arrive within training.stall_timeout="
                    f"{self.timeout:g} s (hung or stopped; see the rank's host, or raise "
                    f"--stall-timeout){stacks}",
                    file=sys.stderr,
                    flush=True,
                )
                time.sleep(0.2)
                MPI.COMM_WORLD.Abort(1)

    def _fresh(self, r: int, now: float, started: float, heard: dict[int, Any]) -> bool:
        """Whether ``r`` was heard within the staleness; the news of a rank other than the hub
        is judged as of the hub's last digest (a late hub does not make them all silent)."""
        if self.rank != HUB and r != HUB and HUB in heard:
            now = heard[HUB][0]
        if r not in heard:
            return now - started < self.stale
        return now - heard[r][0] < self.stale

    def _missing(
        self,
        now: float,
        started: float,
        heard: dict[int, Any],
        seq: int,
        phase: str,
        peers: tuple[int, ...] | None,
        collective: bool,
    ) -> list[int]:
        """The peers to blame: the hub when it is silent, else the silent ones; when none is
        silent, for a collective, those not waiting at this phase or a later one (busy
        elsewhere, or behind) -- or, when such a peer is itself waiting elsewhere, the silent
        ranks of the whole job. Only current news (half the staleness) tells that a peer is
        elsewhere: a late hub's is frozen."""
        if self.rank != HUB and not self._fresh(HUB, now, started, heard):
            return [HUB]  # the hub is silent: its news of the others is old, it is to blame
        ranks = [r for r in (peers or range(self.size)) if r != self.rank]
        silent = [r for r in ranks if not self._fresh(r, now, started, heard)]
        if silent or not collective:
            return silent
        out = []
        for r in ranks:
            if r not in heard or now - heard[r][0] > self.stale / 2:  # no news (just listening)
                continue  # or old news (the hub is late): not bad news yet
            rseq, rphase, rwaited, _ = heard[r][1]
            if rwaited < 0 or rseq < seq or (rseq == seq and rphase != phase):
                out.append(r)
        if any(heard[r][1][2] >= 0 for r in out):  # a late peer that itself waits (an EASGD
            # worker in its exchange with a stopped server): blame whom the job waits for
            everyone = (r for r in range(self.size) if r != self.rank)
            silent = [r for r in everyone if not self._fresh(r, now, started, heard)]
            if silent:
                return silent
        return out

    def _decider(self, now: float, heard: dict[int, Any], missing: list[int]) -> bool:
        """True when no lower rank that is alive and waiting will report instead. When the hub
        is the silent one, the others' news is as old as its last digest: the lowest rank
        alive then, or never heard of, reports (if it does not, the others do once late)."""
        if self.rank != HUB and HUB in missing:  # a rank never heard of may be alive
            return not any(
                r not in missing and (r not in heard or self._fresh(r, now, self._started, heard))
                for r in range(HUB + 1, self.rank)
            )
        for r in range(self.rank):
            if r in missing or r not in heard:
                continue
            t, (_, _, rwaited, _) = heard[r]
            if now - t < self.stale and rwaited >= 0:
                return False
        return True

    def _names(self, ranks: list[int]) -> str:
        def one(r: int) -> str:
            return f"{r} ({self.hosts[r]})" if r < len(self.hosts) else str(r)

        return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(one(r) for r in ranks)
