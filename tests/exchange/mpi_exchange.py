"""Per-rank check of every exchanger against float64 and across ranks; exits 1 on failure.

Run as ``mpirun -n N python tests/exchange/mpi_exchange.py [--names ar,asa16] [--ops mean]``.
Every rank draws its own inputs (seeded by rank and step) of awkward sizes (1, 7, 1000003
elements, 4-D, Fortran-ordered), and recomputes every other rank's to get the exact float64
reference. For each exchanger and op it runs two steps and checks, on every rank:

* the result is within the documented bound of the float64 sum/mean (float32 strategies:
  1e-6 of ``sum |x_r|``; asa16: ``ASA16_RTOL`` of it plus ``ASA16_ATOL``);
* the arrays were updated in place and every rank holds the same bytes (hash via allgather);
* for N not a power of 2, asa32/asa16/copper raise ``ConfigError`` naming N.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import traceback
from typing import Any

import numpy as np

SHAPES: list[tuple[int, ...]] = [
    (1,),
    (7,),
    (1000003,),
    (3, 5, 7, 11),
    (64, 3, 3, 3),
    (4097,),
    (2, 1, 1, 1),
    (13, 9),  # Fortran-ordered below: not contiguous in C order
]
F32_RTOL = 1e-6
STEPS = 2
# extra configurations checked besides every strategy's defaults: name -> (strategy, options)
VARIANTS: dict[str, tuple[str, dict[str, int]]] = {
    "ar/fuse-all/seg777": ("ar", {"fuse_below": 1 << 40, "segment": 777}),
    "ar/no-fusion/seg1000": ("ar", {"fuse_below": 0, "segment": 1000}),
}


_INPUTS: dict[tuple[int, int], list[np.ndarray]] = {}


def draw(rank: int, step: int) -> list[np.ndarray]:
    """Rank's arrays for a step: normal values, one near float16's max, one tiny."""
    rng = np.random.default_rng([rank, step, 12345])
    out = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    out[1] = rng.uniform(-6e4, 6e4, SHAPES[1]).astype(np.float32)  # asa16 must not overflow
    out[4] *= np.float32(1e-5)  # float16 subnormal range after / N
    out[7] = np.asfortranarray(out[7])
    return out


def inputs(rank: int, step: int) -> list[np.ndarray]:
    """A fresh copy of :func:`draw` (cached)."""
    if (rank, step) not in _INPUTS:
        _INPUTS[(rank, step)] = draw(rank, step)
    return [a.copy(order="A") for a in _INPUTS[(rank, step)]]


def reference(n: int, step: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Exact float64 sum over all n ranks, and ``sum_r |x_r|`` (recomputing others' inputs)."""
    tot = [np.zeros(s) for s in SHAPES]
    mag = [np.zeros(s) for s in SHAPES]
    for r in range(n):
        for t, m, x in zip(tot, mag, draw(r, step), strict=True):
            t += x
            m += np.abs(x, dtype=np.float64)
    return tot, mag


def digest(arrays: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def check(comm: Any, names: list[str], ops: list[str]) -> list[str]:
    """Run every check; return this rank's failures (empty when all pass)."""
    from theanompi.comm import is_power_of_two
    from theanompi.errors import ConfigError
    from theanompi.exchange import create_exchanger
    from theanompi.exchange.asa import ASA16_ATOL, ASA16_RTOL

    n, rank = comm.Get_size(), comm.Get_rank()
    fails: list[str] = []
    refs = {}
    for s in range(STEPS):  # exact results and error bounds per op (and float16 or not)
        tot, mag = reference(n, s)
        div = {"mean": n, "sum": 1}
        ref = {op: [t / div[op] for t in tot] for op in ops}
        bounds = {
            (op, half): [
                (ASA16_RTOL * m / div[op] + ASA16_ATOL * n / div[op])
                if half
                else np.maximum(F32_RTOL * m / div[op], 1e-300)
                for m in mag
            ]
            for op in ops
            for half in (False, True)
        }
        refs[s] = (ref, bounds)
    report = []
    for name in names:
        strategy, options = VARIANTS.get(name, (name, {}))
        needs_pow2 = strategy in ("asa32", "asa16", "copper")
        for op in ops:
            try:
                ex = create_exchanger(strategy, comm=comm, op=op, **options)
            except ConfigError as err:
                msg = str(err)
                if not (needs_pow2 and not is_power_of_two(n)):
                    fails.append(f"{name}: unexpected ConfigError {msg}")
                elif f"N={n}" not in msg or "power-of-2" not in msg:
                    fails.append(f"{name}: ConfigError does not name N={n}: {msg}")
                else:
                    report.append(f"{name:20s} {op:4s} ConfigError ok: {msg}")
                continue
            if needs_pow2 and not is_power_of_two(n):
                fails.append(f"{name}: no ConfigError at N={n}")
                continue
            ex.prepare(inputs(rank, 0))
            worst = 0.0
            for step in range(STEPS):
                arrays = inputs(rank, step)
                ids = [id(a) for a in arrays]
                ex.exchange(arrays)
                if [id(a) for a in arrays] != ids:
                    fails.append(f"{name} {op}: arrays replaced, not updated in place")
                ref, bounds = refs[step][0][op], refs[step][1][(op, strategy == "asa16")]
                for i, (a, r, bound) in enumerate(zip(arrays, ref, bounds, strict=True)):
                    if a.dtype != np.float32 or a.shape != r.shape:
                        fails.append(f"{name} {op}: array {i} became {a.dtype}{a.shape}")
                        continue
                    ratio = np.abs(a - r) / bound  # float64
                    j = int(np.argmax(ratio))
                    worst = max(worst, float(ratio.flat[j]))
                    if not ratio.flat[j] <= 1.0:
                        fails.append(
                            f"{name} {op} step {step}: array {i}{a.shape} elem {j}: "
                            f"got {a.flat[j]!r}, want {r.flat[j]!r} "
                            f"(err {ratio.flat[j]:.3g} x the bound {bound.flat[j]:.3g})"
                        )
                hashes = comm.allgather(digest(arrays))
                if len(set(hashes)) != 1:
                    fails.append(
                        f"{name} {op} step {step}: ranks differ ({len(set(hashes))} hashes)"
                    )
            report.append(f"{name:20s} {op:4s} max err / bound = {worst:.3f}")
    if rank == 0:
        print(f"N={n}:\n  " + "\n  ".join(report), flush=True)
    return fails


def main(argv: list[str] | None = None) -> int:
    from mpi4py import MPI

    from theanompi.exchange import STRATEGIES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--names", default=",".join([*STRATEGIES, *VARIANTS]))
    p.add_argument("--ops", default="mean,sum")
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    try:
        fails = check(comm, args.names.split(","), args.ops.split(","))
    except Exception:
        traceback.print_exc()
        print(f"rank {comm.Get_rank()}: exception, aborting", file=sys.stderr, flush=True)
        comm.Abort(1)
        return 1
    for f in fails:
        print(f"rank {comm.Get_rank()}: FAIL {f}", file=sys.stderr, flush=True)
    n_fail = comm.allreduce(len(fails))
    if comm.Get_rank() == 0:
        print("all checks passed" if n_fail == 0 else f"{n_fail} failures", flush=True)
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
