"""The stall watchdog's cost at N ranks: heartbeat messages per interval and CPU per rank.

Run under mpirun (``--impl`` loads another copy of ``watchdog.py``, e.g. an older one from
git, to compare side by side)::

    mpirun -n 16 --oversubscribe python pipelines/watchdog_load.py --seconds 10
    git show REV:theanompi/launch/watchdog.py > /tmp/old_watchdog.py
    mpirun -n 16 --oversubscribe python pipelines/watchdog_load.py --impl /tmp/old_watchdog.py

Every rank runs the watchdog's thread (not armed: no stall is judged) while its main thread
sleeps; the messages are counted by a wrapper around the watchdog's communicator, and the CPU
is the process's (``time.process_time``) over the window, less the same window without a
watchdog. Rank 0 prints one line per interval asked.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from typing import Any

from mpi4py import MPI


class _Counting:
    """The watchdog's communicator, counting what it sends (isend/send) and receives."""

    def __init__(self, comm: Any) -> None:
        self._comm, self.sent, self.received = comm, 0, 0

    def isend(self, *args: Any, **kwargs: Any) -> Any:
        self.sent += 1
        return self._comm.isend(*args, **kwargs)

    def send(self, *args: Any, **kwargs: Any) -> Any:
        self.sent += 1
        return self._comm.send(*args, **kwargs)

    def recv(self, *args: Any, **kwargs: Any) -> Any:
        self.received += 1
        return self._comm.recv(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)


def _watchdog_class(impl: str | None) -> Any:
    if impl is None:
        from theanompi.launch.watchdog import Watchdog

        return Watchdog
    spec = importlib.util.spec_from_file_location("watchdog_under_test", impl)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Watchdog


def measure(cls: Any, comm: Any, interval: float, seconds: float) -> dict[str, float]:
    """One window: this rank's messages sent and CPU seconds, with and without a watchdog."""
    comm.Barrier()
    c0 = time.process_time()
    time.sleep(seconds)
    idle = time.process_time() - c0
    wd = cls(comm, 300.0, interval=interval)
    counting = _Counting(wd.comm)
    wd.comm = counting
    beat, ticks = wd._beat, [0]

    def counted_beat(now: float) -> Any:  # once per interval in every version of the thread
        ticks[0] += 1
        return beat(now)

    wd._beat = counted_beat
    comm.Barrier()
    c0, t0 = time.process_time(), time.monotonic()
    wd.start()
    time.sleep(seconds)
    wd.close()
    cpu, wall = time.process_time() - c0, time.monotonic() - t0
    return {
        "sent": counting.sent,
        "received": counting.received,
        "ticks": ticks[0],
        "cpu": cpu - idle,
        "wall": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--intervals", type=float, nargs="+", default=[1.0, 0.1])
    ap.add_argument("--impl", help="path of another watchdog.py to measure")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    cls = _watchdog_class(args.impl)
    n = comm.Get_size()
    for interval in args.intervals:
        mine = measure(cls, comm, interval, args.seconds)
        every = comm.gather(mine, root=0)
        if comm.Get_rank() != 0:
            continue
        per = [(m["sent"] / m["ticks"], m["received"] / m["ticks"]) for m in every]
        cpu_ms = [1000 * m["cpu"] / m["wall"] for m in every]
        print(
            f"N={n} interval {interval:g} s: {sum(s for s, _ in per):.1f} messages per "
            f"interval in the job (N(N-1)={n * (n - 1)}, 2(N-1)={2 * (n - 1)}); a rank sends "
            f"{statistics.median(s for s, _ in per):.1f} (median) to {max(s for s, _ in per):.1f} "
            f"(max) and receives up to {max(r for _, r in per):.1f}; CPU above idle "
            f"{statistics.median(cpu_ms):.2f} ms/s per rank (median), {max(cpu_ms):.2f} (max)",
            flush=True,
        )


if __name__ == "__main__":
    main()
