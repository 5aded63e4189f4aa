"""Ctrl-C, SIGTERM and the launcher's SIGUSR1 become a flag all ranks check at one step boundary."""

from __future__ import annotations

import signal
import threading
from typing import Any

__all__ = ["StopFlag"]

_ACTIVE: list[StopFlag] = []  # entered flags, outermost first (main thread only)


class StopFlag:
    """Turns SIGINT/SIGTERM/SIGUSR1 into a flag that every rank checks at the same step.

    SIGUSR1 is how ``tmpi ... -n N`` passes a Ctrl-C on: mpirun forwards it to every rank
    without killing them (on SIGINT/SIGTERM mpirun kills the ranks 0.25 s later).
    A second signal restores the default behaviour (``KeyboardInterrupt`` at once).
    Use as a context manager around the training loop; ``any(comm)`` is a
    one-int allreduce that tells every rank whether any rank was interrupted.

    Flags nest: ``tmpi train`` holds one around the whole run, so a Ctrl-C during start-up
    (or on a rank that only serves, as EASGD's server) is kept; the training loop's own flag
    starts out requested and stops at its first check, and passes a request back out.

    >>> import os
    >>> with StopFlag() as outer:
    ...     os.kill(os.getpid(), signal.SIGUSR1)
    ...     with StopFlag() as inner:
    ...         inner.requested
    True
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None
        self._old: dict[int, Any] = {}
        self._entered = False

    def _handler(self, signum: int, frame: Any) -> None:
        if self.requested:  # second signal: give up waiting for the step boundary
            self._restore()
            raise KeyboardInterrupt
        self.requested = True
        self.signum = signum

    def any(self, comm: Any) -> bool:
        if comm.Get_size() == 1:
            return self.requested
        from mpi4py import MPI

        return bool(comm.allreduce(int(self.requested), op=MPI.MAX))

    def _restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            if _ACTIVE and _ACTIVE[-1].requested:  # a request that came before this loop
                self.requested, self.signum = True, _ACTIVE[-1].signum
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handler)
            _ACTIVE.append(self)
            self._entered = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()
        if self._entered:
            _ACTIVE.remove(self)
            self._entered = False
            if _ACTIVE and self.requested and not _ACTIVE[-1].requested:
                _ACTIVE[-1].requested, _ACTIVE[-1].signum = True, self.signum
