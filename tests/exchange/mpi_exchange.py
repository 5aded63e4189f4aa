"""Per-rank check of every exchanger against float64 and across ranks; exits 1 on failure.

Run as ``mpirun -n N python tests/exchange/mpi_exchange.py [--cases ar,ar+fp16] [--ops mean]``.
The cases are every strategy of the registry (``theanompi.exchange.STRATEGIES``), each again
with every compressor of ``COMPRESSORS`` unless its name implies one (``name+fp16``), and the
:data:`VARIANTS`. Every rank draws its own inputs (seeded by rank and step) of awkward sizes
(1, 7, 1000003 elements, 4-D, Fortran-ordered), and recomputes every other rank's to get the
exact float64 reference. For each case and op it runs two steps and checks, on every rank:

* the result is within the exchanger's own ``error_bound()`` of the float64 sum/mean;
* the arrays were updated in place and every rank holds the same bytes (hash via allgather);
  with one rank, the arrays are untouched;
* cases that are the same algorithm and compression under two names (``asa16`` and
  ``asa32+fp16``) give the same bytes;
* for N not a power of 2, strategies with ``requires_power_of_two`` raise ``ConfigError``
  naming N.
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
    (4,),  # float16's extremes, the same on every rank
]
STEPS = 2
# extra configurations checked besides every strategy's defaults:
# name -> (strategy, compression, options)
VARIANTS: dict[str, tuple[str, str, dict[str, int]]] = {
    "ar/fuse-all/seg777": ("ar", "none", {"fuse_below": 1 << 40, "segment": 777}),
    "ar/no-fusion/seg1000": ("ar", "none", {"fuse_below": 0, "segment": 1000}),
    "ar+fp16/seg777": ("ar", "fp16", {"segment": 777}),
}


def default_cases() -> list[str]:
    """Every strategy, again with every compressor its name does not imply, and the variants."""
    from theanompi.exchange import STRATEGIES
    from theanompi.exchange.compression import COMPRESSORS

    cases = []
    for name in STRATEGIES:
        cases.append(name)
        if STRATEGIES.get(name).implied_compression is None:
            cases += [f"{name}+{c}" for c in COMPRESSORS if c != "none"]
    return cases + list(VARIANTS)


def parse_case(case: str) -> tuple[str, str, dict[str, int]]:
    """``(strategy, compression, options)`` of a case name (``ar``, ``ar+fp16``, a variant)."""
    if case in VARIANTS:
        return VARIANTS[case]
    strategy, _, compression = case.partition("+")
    return strategy, compression or "none", {}


def needs_power_of_two(case: str) -> bool:
    from theanompi.exchange import STRATEGIES

    return STRATEGIES.get(parse_case(case)[0]).requires_power_of_two


_INPUTS: dict[tuple[int, int], list[np.ndarray]] = {}


def draw(rank: int, step: int) -> list[np.ndarray]:
    """Rank's arrays for a step: normal values, two near float16's max, one tiny."""
    rng = np.random.default_rng([rank, step, 12345])
    out = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    out[1] = rng.uniform(-6e4, 6e4, SHAPES[1]).astype(np.float32)  # asa16 must not overflow
    out[4] *= np.float32(1e-5)  # float16 subnormal range after / N
    out[7] = np.asfortranarray(out[7])
    # 65504 / 3 rounds up to float16 21840 and 3 * 21840 = 65520 would round to inf
    out[8] = np.array([65504, -65504, 65504, 2.0**-24], np.float32)
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


def _same_algorithm_key(ex: Any, options: dict[str, int]) -> tuple[Any, ...]:
    """Cases with equal keys must give equal bytes: the most basic registered class among
    the exchanger's bases (``Asa16Exchanger`` is an ``Asa32Exchanger``), compression, options."""
    from theanompi.exchange import STRATEGIES

    registered = {STRATEGIES.get(name) for name in STRATEGIES}
    base = [c for c in type(ex).__mro__ if c in registered][-1]
    return base, ex.compressor.name, tuple(sorted(options.items()))


