"""A rank's side of the launcher: its watch over the launcher's pid, the stop signal, its placement tag."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = [
    "EXIT_INTERRUPTED",
    "LAUNCHER_HOST_ENV",
    "LAUNCHER_PID_ENV",
    "PLACE_TAG",
    "STOP_SIGNAL",
    "pid_alive",
    "watch_launcher",
]

LAUNCHER_PID_ENV = "THEANOMPI_LAUNCHER_PID"  # the ranks stop when this process is gone
LAUNCHER_HOST_ENV = "THEANOMPI_LAUNCHER_HOST"  # ... if they run on its host
#: mpirun forwards SIGUSR1 to every rank and keeps them alive; on SIGINT/SIGTERM it sends
#: SIGTERM and, 0.25 s later, SIGKILL, too soon for a step boundary and a checkpoint
STOP_SIGNAL = signal.SIGUSR1
WATCH_INTERVAL_S = 0.5
#: a rank's exit on a stop request (Ctrl-C)
EXIT_INTERRUPTED = 130
#: each rank started by the launcher tells it where it runs, through mpirun's stderr (the
#: launcher's pumps swallow these lines), so a lost host can be reported with its ranks
PLACE_TAG = "tmpi-placement:"


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
        sys.stderr.write(f"{PLACE_TAG} rank {rank_from_env()} host {host} pid {os.getpid()}\n")
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
