"""Per-rank program: :class:`~theanompi.exchange.polling.PollingComm`'s calls give the bytes of
mpi4py's blocking ones, and a thread waiting in one sleeps (no core, no GIL) while its peer is
late. Prints ``OK`` lines on rank 0 and exits non-zero on any failure.

``python mpi_polling.py``
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from theanompi.exchange.polling import PollingComm, _poller  # noqa: E402

LATE_S = 0.6  # how late the last rank joins the timed collectives


def check(name: str, ok: bool, detail: str = "") -> None:
    if not ok:
        print(f"FAIL rank {comm.rank} {name} {detail}", flush=True)
        comm.Abort(1)
    if comm.rank == 0:
        print(f"OK {name} {detail}", flush=True)


def same_as_blocking() -> None:
    """Every call the exchangers make, against the blocking call on the same inputs."""
    rng = np.random.default_rng(comm.rank)
    x = rng.integers(-1000, 1000, 10_001).astype(np.float32)  # exact sums in any order
    a, b = x.copy(), x.copy()
    comm.Allreduce(MPI.IN_PLACE, a)
    pc.Allreduce(MPI.IN_PLACE, b)
    check("Allreduce", a.tobytes() == b.tobytes())
    n = comm.size
    x = rng.standard_normal(n * 1000).astype(np.float32)
    a, b = np.empty_like(x), np.empty_like(x)
    comm.Alltoall(x, a)
    pc.Alltoall(x, b)
    check("Alltoall", a.tobytes() == b.tobytes())
    a, b = x.copy(), x.copy()
    comm.Allgather(MPI.IN_PLACE, a)
    pc.Allgather(MPI.IN_PLACE, b)
    check("Allgather", a.tobytes() == b.tobytes())
    a = x.copy()
    pc.Bcast(a, root=n - 1)
    ref = comm.bcast(x if comm.rank == n - 1 else None, root=n - 1)
    check("Bcast", a.tobytes() == ref.tobytes())
    right, left = (comm.rank + 1) % n, (comm.rank - 1) % n
    got = np.empty_like(x)
    if comm.rank % 2 == 0:
        pc.Send(x, right, tag=3)
        pc.Recv(got, left, tag=3)
    else:
        pc.Recv(got, left, tag=3)
        pc.Send(x, right, tag=3)
    left_rng = np.random.default_rng(left)
    left_rng.integers(-1000, 1000, 10_001)
    want = left_rng.standard_normal(n * 1000).astype(np.float32)
    check("Send/Recv", got.tobytes() == want.tobytes())
    node = pc.Split(comm.rank % 2, comm.rank)
    check(
        "Split",
        isinstance(node, PollingComm) and node.Get_size() == len(range(comm.rank % 2, n, 2)),
    )
    none = pc.Split(MPI.UNDEFINED if comm.rank else 0, 0)
    check("Split undefined", (none == MPI.COMM_NULL) == (comm.rank != 0))
    for c in (node, none):
        if c != MPI.COMM_NULL:
            c.Free()


def waits_asleep() -> None:
    """The first ranks wait for a late one on a thread, in a polling barrier; meanwhile this
    thread counts in Python: it keeps the GIL and a core, the waiting thread takes neither."""
    late = comm.rank == comm.size - 1
    comm.Barrier()
    if late:
        time.sleep(LATE_S)
    cpu = [0.0]
    done = threading.Event()

    def waiter() -> None:
        t0 = time.thread_time()
        pc.Barrier()
        cpu[0] = time.thread_time() - t0
        done.set()

    count, wall = count_until(done, threading.Thread(target=waiter))
    solo, solo_wall = count_until(threading.Event(), None, LATE_S / 2)
    if not late:
        # a spinning wait would use the whole interval; the poller wakes every 100 us
        check("polling wait CPU", cpu[0] < 0.25 * wall, f"{cpu[0]:.3f} s CPU in {wall:.3f} s")
        # a wait holding the GIL would leave the loop ~0 turns; one without runs at its rate
        ratio = (count / wall) / (solo / solo_wall)
        check("polling wait GIL", ratio > 0.3, f"counting at {ratio:.2f} of its solo rate")


def count_until(
    done: threading.Event, thread: threading.Thread | None, after_s: float = 0.0
) -> tuple[int, float]:
    """Count loop turns (in Python: it needs the GIL) until ``done`` is set, by ``thread``
    or by a timer after ``after_s``; returns the turns and the seconds."""
    starter = thread or threading.Timer(after_s, done.set)
    t0 = time.perf_counter()
    starter.start()
    count = 0
    while not done.is_set():
        count += 1
    wall = time.perf_counter() - t0
    starter.join()
    return count, wall


comm = MPI.COMM_WORLD
check("poller compiled", _poller() is not None)
pc = PollingComm(comm.Dup())
same_as_blocking()
waits_asleep()
pc.Free()
