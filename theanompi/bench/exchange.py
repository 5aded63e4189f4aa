"""Benchmark the BSP exchangers against per-array Allreduce, torch gloo and memcpy.

``python -m theanompi.bench.exchange`` relaunches itself under ``mpirun -n 2`` and ``-n 4``
(``--sizes``), times one ``exchange()`` of AlexNet's 16 parameter arrays (61 M floats) and of
a small 1 M-float set for every case, and prints one table of medians: seconds per
exchange, algorithm bandwidth (float32 parameter bytes / s) and bus bandwidth as nccl-tests
defines it for allreduce (``algbw * 2(N-1)/N``), plus this machine's memcpy bandwidth and
the ratios asked for in the issue. Under mpirun already, it benchmarks that N only.
Across hosts (``tmpi bench exchange --hostfile FILE --sizes 4``, or ``-H``), a first row gives
the link's own bandwidth, a plain MPI ping-pong between rank 0 and the last rank, and every
strategy's busbw is also shown as a fraction of it.

The cases come from the registry (:func:`default_cases`): every strategy of
``theanompi.exchange.STRATEGIES``, each compressed strategy again as ``name+fp16`` (one
row per compressor of ``COMPRESSORS`` that no other registered name already is, so
``asa32+fp16`` is left to ``asa16``), and torch's ``gloo``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from theanompi.comm import under_mpirun
from theanompi.errors import ConfigError

__all__ = ["main", "alexnet_shapes", "small_shapes", "default_cases", "parse_case", "pingpong"]

GLOO = "gloo"  # torch.distributed's all_reduce, the outside reference (not one of ours)
SMALL_SET = 8_000_000  # floats: sets below take milliseconds per exchange, so ...
SMALL_SET_REPS = 10  # ... they get this many times --reps (a steadier median at little cost)
PINGPONG = "pingpong"  # the row of the link's own bandwidth (set "link")
PINGPONG_FLOATS = 16_000_000  # 64 MB a message: bandwidth-bound on any network


def alexnet_shapes() -> list[tuple[int, ...]]:
    """The 16 parameter arrays of AlexNet (Krizhevsky 2012, two-tower groups; 60,965,224)."""
    return [
        (96, 3, 11, 11), (96,), (256, 48, 5, 5), (256,), (384, 256, 3, 3), (384,),
        (384, 192, 3, 3), (384,), (256, 192, 3, 3), (256,),
        (4096, 9216), (4096,), (4096, 4096), (4096,), (1000, 4096), (1000,),
    ]  # fmt: skip


def small_shapes() -> list[tuple[int, ...]]:
    """A small CNN: 24 conv 64x64x3x3 layers with biases and a classifier (~1 M floats)."""
    shapes: list[tuple[int, ...]] = []
    for _ in range(24):
        shapes += [(64, 64, 3, 3), (64,)]
    return shapes + [(100, 1136), (100,)]


SETS: dict[str, Callable[[], list[tuple[int, ...]]]] = {
    "alexnet": alexnet_shapes,
    "small": small_shapes,
}


def parse_case(case: str) -> tuple[str, str]:
    """``(strategy, compression)`` of a case name: ``"ar"`` or ``"ar+fp16"``.

    Raises the registries' one-line :class:`~theanompi.errors.ConfigError` for unknown names.

    >>> parse_case("copper+fp16")
    ('copper', 'fp16')
    """
    from theanompi.exchange import STRATEGIES
    from theanompi.exchange.compression import COMPRESSORS

    name, _, compression = case.partition("+")
    STRATEGIES.get(name)
    COMPRESSORS.get(compression or "none")
    return name, compression or "none"


def _registered_as(name: str, compression: str) -> str | None:
    """The registered name that already is ``name`` with ``compression`` (``asa16`` for
    ``asa32+fp16``: a subclass that implies it), or None."""
    from theanompi.exchange import STRATEGIES

    cls = STRATEGIES.get(name)
    for other in STRATEGIES:
        o = STRATEGIES.get(other)
        if other != name and issubclass(o, cls) and o.implied_compression == compression:
            return other
    return None


def default_cases() -> list[str]:
    """Every registered strategy, ``name+<compressor>`` for those whose name implies none
    (baselines only uncompressed; combinations another name already is skipped), gloo."""
    from theanompi.exchange import STRATEGIES
    from theanompi.exchange.compression import COMPRESSORS

    cases = []
    for name in STRATEGIES:
        cls = STRATEGIES.get(name)
        cases.append(name)
        if cls.implied_compression is None and not cls.baseline:
            cases += [
                f"{name}+{c}"
                for c in COMPRESSORS
                if c != "none" and _registered_as(name, c) is None
            ]
    return [*cases, GLOO]


def _uncompressed(case: str) -> str | None:
    """The float32 case a compressed one is compared with: ``ar`` for ``ar+fp16``, ``asa32``
    for ``asa16`` (the registered base class it compresses); None for float32 cases."""
    from theanompi.exchange import STRATEGIES

    if case == GLOO:
        return None
    name, compression = parse_case(case)
    if compression != "none":
        return name
    cls = STRATEGIES.get(name)
    if cls.implied_compression in (None, "none"):
        return None
    bases = [n for n in STRATEGIES if n != name and issubclass(cls, STRATEGIES.get(n))]
    return bases[0] if bases else None


def memcpy_bandwidth(nbytes: int, reps: int = 5) -> float:
    """Median bytes/s of ``np.copyto`` of an ``nbytes`` buffer (one process, warm pages)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        ts.append(time.perf_counter() - t)
    return src.nbytes / float(np.median(ts))