def check(comm: Any, cases: list[str], ops: list[str]) -> list[str]:
    """Run every check; return this rank's failures (empty when all pass)."""
    from theanompi.comm import is_power_of_two
    from theanompi.errors import ConfigError
    from theanompi.exchange import create_exchanger

    n, rank = comm.Get_size(), comm.Get_rank()
    fails: list[str] = []
    div = {"mean": n, "sum": 1}
    refs = {}
    for s in range(STEPS):  # exact results, and sum_r |x_r| for the error bounds
        tot, mag = reference(n, s)
        refs[s] = ({op: [t / div[op] for t in tot] for op in ops}, mag)
    report = []
    results: dict[tuple[Any, ...], tuple[str, str]] = {}  # same-algorithm key -> (case, hash)
    for case in cases:
        strategy, compression, options = parse_case(case)
        needs_pow2 = needs_power_of_two(case)
        for op in ops:
            try:
                ex = create_exchanger(
                    strategy, comm=comm, op=op, compression=compression, **options
                )
            except ConfigError as err:
                msg = str(err)
                if not (needs_pow2 and not is_power_of_two(n)):
                    fails.append(f"{case}: unexpected ConfigError {msg}")
                elif f"N={n}" not in msg or "power-of-2" not in msg:
                    fails.append(f"{case}: ConfigError does not name N={n}: {msg}")
                else:
                    report.append(f"{case:20s} {op:4s} ConfigError ok: {msg}")
                continue
            if needs_pow2 and not is_power_of_two(n):
                fails.append(f"{case}: no ConfigError at N={n}")
                continue
            ex.prepare(inputs(rank, 0))
            rtol, atol = ex.error_bound()
            worst = 0.0
            for step in range(STEPS):
                arrays = inputs(rank, step)
                ids = [id(a) for a in arrays]
                ex.exchange(arrays)
                if [id(a) for a in arrays] != ids:
                    fails.append(f"{case} {op}: arrays replaced, not updated in place")
                if n == 1 and digest(arrays) != digest(inputs(rank, step)):
                    fails.append(f"{case} {op}: N=1 changed the arrays")
                ref, mag = refs[step][0][op], refs[step][1]
                for i, (a, r, m) in enumerate(zip(arrays, ref, mag, strict=True)):
                    if a.dtype != np.float32 or a.shape != r.shape:
                        fails.append(f"{case} {op}: array {i} became {a.dtype}{a.shape}")
                        continue
                    bound = (rtol * m + atol * n) / div[op]
                    ratio = np.abs(a - r) / bound  # float64
                    j = int(np.argmax(ratio))
                    worst = max(worst, float(ratio.flat[j]))
                    if not ratio.flat[j] <= 1.0:
                        fails.append(
                            f"{case} {op} step {step}: array {i}{a.shape} elem {j}: "
                            f"got {a.flat[j]!r}, want {r.flat[j]!r} "
                            f"(err {ratio.flat[j]:.3g} x the bound {bound.flat[j]:.3g})"
                        )
                h = digest(arrays)
                hashes = comm.allgather(h)
                if len(set(hashes)) != 1:
                    fails.append(
                        f"{case} {op} step {step}: ranks differ ({len(set(hashes))} hashes)"
                    )
                key = (*_same_algorithm_key(ex, options), op, step)
                other, h0 = results.setdefault(key, (case, h))
                if h0 != h:
                    fails.append(f"{case} {op} step {step}: bytes differ from {other}'s")
            report.append(f"{case:20s} {op:4s} rtol {rtol:.2e}  max err / bound = {worst:.3f}")
    if rank == 0:
        print(f"N={n}:\n  " + "\n  ".join(report), flush=True)
    return fails


def main(argv: list[str] | None = None) -> int:
    from mpi4py import MPI

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(default_cases()))
    p.add_argument("--ops", default="mean,sum")
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    try:
        fails = check(comm, args.cases.split(","), args.ops.split(","))
    except Exception:
        traceback.print_exc()
        print(f"rank {comm.Get_rank()}: exception, aborting", file=sys.stderr, flush=True)
        comm.Abort(1)
        return 1
    return report(comm, fails)


def report(comm: Any, fails: list[str]) -> int:
    """Each rank's failures on stderr, ``all checks passed`` (or the count over ranks) from
    rank 0; the exit code, 1 when any rank failed (collective; ``mpi_hierarchical.py`` too)."""
    for f in fails:
        print(f"rank {comm.Get_rank()}: FAIL {f}", file=sys.stderr, flush=True)
    n_fail = comm.allreduce(len(fails))
    if comm.Get_rank() == 0:
        print("all checks passed" if n_fail == 0 else f"{n_fail} failures", flush=True)
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
