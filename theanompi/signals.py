"""Ctrl-C and SIGTERM become a flag that every rank checks at the same step boundary."""

from __future__ import annotations

import signal
from typing import Any

__all__ = ["StopFlag"]


class StopFlag:
    """Turns SIGINT/SIGTERM into a flag that every rank checks at the same step.

    A second Ctrl-C restores the default behaviour (``KeyboardInterrupt`` at once).
    Use as a context manager around the training loop; ``any(comm)`` is a
    one-int allreduce that tells every rank whether any rank was interrupted.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

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
        import threading

        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()