# -- worker (one rank under mpirun) ------------------------------------------------------


def _gloo_group(comm: Any) -> Any:
    """Start torch.distributed (gloo) on the same ranks; a string saying why not when torch is
    missing or the ranks span hosts (its rendezvous here is on 127.0.0.1)."""
    if len(set(comm.allgather(socket.gethostname()))) > 1:
        return "single host only"
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return "torch not installed"
    torch.set_num_threads(1)
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=comm.Get_rank(), world_size=comm.Get_size())
    return dist


class _GlooExchanger:
    """torch.distributed gloo ``all_reduce`` of every array in place, then divide (mean)."""

    def __init__(self, dist: Any, size: int) -> None:
        import torch

        self.dist, self.size, self.torch = dist, size, torch

    def prepare(self, arrays: list[np.ndarray]) -> None:
        pass

    def exchange(self, arrays: list[np.ndarray]) -> None:
        for a in arrays:
            t = self.torch.from_numpy(a)
            self.dist.all_reduce(t)
            t.div_(self.size)


def _time_round_robin(
    comm: Any, cases: dict[str, Any], arrays: list[np.ndarray], reps: int
) -> dict[str, float]:
    """Median seconds of ``ex.exchange(arrays)`` per case, timed between barriers.

    The cases take turns (one exchange each per round, after one warm-up round), so a
    change in machine load hits every strategy alike, and the order rotates every round, so
    that no case always runs right after the same one.
    """
    from mpi4py import MPI

    for ex in cases.values():
        ex.prepare(arrays)
        ex.exchange(arrays)
    times: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for r in range(reps):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            ex = cases[name]
            comm.Barrier()
            t = MPI.Wtime()
            ex.exchange(arrays)
            comm.Barrier()
            times[name].append(MPI.Wtime() - t)
    times = comm.bcast(times, root=0)
    return {name: float(np.median(ts)) for name, ts in times.items()}


def pingpong(comm: Any, count: int = PINGPONG_FLOATS, reps: int = 5) -> dict[str, Any] | None:
    """The link's own bandwidth: plain ``Send``/``Recv`` of ``count`` float32 between rank 0
    and the last rank (on another host when the job spans hosts); median one-way seconds."""
    import socket

    from mpi4py import MPI

    n, rank = comm.Get_size(), comm.Get_rank()
    hosts = comm.allgather(socket.gethostname())
    if n < 2:
        return None
    last = n - 1

    def one_way(buf: np.ndarray, rounds: int) -> float:
        times = []
        for _ in range(rounds + 1):  # the first round warms the connection up
            comm.Barrier()
            t = MPI.Wtime()
            if rank == 0:
                comm.Send(buf, dest=last, tag=7)
                comm.Recv(buf, source=last, tag=8)
            elif rank == last:
                comm.Recv(buf, source=0, tag=7)
                comm.Send(buf, dest=0, tag=8)
            times.append((MPI.Wtime() - t) / 2)
        return float(np.median(comm.bcast(times[1:], root=0)))

    latency = one_way(np.ones(2, np.float32), 50)
    seconds = one_way(np.ones(count, np.float32), reps)
    return {
        "set": "link",
        "n": n,
        "strategy": PINGPONG,
        "count": count,
        "reps": reps,
        "seconds": seconds,
        "latency": latency,
        "note": f"MPI Send/Recv rank 0 ({hosts[0]}) <-> rank {last} ({hosts[last]}), one way; "
        f"8 B: {latency * 1e6:.0f} us",
    }


