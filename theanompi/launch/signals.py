"""Ctrl-C, SIGTERM and the launcher's SIGUSR1 become a flag all ranks check at one step boundary."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any

__all__ = ["StopFlag", "Terminal"]

_ACTIVE: list[StopFlag] = []  # entered flags, outermost first (main thread only)
#: a SIGUSR1 this soon after the first is the same request (Slurm's warning reaches a rank
#: directly and again through mpirun), not a second signal that gives up the checkpoint
REPEAT_S = 5.0


class Terminal:
    """Under a bare ``mpirun -n N tmpi train`` run from a terminal: this rank's process group
    becomes the terminal's foreground group while training, so that Ctrl-C reaches this rank
    instead of mpirun, and this rank passes it on to mpirun as SIGUSR1.

    Why: Open MPI 5's mpirun puts every rank in a process group of its own, so a terminal's
    Ctrl-C (SIGINT to the foreground group) reaches mpirun only, and mpirun answers it with
    SIGCONT, SIGTERM 0.25 s later and SIGKILL 0.25 s after that (hard-coded in PRRTE's
    ``odls_base_default_kill_local_procs``, no MCA parameter): no step boundary, no checkpoint.
    SIGUSR1, though, mpirun forwards to every rank on every node and kills nobody. So the first
    local rank on mpirun's host (the one whose session owns the terminal) takes the terminal
    while mpirun is in the foreground, and on Ctrl-C sends SIGUSR1 to mpirun (its parent): every
    rank stops at the next step boundary, as under ``tmpi train -n N``. A second Ctrl-C, or
    Ctrl-Z, gives the terminal back and passes the signal to mpirun (which kills, or stops).
    The terminal goes back to mpirun's group when training ends (the shell takes it back
    anyway when mpirun exits). Nothing is done without a terminal, under ``tmpi train -n N``
    (the launcher owns the signals there), or unless mpirun leads the terminal's foreground
    process group (a command typed at the shell, alone or first in a pipeline; not in the
    background, nor under a script or a test runner, whose own Ctrl-C must go on).
    """

    def __init__(self) -> None:
        self.fd = -1
        self.home = 0  # the foreground process group before: mpirun's
        self.mpirun = 0
        self.echoes = 0  # SIGUSR1s that mpirun will send back to this rank: not a 2nd request
        self._old_tstp: Any = None

    @staticmethod
    def wanted() -> bool:
        """A rank of a bare mpirun (not of the launcher), the first one on its host."""
        env = os.environ
        return (
            "OMPI_COMM_WORLD_SIZE" in env
            and "THEANOMPI_LAUNCHER_PID" not in env
            and env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0") == "0"
        )

    def take(self) -> bool:
        """Make this rank's group the terminal's foreground group; False where it does not apply."""
        if self.fd >= 0 or not self.wanted():
            return False
        try:
            fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)  # ENXIO: no controlling terminal
        except OSError:
            return False
        try:
            parent, mine, home = os.getppid(), os.getpgrp(), os.tcgetpgrp(fd)
            if home != parent or mine == home:  # mpirun is not the shell's foreground job (in
                os.close(fd)  # the background, or under a script or a test runner, whose own
                return False  # Ctrl-C must go on), or the ranks share its group
            _set_foreground(fd, mine)
        except OSError:
            os.close(fd)
            return False
        self.fd, self.home, self.mpirun = fd, home, parent
        self._old_tstp = signal.signal(signal.SIGTSTP, self._on_tstp)
        return True

    def give_back(self) -> None:
        """The terminal back to mpirun's group (if this rank still holds it)."""
        if self.fd < 0:
            return
        fd, self.fd = self.fd, -1
        with contextlib.suppress(OSError):
            if os.tcgetpgrp(fd) == os.getpgrp():
                _set_foreground(fd, self.home)
        os.close(fd)
        if self.echoes:  # mpirun's copy of our request still to come: it must not end us
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        if self._old_tstp is not None:
            signal.signal(signal.SIGTSTP, self._old_tstp)
            self._old_tstp = None

    def stop_request(self) -> None:
        """Ctrl-C reached this rank: mpirun forwards SIGUSR1 to every rank (this one included)."""
        self.echoes += 1
        with contextlib.suppress(OSError):
            os.kill(self.mpirun, signal.SIGUSR1)

    def stop_now(self) -> None:
        """A second Ctrl-C: mpirun's own Ctrl-C (it kills the ranks at once)."""
        mpirun = self.mpirun
        self.give_back()
        with contextlib.suppress(OSError):
            os.kill(mpirun, signal.SIGINT)

    def _on_tstp(self, signum: int, frame: Any) -> None:
        """Ctrl-Z: give the terminal back and suspend mpirun's group, as the shell expects."""
        home = self.home
        self.give_back()
        with contextlib.suppress(OSError):
            os.killpg(home, signal.SIGTSTP)


def _set_foreground(fd: int, pgrp: int) -> None:
    """``tcsetpgrp`` from a background group (SIGTTOU blocked, or it would stop this process)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTTOU})
    try:
        os.tcsetpgrp(fd, pgrp)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


#: the terminal this process holds while its outermost StopFlag is entered
TERMINAL = Terminal()


class StopFlag:
    """Turns SIGINT/SIGTERM/SIGUSR1 into a flag that every rank checks at the same step.

    SIGUSR1 is how ``tmpi ... -n N`` passes a Ctrl-C on: mpirun forwards it to every rank
    without killing them (on SIGINT/SIGTERM mpirun kills the ranks 0.25 s later); under a bare
    ``mpirun`` run from a terminal, the outermost flag holds the terminal (:class:`Terminal`)
    so that Ctrl-C reaches a rank, which passes it on to mpirun as SIGUSR1.
    A second signal restores the default behaviour (``KeyboardInterrupt`` at once), except a
    SIGUSR1 within :data:`REPEAT_S` of the first (one Slurm warning delivered twice).
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
        self._asked_at = 0.0
        self._old: dict[int, Any] = {}
        self._entered = False

    def _handler(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGUSR1 and TERMINAL.echoes:  # mpirun's copy of our own request
            TERMINAL.echoes -= 1
            return
        if self.requested:  # second signal: give up waiting for the step boundary
            if signum == signal.SIGUSR1 == self.signum and self._just_asked():
                return  # Slurm's warning, once directly and once through mpirun: one request
            if signum == signal.SIGINT and TERMINAL.fd >= 0:
                TERMINAL.stop_now()  # mpirun kills every rank, as its Ctrl-C does
                return
            self._restore()
            raise KeyboardInterrupt
        self.requested = True
        self.signum = signum
        self._asked_at = time.monotonic()
        if signum == signal.SIGINT and TERMINAL.fd >= 0:
            TERMINAL.stop_request()

    def _just_asked(self) -> bool:
        return time.monotonic() - self._asked_at < REPEAT_S

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
            if not _ACTIVE:  # the outermost: Ctrl-C to this rank, not to a bare mpirun
                TERMINAL.take()
            _ACTIVE.append(self)
            self._entered = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()
        if self._entered:
            _ACTIVE.remove(self)
            self._entered = False
            if not _ACTIVE:
                TERMINAL.give_back()
            if _ACTIVE and self.requested and not _ACTIVE[-1].requested:
                _ACTIVE[-1].requested, _ACTIVE[-1].signum = True, self.signum
