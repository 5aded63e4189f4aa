"""Per-rank check of the hierarchical exchanger against float64, flat, and across ranks.

Run as ``mpirun -n N python tests/exchange/mpi_hierarchical.py [--group K] [--thread]``.
``--group K`` simulates nodes of K ranks on one machine (rank r is on node r // K); without
it the nodes are the real ones (``COMM_TYPE_SHARED``). For every strategy and compressor of
the registries (as ``mpi_exchange.py``'s cases), both ops and two steps, on every rank:

* the result is within the exchanger's ``error_bound()`` of the float64 reference, updated
  in place, the same bytes on every rank (untouched at N=1);
* it is within the sum of both bounds of the flat exchanger's result on the same inputs;
* with a number of nodes that is not a power of 2, power-of-2 strategies raise
  ``ConfigError`` on every rank, naming the number of leaders.

``--thread`` runs the whole check in a non-main thread (as a communication thread would).
Exits 1 on failure; rank 0 prints one line per case and ``all checks passed``.
"""

from __future__ import annotations

import argparse
import sys
import threading
import traceback
from typing import Any

import mpi4py

mpi4py.rc.thread_level = "multiple"

import mpi_exchange as mx  # noqa: E402  (the flat check's inputs, references, report)
import numpy as np  # noqa: E402


def _run_case(comm: Any, case: str, op: str, node: int | None, refs: dict) -> list[str]:
    """One case and op: hierarchical vs float64, across ranks, and vs flat."""
    from theanompi.comm import is_power_of_two
    from theanompi.errors import ConfigError
    from theanompi.exchange import create_exchanger

    n, rank = comm.Get_size(), comm.Get_rank()
    strategy, compression, options = mx.parse_case(case)
    div = {"mean": n, "sum": 1}[op]
    try:
        ex = create_exchanger(
            strategy, comm, op, compression, hierarchical=True, node=node, **options
        )
    except ConfigError as err:
        msg = str(err)
        if mx.needs_power_of_two(case) and "power-of-2" in msg and "node leaders" in msg:
            if rank == 0:
                print(f"  {case:16s} {op:4s} ConfigError ok: {msg}", flush=True)
            return []
        return [f"{case} {op}: unexpected ConfigError {msg}"]
    fails: list[str] = []
    if mx.needs_power_of_two(case) and not is_power_of_two(getattr(ex, "nodes", 1)):
        return [f"{case} {op}: no ConfigError with {ex.nodes} nodes"]
    flat = None
    if is_power_of_two(n) or not mx.needs_power_of_two(case):
        flat = create_exchanger(strategy, comm, op, compression, **options)
        flat.prepare(mx.inputs(rank, 0))
    ex.prepare(mx.inputs(rank, 0))
    (rtol, atol), worst = ex.error_bound(), 0.0
    for step in range(mx.STEPS):
        arrays = mx.inputs(rank, step)
        ids = [id(a) for a in arrays]
        ex.exchange(arrays)
        if [id(a) for a in arrays] != ids:
            fails.append(f"{case} {op}: arrays replaced, not updated in place")
        if n == 1 and mx.digest(arrays) != mx.digest(mx.inputs(rank, step)):
            fails.append(f"{case} {op}: N=1 changed the arrays")
        ref, mag = refs[step]
        got_flat = None
        if flat is not None:
            got_flat = mx.inputs(rank, step)
            flat.exchange(got_flat)
        frtol, fatol = flat.error_bound() if flat is not None else (0.0, 0.0)
        for i, (a, t, m) in enumerate(zip(arrays, ref, mag, strict=True)):
            bound = (rtol * m + atol * n) / div
            ratio = np.abs(a - t / div) / bound
            j = int(np.argmax(ratio))
            worst = max(worst, float(ratio.flat[j]))
            if not ratio.flat[j] <= 1.0:
                fails.append(
                    f"{case} {op} step {step}: array {i} elem {j} {ratio.flat[j]:.3g}x bound"
                )
            if got_flat is not None:
                both = bound + (frtol * m + fatol * n) / div
                if not np.all(np.abs(a - got_flat[i]) <= both):
                    fails.append(f"{case} {op} step {step}: array {i} differs from flat")
        if len(set(comm.allgather(mx.digest(arrays)))) != 1:
            fails.append(f"{case} {op} step {step}: ranks differ")
    ex.close()
    if rank == 0:
        print(f"  {case:16s} {op:4s} nodes {ex.nodes} max err / bound = {worst:.3f}", flush=True)
    return fails


def _tiny(comm: Any, node: int | None) -> list[str]:
    """A buffer too small to stripe (the leaders exchange it): exact small integers."""
    from theanompi.exchange import create_exchanger

    n, rank = comm.Get_size(), comm.Get_rank()
    ex = create_exchanger("ar", comm, "sum", hierarchical=True, node=node)
    x = [np.arange(7, dtype=np.float32) * (rank + 1)]
    ex.prepare(x)
    ex.exchange(x)
    ex.close()
    want = np.arange(7) * (n * (n + 1) // 2)
    return [] if np.array_equal(x[0], want) else [f"tiny buffer: {x[0]} != {want}"]


def check(comm: Any, cases: list[str], ops: list[str], group: int | None) -> list[str]:
    """Every case and op; this rank's failures."""
    n, rank = comm.Get_size(), comm.Get_rank()
    node = None if group is None else rank // group
    refs = {}
    for s in range(mx.STEPS):
        refs[s] = mx.reference(n, s)
    if rank == 0:
        print(f"N={n} group={group}:", flush=True)
    fails = _tiny(comm, node)
    for case in cases:
        for op in ops:
            fails += _run_case(comm, case, op, node, refs)
    return fails


def main(argv: list[str] | None = None) -> int:
    from mpi4py import MPI

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(c for c in mx.default_cases() if "/" not in c))
    p.add_argument("--ops", default="mean,sum")
    p.add_argument("--group", type=int, default=None)
    p.add_argument("--thread", action="store_true")
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    out: list[Any] = []

    def body() -> None:
        try:
            out.append(check(comm, args.cases.split(","), args.ops.split(","), args.group))
        except Exception:
            traceback.print_exc()
            print(f"rank {comm.Get_rank()}: exception, aborting", file=sys.stderr, flush=True)
            comm.Abort(1)

    if args.thread:
        t = threading.Thread(target=body)
        t.start()
        t.join()
    else:
        body()
    return mx.report(comm, out[0])


if __name__ == "__main__":
    sys.exit(main())
