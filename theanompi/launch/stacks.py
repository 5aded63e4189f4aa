"""Every live rank's Python stack, written before a stalled job ends: asked for, or signalled."""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["DUMP_SIGNAL", "DUMP_WAIT_S", "StackDumps", "dump_plan"]

_DUMP_TAG = 7302  # "dump your stack", from the rank that ends the job, to every other rank
_SIGNAL_TAG = 7303  # "signal these ranks of your host to dump theirs" (those that did not answer)
_DUMPED_TAG = 7304  # "done", back to the rank that ends the job
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


class StackDumps:
    """This rank's stack file and the stall watchdog's requests for every rank's stack.

    ``stacks_dir`` is the folder of the ``rank-K.txt`` files (``None``: no dumps); ``rank``
    this rank; ``interval`` the heartbeat interval, how long a rank's own answer is waited for.
    :meth:`register` comes before the ranks trade their hosts and pids, :meth:`join` after,
    with the side channel (the watchdog's communicator) the requests go on."""

    def __init__(
        self, stacks_dir: str | os.PathLike[str] | None, rank: int, interval: float
    ) -> None:
        self.stacks_dir = None if stacks_dir is None else Path(stacks_dir)
        self.rank = rank
        self.interval = interval
        self.comm: Any = None
        self.hosts: list[str] = []
        self.pids: list[int] = []  # per rank; 0 where the rank does not dump its stack
        self._file: Any = None

    @property
    def active(self) -> bool:
        """This rank dumps its stack (its file is open), so it serves the requests."""
        return self._file is not None

    def join(self, comm: Any, hosts: Sequence[str], pids: Sequence[int]) -> None:
        """The side channel, and every rank's host and pid (0: it does not dump)."""
        self.comm, self.hosts, self.pids = comm, list(hosts), list(pids)

    def _path(self, rank: int) -> Path:
        assert self.stacks_dir is not None
        return self.stacks_dir / f"rank-{rank}.txt"

    def register(self) -> bool:
        """Dump this rank's stack to its file on :data:`DUMP_SIGNAL` (a folder that cannot be
        written, or a signal someone else handles: no dump)."""
        handler = signal.getsignal(DUMP_SIGNAL)
        if self.stacks_dir is None or handler not in (signal.SIG_DFL, signal.SIG_IGN, None):
            return False
        try:
            self.stacks_dir.mkdir(parents=True, exist_ok=True)
            file = open(self._path(self.rank), "a")  # noqa: SIM115 - kept open
        except OSError:
            return False
        try:
            faulthandler.register(DUMP_SIGNAL, file=file, all_threads=True)
        except (OSError, ValueError, RuntimeError):
            file.close()
            return False
        self._file = file
        return True

    def unregister(self) -> None:
        """Stop dumping on :data:`DUMP_SIGNAL`, which is ignored from now on (a late one from
        a rank that ends the job must not kill this one); drop the file if empty."""
        if self._file is None:
            return
        faulthandler.unregister(DUMP_SIGNAL)
        try:
            signal.signal(DUMP_SIGNAL, signal.SIG_IGN)
        except ValueError:  # not the main thread: the default (end the process) stays
            pass
        self._file.close()
        self._file = None
        path = self._path(self.rank)
        try:
            if path.stat().st_size == 0:
                path.unlink()
                self.stacks_dir.rmdir()  # type: ignore[union-attr]  # the last rank's empties it
        except OSError:
            pass

    def _dump_self(self) -> None:
        """Write this rank's stack (every thread) to its file, from a thread holding the GIL."""
        if self._file is not None:
            faulthandler.dump_traceback(file=self._file, all_threads=True)

    def _signal(self, ranks: Sequence[int], deadline: float) -> None:
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
                self._path(r).unlink(missing_ok=True)

    def _size(self, rank: int) -> int:
        try:
            return self._path(rank).stat().st_size
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

    def dump_all(self) -> str:
        """Before this rank ends the job: every live rank writes its stack, and the stall
        line names the folder (returned; ``""`` without dumps).

        Each rank is asked to dump itself, from its watchdog thread with the GIL held, which
        reads the other threads' stacks safely; the ranks that do not answer within a
        heartbeat interval (a thread holding the GIL in C starves that thread; SIGSTOP) are
        sent :data:`DUMP_SIGNAL`, whose handler dumps without the GIL (:func:`dump_plan`).
        A few seconds at most."""
        if self.stacks_dir is None or not any(self.pids):
            return ""
        others = [r for r in range(len(self.pids)) if r != self.rank and self.pids[r]]
        requests = [self.comm.isend(None, dest=r, tag=_DUMP_TAG) for r in others]
        self._dump_self()
        answered = self._answers(set(others), time.monotonic() + self.interval + 0.5)
        silent = [r for r in others if r not in answered]
        local, asked = dump_plan(self.rank, self.hosts, silent, answered)
        requests += [self.comm.isend(rs, dest=r, tag=_SIGNAL_TAG) for r, rs in asked.items()]
        deadline = time.monotonic() + DUMP_WAIT_S
        self._signal(local, deadline)
        self._answers(set(asked), deadline + self.interval + 0.5)
        for req in requests:
            req.Test()
        return f"; Python stacks of the live ranks in {self.stacks_dir}{os.sep}"

    def serve(self, status: Any) -> None:
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
            self._signal(ranks, time.monotonic() + DUMP_WAIT_S)
            comm.send(None, dest=src, tag=_DUMPED_TAG)
