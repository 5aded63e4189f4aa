"""Images/s on two simulated nodes: overlap on/off, hierarchical vs flat, a PyTorch DDP twin.

``tmpi bench cluster`` (``make bench-cluster``) builds the simulated two-node cluster
(:class:`theanompi.launch.simcluster.SimCluster`: network namespaces joined by a veth pair;
root only), shapes the link (default ``tc tbf rate 1gbit burst
256kb latency 50ms``, as issue 29 measured) and times, with ``tmpi bench train``'s worker, BSP
training of the widened digits CNN (``--arch``; ``--batch-size`` per rank, ``--sync-type cdd``):

- ``overlap``: N=2, one rank per node, ``weight_exchange.overlap`` never vs always;
- ``hierarchical``: N=4, two ranks per node, ``weight_exchange.hierarchical`` never vs always
  (both with ``overlap`` never, so the exchange column is the whole exchange, from the moment
  all ranks met: the wait for the slowest rank, four ranks sharing two cores, is the
  ``slowest`` column, as Horovod's timeline shows its negotiation apart);
- ``ddp``: the PyTorch DDP twin (:mod:`theanompi.bench.ddp`, gloo, ``GLOO_SOCKET_IFNAME`` set
  to each node's veth) of the same network, batch and threads on the same pair.

Repeats run round-robin over the setups (so load drifts hit all alike); the table shows each
setup's median run (per-step medians inside a run) and the ratios the issue asks for. The
namespaces are torn down on any exit: normal, error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from theanompi.bench import train as bench_train
from theanompi.bench.ddp import torch_missing
from theanompi.comm import under_mpirun

__all__ = ["main", "SETUPS"]

DEFAULT_ARCH = "{channels: [32, 64], fc: 1024, dropout: 0.25}"
SETUPS = ("overlap", "hierarchical", "ddp")


@dataclass(frozen=True)
class Setup:
    """One row: its label, ranks, ranks per node and config overrides (``ddp``: the twin)."""

    label: str
    n: int
    per_node: int
    sets: tuple[str, ...] = ()
    ddp: bool = False
    runs: list[dict[str, Any]] = field(default_factory=list, compare=False)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tmpi bench cluster", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=None, help="prep output [default: data/digits]")
    p.add_argument(
        "--arch", default=DEFAULT_ARCH, help=f"model.arch (YAML) [default: {DEFAULT_ARCH}]"
    )
    p.add_argument("--batch-size", type=int, default=128, help="per rank [default: 128]")
    p.add_argument("--steps", type=int, default=30, help="steps per run [default: 30]")
    p.add_argument("--repeats", type=int, default=3, help="runs per setup [default: 3]")
    p.add_argument("--sync-type", default="cdd", help="avg or cdd [default: cdd]")
    p.add_argument("--strategy", default="ar", help="exchange strategy [default: ar]")
    p.add_argument(
        "--threads", type=int, default=1, help="BLAS/torch threads per rank [default: 1]"
    )
    p.add_argument(
        "--setups",
        default=",".join(SETUPS),
        help=f"comma-separated, of {', '.join(SETUPS)} [default: all]",
    )
    p.add_argument("--rate", default="1gbit", help="tc tbf rate [default: 1gbit]")
    p.add_argument("--burst", default="256kb", help="tc tbf burst [default: 256kb]")
    p.add_argument("--latency", default="50ms", help="tc tbf latency [default: 50ms]")
    p.add_argument("--no-shape", dest="shape", action="store_false", help="leave the veth as is")
    p.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    return p


def _setups(names: list[str], torch_ok: bool) -> list[Setup]:
    out: list[Setup] = []
    ex = "weight_exchange"
    if "overlap" in names:
        for on in ("never", "always"):
            out.append(Setup(f"N=2 1/node overlap {on}", 2, 1, (f"{ex}.overlap={on}",)))
    if "hierarchical" in names:
        for h in ("never", "always"):
            sets = (f"{ex}.overlap=never", f"{ex}.hierarchical={h}")
            out.append(Setup(f"N=4 2/node hier. {h}", 4, 2, sets))
    if "ddp" in names and torch_ok:
        out.append(Setup("N=2 1/node PyTorch DDP", 2, 1, ddp=True))
    return out


def _ours(args: argparse.Namespace, cluster: Any, s: Setup, out: Path) -> dict[str, Any]:
    from theanompi.launch.hosts import Placement

    ns = argparse.Namespace(
        model="digits",
        steps=args.steps,
        strategy=args.strategy,
        sync_type=args.sync_type,
        blas_threads=args.threads,
        batch_size=args.batch_size,
        sets=[f"model.arch={args.arch}", *s.sets],
    )
    hosts = tuple((a, s.per_node) for a in cluster.addresses)
    placement = Placement(hosts=hosts, mpi_args=tuple(shlex.split(cluster.mpi_args)))
    return bench_train.run_n(ns, args.data, s.n, out, placement=placement, wrap=cluster.on_head)


def _ddp(args: argparse.Namespace, cluster: Any, out: Path, port: int) -> dict[str, Any]:
    import yaml

    arch = yaml.safe_load(args.arch)
    argv = [sys.executable, "-m", "theanompi.bench.ddp", "--out", str(out)]
    argv += ["--steps", str(args.steps), "--batch-size", str(args.batch_size)]
    argv += ["--channels", ",".join(str(c) for c in arch.get("channels", [32, 64]))]
    argv += ["--fc", str(arch.get("fc", 128)), "--dropout", str(arch.get("dropout", 0.25))]
    argv += ["--threads", str(args.threads)]
    base = os.environ | {
        "MASTER_ADDR": cluster.addresses[0],
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "2",
        "OMP_NUM_THREADS": str(args.threads),
        "OPENBLAS_NUM_THREADS": str(args.threads),
    }
    procs = []
    try:
        for node in (0, 1):
            env = base | {"RANK": str(node), "GLOO_SOCKET_IFNAME": cluster.interfaces[node]}
            procs.append(
                subprocess.Popen(
                    cluster.on_node(node, argv),
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = [(p.returncode, o) for p, o in zip(procs, outs, strict=True) if p.returncode]
    if bad and out.exists():  # the row is written: an abort while gloo tears down (seen in CI:
        bad = []  # "terminate called without an active exception") does not change it
    if bad:
        tail = bad[0][1].strip().splitlines()[-3:]
        raise RuntimeError(f"bench cluster: DDP twin failed ({bad[0][0]}): " + " | ".join(tail))
    return json.loads(out.read_text())


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'setup':<26} {'images/s':>9} {'step ms':>8} {'compute':>8} {'slowest':>8} "
        f"{'exchange':>9} {'hidden':>7}  runs (images/s)"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        runs = " ".join(f"{v:.0f}" for v in r["repeats_images_per_s"])
        split = (
            f"{_ms(r['compute_s']):>8} {_ms(r.get('sync_s')):>8} {_ms(r['exchange_s']):>9} "
            f"{_ms(r.get('hidden_s')):>7}"
        )
        lines.append(
            f"{r['setup']:<26} {r['images_per_s']:>9,.0f} {_ms(r['step_s']):>8} {split}  {runs}"
        )
    return "\n".join(lines)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def _verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's ratios, each with its goal and whether this run met it."""
    by = {r["setup"]: r for r in rows}
    off, on = by.get("N=2 1/node overlap never"), by.get("N=2 1/node overlap always")
    flat, hier = by.get("N=4 2/node hier. never"), by.get("N=4 2/node hier. always")
    ddp = by.get("N=2 1/node PyTorch DDP")
    out = []

    def line(what: str, value: float, goal: str, met: bool, unit: str = "x") -> None:
        shown = f"{value:.2f}x" if unit == "x" else f"{value:.0f}{unit}"
        out.append(f"{what} = {shown} (goal {goal}): {'met' if met else 'NOT met'}")

    if off and on:
        v = _ratio(on["images_per_s"], off["images_per_s"])
        line("overlap on / off images/s", v, ">= 1.4x", v >= 1.4)
        bound = max(on["compute_s"], off["exchange_s"])
        v = _ratio(on["step_s"], bound)
        line("overlap on step / max(compute, exchange off)", v, "<= 1.15x", v <= 1.15)
    if ddp:
        for r in (x for x in (off, on) if x):
            v = _ratio(r["images_per_s"], ddp["images_per_s"])
            line(f"ours ({r['setup'][11:]}) / DDP images/s", v, ">= 1.0x", v >= 1.0)
    if flat and hier:
        v = _ratio(hier["exchange_s"], flat["exchange_s"])
        line("hierarchical / flat exchange ms", v, "<= 0.5x", v <= 0.5)
        ms = hier["exchange_s"] * 1e3
        line("hierarchical exchange", ms, "<= 400 ms", ms <= 400, unit=" ms")
    return out


