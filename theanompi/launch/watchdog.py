"""Stall watchdog: names the rank(s) a collective waits for, warns at half the timeout, aborts."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

__all__ = ["Watchdog", "DEFAULT_STALL_TIMEOUT"]

DEFAULT_STALL_TIMEOUT = 300.0
_TAG = 7301  # heartbeats, on a communicator of their own (a dup of the job's)


class Watchdog:
    """Heartbeats on a side channel so that a rank blocked in a collective can name who is late.

    A rank blocked in an MPI collective cannot talk on that communicator, so every rank runs a
    daemon thread that, every ``interval`` seconds, sends a small heartbeat to every other
    rank on a duplicate of the job's communicator: ``(seq, phase, waiting since, armed)``.
    The loop marks each collective (or blocking exchange) with :meth:`enter` / :meth:`leave`,
    which only store a tuple, so a step costs two attribute writes.

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
    """

    def __init__(self, comm: Any, timeout: float, *, interval: float | None = None) -> None:
        self.timeout = float(timeout)
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.enabled = self.timeout > 0 and self.size > 1
        self.interval = float(interval or min(1.0, max(self.timeout, 0.1) / 8))
        self.stale = max(4 * self.interval, 2.0)
        self._state: tuple[str, int, float, tuple[int, ...] | None, bool] | None = None
        self._seq = 0
        self._armed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.hosts: list[str] = []
        self.comm: Any = None
        if self.enabled:
            from mpi4py import MPI

            if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
                self.enabled = False  # a side thread may not call MPI; no watchdog
            else:
                self.hosts = comm.allgather(MPI.Get_processor_name())
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
        """Stop the thread (the job is over; no collective)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval + 1)
            self._thread = None

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

    def _run(self) -> None:
        from mpi4py import MPI

        comm, me = self.comm, self.rank
        others = [r for r in range(self.size) if r != me]
        heard: dict[int, tuple[float, tuple[int, str, float, bool]]] = {}
        pending: list[Any] = []
        started = time.monotonic()
        warned = False
        status = MPI.Status()
        last = time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            if now - last > self.stale:  # this process was stopped (SIGSTOP) or starved: it
                heard.clear()  # cannot judge the others from its old news; listen first
                started, warned = now, False
            last = now
            beat = self._beat(now)
            pending = [r for r in pending if not r.Test()]
            if len(pending) < 64 * len(others):  # a stopped peer stops draining: stop piling up
                pending.extend(comm.isend(beat, dest=r, tag=_TAG) for r in others)
            while comm.Iprobe(source=MPI.ANY_SOURCE, tag=_TAG, status=status):
                src = status.Get_source()
                heard[src] = (time.monotonic(), comm.recv(source=src, tag=_TAG))
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
                print(
                    f"tmpi: error: stall: rank {me} waited {waited:.0f} s in {phase}; "
                    f"{self._names(missing)} did not arrive within training.stall_timeout="
                    f"{self.timeout:g} s (hung or stopped; see the rank's host, or raise "
                    "--stall-timeout)",
                    file=sys.stderr,
                    flush=True,
                )
                time.sleep(0.2)
                MPI.COMM_WORLD.Abort(1)

    def _fresh(self, r: int, now: float, started: float, heard: dict[int, Any]) -> bool:
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
        """The peers to blame: the silent ones; when none is silent, for a collective, those
        not waiting at this phase or a later one (busy elsewhere, or behind) -- or, when such
        a peer is itself waiting elsewhere, the silent ranks of the whole job."""
        ranks = [r for r in (peers or range(self.size)) if r != self.rank]
        silent = [r for r in ranks if not self._fresh(r, now, started, heard)]
        if silent or not collective:
            return silent
        out = []
        for r in ranks:
            if r not in heard:  # just (re)started listening: no news is not bad news yet
                continue
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
        """True when no lower rank that is alive and waiting will report instead."""
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