def worker(strategies: list[str], sets: list[str], reps: int) -> list[dict[str, Any]]:
    """Time every strategy on every set on COMM_WORLD; the same rows on every rank (and, first,
    the link's ping-pong bandwidth)."""
    from mpi4py import MPI

    from theanompi.exchange import create_exchanger
    from theanompi.exchange._kernels import kernels

    comm = MPI.COMM_WORLD
    n, rank = comm.Get_size(), comm.Get_rank()
    backend = kernels().backend
    dist = _gloo_group(comm) if GLOO in strategies else None
    no_gloo = dist if isinstance(dist, str) else ""
    dist = None if no_gloo else dist
    link = pingpong(comm, reps=reps)
    rows = [link] if link else []
    for set_name in sets:
        rng = np.random.default_rng(rank)
        arrays = [rng.standard_normal(s, dtype=np.float32) * 0.01 for s in SETS[set_name]()]
        count = sum(a.size for a in arrays)
        cases: dict[str, Any] = {}
        notes: dict[str, str] = {}
        for name in strategies:
            if name == GLOO:
                if dist is None:
                    notes[name] = no_gloo
                else:
                    cases[name] = _GlooExchanger(dist, n)
                continue
            strategy, compression = parse_case(name)
            try:
                ex = create_exchanger(strategy, comm=comm, op="mean", compression=compression)
            except Exception as err:  # e.g. ConfigError for N not a power of 2
                notes[name] = str(err)
                continue
            cases[name] = ex
            if not ex.compressor.in_place:
                notes[name] = f"{ex.compressor.name} kernels: {backend}"
        t0 = MPI.Wtime()
        set_reps = reps * SMALL_SET_REPS if count < SMALL_SET else reps
        ours = {name: ex for name, ex in cases.items() if name != GLOO}
        seconds = _time_round_robin(comm, ours, arrays, set_reps)
        if GLOO in cases:  # on its own: its threads, still winding down after each call,
            # slowed whichever strategy ran next by up to 20% on the small set
            seconds |= _time_round_robin(comm, {GLOO: cases[GLOO]}, arrays, reps)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        for name in strategies:
            row: dict[str, Any] = {
                "set": set_name,
                "n": n,
                "strategy": name,
                "count": count,
                "reps": reps if name == GLOO else set_reps,
            }
            if name in seconds:
                row["seconds"] = seconds[name]
            if name in notes:
                row["note"] = notes[name]
            row["load"] = load
            rows.append(row)
        del cases
        if rank == 0:
            print(
                f"  {set_name} N={n}: {MPI.Wtime() - t0:.1f} s, load average {load:.1f}",
                file=sys.stderr,
                flush=True,
            )
    if dist is not None:
        dist.destroy_process_group()
    return rows


# -- launcher ------------------------------------------------------------------------------


# the goals: time of the other case / time of this one must reach these
# (ar: vs per-array Allreduce; asa16: vs asa32; gloo: the best of ours vs gloo)
GOALS = {"ar": 1.0, "asa16": 1.6, GLOO: 1.2}


def _goal(ratio: float, case: str) -> str:
    """`` (ok >=1.6)`` or `` (MISS >=1.6)`` for a case with a goal, else nothing."""
    if case not in GOALS:
        return ""
    return f" ({'ok' if ratio >= GOALS[case] else 'MISS'} >={GOALS[case]})"


def _is_baseline(case: str) -> bool:
    from theanompi.exchange import STRATEGIES

    return STRATEGIES.get(parse_case(case)[0]).baseline


def _bw(row: dict[str, Any]) -> tuple[float, float]:
    """(algbw, busbw) in GB/s: float32 parameter bytes per second, and nccl-tests' busbw."""
    alg = row["count"] * 4 / row["seconds"] / 1e9
    return alg, alg * 2 * (row["n"] - 1) / row["n"]