def _measure(args: argparse.Namespace, setups: list[Setup], tmp: Path) -> list[dict[str, Any]]:
    from theanompi.launch.simcluster import SimCluster

    with SimCluster(tmp / "cluster", slots=2) as cluster:
        link = "unshaped"
        if args.shape:
            link = cluster.shape(args.rate, tbf=True, burst=args.burst, latency=args.latency)
        print(f"bench cluster: two simulated nodes, link {link}", flush=True)
        for i in range(args.repeats):
            for j, s in enumerate(setups):
                out = tmp / f"{j}_{i}.json"
                row = _ddp(args, cluster, out, 29500 + i) if s.ddp else _ours(args, cluster, s, out)
                s.runs.append(row)
                print(
                    f"  {s.label:<26} run {i + 1}: {row['images_per_s']:,.0f} images/s", flush=True
                )
    rows = []
    for s in setups:
        runs = sorted(s.runs, key=lambda r: r["images_per_s"])
        mid = runs[len(runs) // 2]
        ips = [r["images_per_s"] for r in runs]
        rows.append(mid | {"setup": s.label, "repeats_images_per_s": ips})
    return rows


def main(argv: list[str] | None = None) -> int:
    """Build the cluster, run every setup ``--repeats`` times, print the table; an exit code."""
    args = _parser().parse_args(argv)
    if under_mpirun():
        print("bench cluster: run it without mpirun; it launches its own jobs", file=sys.stderr)
        return 2
    from theanompi.errors import UserError
    from theanompi.launch.simcluster import unavailable

    names = [x.strip() for x in args.setups.split(",") if x.strip()]
    bad = [x for x in names if x not in SETUPS]
    if bad or args.repeats < 1 or args.steps < 1:
        what = f"--setups {bad[0]!r}: choose from {', '.join(SETUPS)}" if bad else ""
        what = what or "--steps and --repeats must be >= 1"
        print(f"tmpi: error: {what}", file=sys.stderr)
        return 2
    why = unavailable()
    if why:
        print(f"bench cluster: {why}", file=sys.stderr)
        return 2
    no_torch = torch_missing() if "ddp" in names else None
    if no_torch:
        print(f"bench cluster: {no_torch}", file=sys.stderr)
    setups = _setups(names, not no_torch)
    old = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # SystemExit: the with tears down
    try:
        args.data = bench_train.ensure_data(args.data).resolve()
        with tempfile.TemporaryDirectory(prefix="tmpi-bench-cluster-") as tmp:
            rows = _measure(args, setups, Path(tmp))
    except (UserError, RuntimeError) as err:
        print(f"tmpi: error: {err}", file=sys.stderr)
        return getattr(err, "exit_code", 1)
    finally:
        signal.signal(signal.SIGTERM, old)
    print(
        f"bench cluster: digits model.arch={args.arch}, {args.batch_size}/rank, BSP "
        f"{args.strategy}/{args.sync_type}, {args.steps} steps per run, median of {args.repeats} "
        f"run(s), {args.threads} thread(s) per rank, {os.cpu_count()} cores; per-step ms"
    )
    print(_table(rows))
    print("\n".join(_verdicts(rows)))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
