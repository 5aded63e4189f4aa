"""GOSGD's gossip protocol against a float64 numpy replay (run under mpirun, >= 2 ranks).

Every rank starts from its own vector, takes deterministic synthetic "steps"
``x <- x - lr * (x - target(rank, k))`` with a random sleep (so arrival order varies),
and after each step mixes what has arrived and, with probability ``P``, pushes to a random
peer (:class:`~theanompi.rules.gosgd.Gossip`, the code the GOSGD rule runs). Each rank logs
its steps, pushes and mixes in the order it did them; rank 0 then replays every rank's log
in float64 (a mix waits until its push has been replayed) and compares the final vectors,
the gossip weights and the weighted mean. It also checks that every mix keeps the weighted
sum ``sum_i a_i x_i`` and that the weights still sum to 1. Prints OK and exits 0 on success.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI

from theanompi.rules.gosgd import Gossip

LR, P, STEPS, SIZE = 0.1, 0.6, 30, 1000


def start(r: int) -> np.ndarray:
    return np.random.default_rng(100 + r).normal(size=SIZE)


def target(r: int, k: int) -> np.ndarray:
    return np.random.default_rng([r, k]).normal(size=SIZE)


def step(x: np.ndarray, r: int, k: int) -> None:
    x -= x.dtype.type(LR) * (x - target(r, k).astype(x.dtype))


def replay(logs: list[list[tuple]], n: int) -> tuple[list[np.ndarray], list[float], float]:
    """Float64 replay of every rank's log; returns vectors, weights, largest invariant error."""
    x = [start(r) for r in range(n)]
    a = [1.0 / n] * n
    sent: dict[tuple[int, int], tuple[np.ndarray, float]] = {}
    pos = [0] * n
    worst = 0.0
    while any(pos[r] < len(logs[r]) for r in range(n)):
        moved = False
        for r in range(n):
            while pos[r] < len(logs[r]):
                ev = logs[r][pos[r]]
                if ev[0] == "step":
                    step(x[r], r, ev[1])
                elif ev[0] == "send":
                    _, peer, msg, weight = ev
                    a[r] /= 2
                    assert a[r] == weight, (r, msg, a[r], weight)
                    sent[(r, msg)] = (x[r].copy(), a[r])
                else:  # recv: wait until the push is replayed
                    _, src, msg = ev
                    if (src, msg) not in sent:
                        break
                    xs, As = sent.pop((src, msg))
                    before = a[r] * x[r] + As * xs
                    x[r] += As / (a[r] + As) * (xs - x[r])
                    a[r] += As
                    worst = max(worst, float(np.abs(a[r] * x[r] - before).max()))
                pos[r] += 1
                moved = True
        assert moved, "replay stuck: a mix of a push that was never sent"
    assert not sent, f"pushes never mixed: {sorted(sent)}"
    return x, a, worst


def main() -> int:
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    x = start(rank).astype(np.float32)
    g = Gossip(comm, P, seed=5, n=SIZE, record=True)
    jitter = np.random.default_rng(1000 + rank)
    for k in range(STEPS):
        step(x, rank, k)
        g.events.append(("step", k))
        time.sleep(float(jitter.uniform(0, 0.004)))
        peer = g.draw()
        g.receive(x)
        if peer is not None:
            g.push(x, peer)
    g.drain(x)
    mean = g.weighted_mean(x)
    logs = comm.gather(g.events, root=0)
    finals = comm.gather((x, g.weight, g.pushes, g.skipped), root=0)
    if rank != 0:
        return 0
    x64, a64, worst = replay(logs, n)
    pushes = sum(f[2] for f in finals)
    assert pushes >= n, f"too few pushes to test anything: {pushes}"
    for r, (xr, ar, _, _) in enumerate(finals):
        assert ar == a64[r], (r, ar, a64[r])
        np.testing.assert_allclose(xr, x64[r], rtol=1e-5, atol=1e-5, err_msg=f"rank {r}")
    assert abs(sum(a64) - 1.0) < 1e-12, sum(a64)
    assert worst < 1e-12, f"a mix changed the weighted sum by {worst}"
    ref = sum(ar * xr for ar, xr in zip(a64, x64, strict=True)) / sum(a64)
    np.testing.assert_allclose(mean, ref, rtol=1e-5, atol=1e-5)
    print(f"OK pushes={pushes} skipped={sum(f[3] for f in finals)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
