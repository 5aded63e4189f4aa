"""A slow EASGD worker must not block a fast one (run under mpirun -n 3).

Worker 1 sleeps ``SLOW_S`` per step, worker 2 only ``FAST_S``; both exchange every step for
``WINDOW_S`` seconds of wall time. With arrival-order serving the fast worker completes
many more exchanges; a server that served workers in turn would hold both to the slow pace.
Prints ``exchanges={rank: count}``; exit 0 when fast >= 2 * slow + 2 (a server serving
workers in turn would allow at most slow + 1).
"""

from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI

from theanompi.rules.easgd import EASGDServer, EASGDWorker

SLOW_S, FAST_S, WINDOW_S = 0.4, 0.002, 2.0


def main() -> int:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    buf = np.zeros(10_000, dtype=np.float32)
    comm.Barrier()
    if rank == 0:
        stats = EASGDServer(comm, buf, 0.5).serve()
    else:
        worker = EASGDWorker(comm, 0.5)
        pause = SLOW_S if rank == 1 else FAST_S
        t_end = MPI.Wtime() + WINDOW_S
        s = 0
        while MPI.Wtime() < t_end:
            time.sleep(pause)
            buf += 1.0
            s += 1
            worker.exchange(buf, step=s)
        worker.done()
    if rank == 0:
        ex = stats["exchanges"]
        print(f"exchanges={ex}", flush=True)
        return 0 if ex[2] >= 2 * ex[1] + 2 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
