"""EASGD exchange protocol against a float64 numpy replay (run under mpirun, >= 2 ranks).

Rank 0 serves; every worker starts from the centre, takes deterministic synthetic
"steps" ``w <- w - lr * (w - target_k)`` with a random sleep (so arrival order
varies), and does the elastic exchange every ``avg_freq`` steps. The server logs
the order in which it served the exchanges; rank 0 then replays exactly that
order in float64 and compares the final centre and every worker's final params.
Exit code 0 on success.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI

from theanompi.rules.easgd import EASGDServer, EASGDWorker

ALPHA, LR, STEPS, AVG_FREQ, SIZE = 0.3, 0.1, 24, 3, 1000


def target(k: int) -> np.ndarray:
    return np.random.default_rng(100 + k).normal(size=SIZE)


def step(w: np.ndarray, k: int) -> None:
    """One deterministic local step of worker k (float32 on the workers, float64 in the replay)."""
    w -= w.dtype.type(LR) * (w - target(k).astype(w.dtype))


def main() -> int:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    init = np.random.default_rng(7).normal(size=SIZE)
    if rank == 0:
        centre = init.astype(np.float32)
        server = EASGDServer(comm, centre, ALPHA, record_order=True)
        stats = server.serve()
        order = server.order
    else:
        w = init.astype(np.float32)
        worker = EASGDWorker(comm, ALPHA)
        jitter = np.random.default_rng(rank)
        for s in range(1, STEPS + 1):
            step(w, rank)
            time.sleep(float(jitter.uniform(0, 0.004)))
            if s % AVG_FREQ == 0:
                worker.exchange(w, step=s)
        worker.done()
    finals = comm.gather(None if rank == 0 else w, root=0)
    if rank != 0:
        return 0

    # float64 replay in the server's order
    c = init.copy()
    ws = {k: init.copy() for k in range(1, size)}
    at = dict.fromkeys(ws, 0)  # steps taken so far per worker
    for k, s in order:
        while at[k] < s:
            at[k] += 1
            step(ws[k], k)
        d = ALPHA * (ws[k] - c)
        ws[k] -= d
        c += d
    for k in ws:  # steps after the last exchange
        while at[k] < STEPS:
            at[k] += 1
            step(ws[k], k)
    n_ex = STEPS // AVG_FREQ
    ok = all(stats["exchanges"][k] == n_ex for k in ws) and len(order) == n_ex * (size - 1)
    err_c = float(np.max(np.abs(centre - c)))
    err_w = max(float(np.max(np.abs(finals[k] - ws[k]))) for k in ws)
    srcs = [k for k, _ in order]
    print(
        f"exchanges={stats['exchanges']} order={srcs} max|centre-ref|={err_c:.2e} "
        f"max|worker-ref|={err_w:.2e}",
        flush=True,
    )
    if not ok or err_c > 1e-5 or err_w > 1e-5:
        print("FAIL", flush=True)
        return 1
    print("OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
