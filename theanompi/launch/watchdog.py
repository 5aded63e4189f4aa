"""Stall watchdog: names the rank(s) a collective waits for, warns at half the timeout, dumps
every live rank's Python stack, aborts."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from theanompi.comm import is_rank_failure, made
from theanompi.launch.blame import HUB, Blame
from theanompi.launch.stacks import StackDumps

__all__ = ["DEFAULT_STALL_TIMEOUT", "Watchdog"]

DEFAULT_STALL_TIMEOUT = 300.0
_TAG = 7301  # heartbeats, on a communicator of their own (a dup of the job's)
_DIGEST_TAG = 7305  # the hub's digest of every rank's last heartbeat, to each rank


class Watchdog:
    """Heartbeats on a side channel so that a rank blocked in a collective can name who is late.

    A rank blocked in an MPI collective cannot talk on that communicator, so every rank runs a
    daemon thread that, every ``interval`` seconds, sends a small heartbeat to the hub (rank
    :data:`~theanompi.launch.blame.HUB`) on a duplicate of the job's communicator: ``(seq, phase, waiting since,
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
    stall check does. The rule is :class:`~theanompi.launch.blame.Blame` (``blame``); the
    stacks are written by :class:`~theanompi.launch.stacks.StackDumps` (``stacks``).

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
        :data:`~theanompi.launch.stacks.DUMP_SIGNAL`, as ``rank-K.txt`` (appended; left only
        when written). Before it ends the job the reporting rank makes every live rank dump
        (:func:`~theanompi.launch.stacks.dump_plan`) and names the folder in its line.
        ``None``: no dumps.
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
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stacks = StackDumps(stacks_dir, self.rank, self.interval)
        self.blame = Blame(self.rank, self.size, self.stale)
        self.comm: Any = None
        if self.enabled:
            from mpi4py import MPI

            if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
                self.enabled = False  # a side thread may not call MPI; no watchdog
            else:
                me = (MPI.Get_processor_name(), os.getpid() if self.stacks.register() else 0)
                hosts, pids = (list(x) for x in zip(*comm.allgather(me), strict=True))
                self.comm = made(comm.Dup())
                self.stacks.join(self.comm, hosts, pids)
                self.blame.hosts = hosts

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
        self.stacks.unregister()

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
        started = time.monotonic()  # when the thread began (or began again) to listen
        warned = False
        status = MPI.Status()
        last = time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            if now - last > self.stale:  # this process was stopped (SIGSTOP) or starved: it
                heard.clear()  # cannot judge the others from its old news; listen first
                started = now
                warned = False
            last = now
            try:
                self._exchange(self._beat(now), heard, pending)
                if self.stacks.active:
                    self.stacks.serve(status)
            except Exception as err:
                if is_rank_failure(err, self.comm):  # ULFM (elastic): the loop meets the loss
                    return
                raise
            st = self._state
            if st is None or not self._armed:
                continue
            phase, seq, t_enter, peers, collective = st
            waited = now - t_enter
            if waited < self.timeout / 2:
                continue
            missing = self.blame.missing(now, started, heard, seq, phase, peers, collective)
            if waited < self.timeout:
                if not warned and missing and self.blame.decider(now, started, heard, missing):
                    warned = True
                    print(
                        f"tmpi: warning: rank {me} has waited {waited:.0f} s in {phase} for "
                        f"{self.blame.names(missing)}; the job stops at {self.timeout:g} s "
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
            if late or self.blame.decider(now, started, heard, missing):
                stacks = self.stacks.dump_all()  # before the job ends, while all live
                print(
                    f"tmpi: error: stall: rank {me} waited {waited:.0f} s in {phase}; "
                    f"{self.blame.names(missing)} did not arrive within training.stall_timeout="
                    f"{self.timeout:g} s (hung or stopped; see the rank's host, or raise "
                    f"--stall-timeout){stacks}",
                    file=sys.stderr,
                    flush=True,
                )
                time.sleep(0.2)
                MPI.COMM_WORLD.Abort(1)