def format_table(rows: list[dict[str, Any]], memcpy_gbs: float, reps: int) -> str:
    """The results table and the ratios of the issue's goals."""
    counts = sorted({r.get("reps", reps) for r in rows if r["strategy"] != PINGPONG})
    lines = [
        f"exchange benchmark: op=mean, median of {' or '.join(map(str, counts))} exchanges "
        f"(x{SMALL_SET_REPS} for sets under {SMALL_SET:,} floats, not for gloo) between barriers, "
        f"{os.cpu_count()} cores",
        f"{'set':8s} {'floats':>10s} {'N':>2s} {'strategy':13s} {'s/exchange':>11s} "
        f"{'algbw GB/s':>10s} {'busbw GB/s':>10s}  note",
    ]
    for r in rows:
        if r["strategy"] == PINGPONG:
            nums = f"{r['seconds']:11.4f} {r['count'] * 4 / r['seconds'] / 1e9:10.2f} {'-':>10s}"
        elif "seconds" in r:
            alg, bus = _bw(r)
            nums = f"{r['seconds']:11.4f} {alg:10.2f} {bus:10.2f}"
        else:
            nums = f"{'-':>11s} {'-':>10s} {'-':>10s}"
        lines.append(
            f"{r['set']:8s} {r['count']:10d} {r['n']:2d} {r['strategy']:13s} {nums}  "
            f"{r.get('note', '')}"
        )
    lines.append(f"memcpy (np.copyto, 244 MB, one process): {memcpy_gbs:.2f} GB/s  <- limit")
    loads = sorted({f"{r['load']:.1f}" for r in rows if "load" in r})
    if loads:
        lines.append(
            f"1-min load average while timing: {', '.join(loads)} (other jobs share the cores)"
        )
    lines.append("")
    lines.append("ratios (time of the slower / time of the faster; >1 means the first wins):")
    t = {(r["set"], r["n"], r["strategy"]): r["seconds"] for r in rows if "seconds" in r}
    link = {r["n"]: r["count"] * 4 / r["seconds"] / 1e9 for r in rows if r["strategy"] == PINGPONG}
    for set_name, n in dict.fromkeys((r["set"], r["n"]) for r in rows if r["set"] != "link"):

        def g(s: str, set_name: str = set_name, n: int = n) -> float | None:
            return t.get((set_name, n, s))

        cases = [r["strategy"] for r in rows if (r["set"], r["n"]) == (set_name, n)]
        parts = []
        if g("ar") and g("ar_per_array"):
            v = g("ar_per_array") / g("ar")
            parts.append(f"fused ar vs per-array {v:.2f}x{_goal(v, 'ar')}")
        for case in cases:  # every compressed case against its float32 counterpart
            base = _uncompressed(case)
            if base and g(case) and g(base):
                v = g(base) / g(case)
                parts.append(f"{case} vs {base} {v:.2f}x{_goal(v, case)}")
        ours = {s: g(s) for s in cases if s != GLOO and not _is_baseline(s) and g(s)}
        if ours and g(GLOO):
            best = min(ours, key=ours.__getitem__)
            v = g(GLOO) / ours[best]
            parts.append(f"best ({best}) vs gloo {v:.2f}x{_goal(v, GLOO)}")
        lines.append(f"  {set_name:8s} N={n}: " + "; ".join(parts))
        per_link = [
            f"{r['strategy']} {_bw(r)[1] / link[n]:.2f}"
            for r in rows
            if (r["set"], r["n"]) == (set_name, n) and "seconds" in r and n in link
        ]
        if per_link:
            lines.append(
                f"  {set_name:8s} N={n}: busbw / ping-pong bandwidth: " + ", ".join(per_link)
            )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tmpi bench exchange", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="2,4", help="numbers of ranks to launch (default 2,4)")
    cases = default_cases()
    p.add_argument(
        "--strategies",
        default=",".join(cases),
        help=f"cases, a strategy or strategy+compression (default {','.join(cases)})",
    )
    p.add_argument("--sets", default="alexnet,small", help="parameter sets: alexnet, small")
    p.add_argument("--reps", type=int, default=5, help="timed exchanges per case (median)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per mpirun launch")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table; return 0 (non-zero when a launch failed)."""
    args = _parser().parse_args(argv)
    strategies = args.strategies.split(",")
    sets = args.sets.split(",")
    for s in sets:
        if s not in SETS:
            print(f"unknown set {s!r}; choose from {', '.join(SETS)}", file=sys.stderr)
            return 2
    if args.reps < 1:
        print(f"--reps must be >= 1, got {args.reps}", file=sys.stderr)
        return 2
    for case in strategies:
        try:
            if case != GLOO:
                parse_case(case)
        except ConfigError as err:
            print(err, file=sys.stderr)
            return 2
    if args.worker or under_mpirun():
        rows = worker(strategies, sets, args.reps)
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_rank() == 0:
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(rows, f)
            else:
                print(format_table(rows, memcpy_bandwidth(244_000_000) / 1e9, args.reps))
        return 0

    from theanompi.launch.mpirun import mpirun_command, mpirun_env

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in args.sizes.split(",")):
            out = os.path.join(tmp, f"n{n}.json")
            cmd = mpirun_command(
                n,
                [sys.executable, "-m", "theanompi.bench.exchange", "--worker", "--out", out,
                 "--strategies", args.strategies, "--sets", args.sets, "--reps", str(args.reps)],
            )  # fmt: skip
            print(f"running N={n}: {' '.join(cmd[1:4])} ...", file=sys.stderr, flush=True)
            proc = subprocess.run(cmd, env=mpirun_env(), timeout=args.timeout)
            if proc.returncode != 0 or not os.path.exists(out):
                print(f"mpirun -n {n} failed (exit {proc.returncode})", file=sys.stderr)
                return proc.returncode or 1
            with open(out) as f:
                rows += json.load(f)
    rows.sort(key=lambda r: (list(SETS).index(r["set"]) if r["set"] in SETS else -1, r["n"]))
    print(format_table(rows, memcpy_bandwidth(244_000_000) / 1e9, args.reps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
