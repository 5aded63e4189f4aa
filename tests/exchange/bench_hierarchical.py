"""Flat vs hierarchical exchange time of one buffer, side by side; rank 0 prints medians.

Run as ``mpirun -n N python tests/exchange/bench_hierarchical.py [--mb 13] [--repeats 7]
[--strategy ar] [--compression none] [--group K] [--poll-ms MS]``. Each repeat times one flat and one
hierarchical exchange (alternating, between barriers, ``MPI.Wtime``), after one warm-up each.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import mpi4py

mpi4py.rc.thread_level = "multiple"

import numpy as np  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from mpi4py import MPI

    from theanompi.exchange import create_exchanger

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=13.2)  # the widened digits CNN: 3.3 M float32
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--strategy", default="ar")
    p.add_argument("--compression", default="none")
    p.add_argument("--group", type=int, default=None)
    p.add_argument("--poll-ms", type=float, default=None)  # HierarchicalExchanger's poll_s
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    node = None if args.group is None else rank // args.group
    count = int(args.mb * 1e6 / 4)
    x = np.random.default_rng(rank).standard_normal(count).astype(np.float32)
    poll = {} if args.poll_ms is None else {"poll_s": args.poll_ms / 1e3}
    leader = {"striped": False}
    kinds = {
        "flat": create_exchanger(args.strategy, comm, compression=args.compression),
        "hierarchical": create_exchanger(
            args.strategy, comm, compression=args.compression, hierarchical=True, node=node, **poll
        ),
        "leader": create_exchanger(
            args.strategy,
            comm,
            compression=args.compression,
            hierarchical=True,
            node=node,
            **poll,
            **leader,
        ),
    }
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for ex in kinds.values():
        ex.prepare([x])
        ex.exchange([x.copy()])  # warm-up
    for _ in range(args.repeats):
        for kind, ex in kinds.items():
            buf = x.copy()
            comm.Barrier()
            t0 = MPI.Wtime()
            ex.exchange([buf])
            comm.Barrier()
            times[kind].append(MPI.Wtime() - t0)
    if rank == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        spread = {k: f"{min(v) * 1e3:.0f}-{max(v) * 1e3:.0f}" for k, v in times.items()}
        print(
            f"N={comm.Get_size()} {count * 4 / 1e6:.1f} MB {args.strategy}/{args.compression}, "
            f"median of {args.repeats}: flat {med['flat']:.0f} ms ({spread['flat']}), "
            f"hierarchical {med['hierarchical']:.0f} ms ({spread['hierarchical']}), "
            f"leader-only {med['leader']:.0f} ms ({spread['leader']}), "
            f"ratio {med['hierarchical'] / med['flat']:.2f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
