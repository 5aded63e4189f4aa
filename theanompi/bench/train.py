"""Benchmark BSP training: images/s of the small CNN on the demo data at N=1 and N=2.

``python -m theanompi.bench.train`` (``tmpi bench train``) relaunches itself under
``mpirun -n N`` for each N of ``--ranks`` with one BLAS thread per rank
(``OPENBLAS_NUM_THREADS=1``), runs ``theanompi.train.run.run`` (BSP) for ``--steps`` steps (one epoch
capped by ``training.max_steps``, no checkpoints) and prints a table of medians
per step: images/s, step time and its split into compute / exchange / data
wait, each rank's peak resident memory (``VmHWM``: build, steps, exchanges and validation)
and its ratio to the parameter bytes, plus the speed-up of each N over N=1
(goal: N=2 >= 1.7x). The demo data
set is built into ``bench_out/digits`` on first use when ``--data`` is not given
and ``data/digits`` does not exist.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from theanompi.bench._memory import MB
from theanompi.comm import under_mpirun
from theanompi.io.dataset import MANIFEST, read_manifest

if TYPE_CHECKING:
    from theanompi.launch.hosts import Placement

__all__ = ["main", "run_n", "ensure_data"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tmpi bench train", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--data",
        type=Path,
        default=None,
        help="prep output [default: data/digits, built if missing]",
    )
    p.add_argument("--model", default="digits", help="model config [default: digits]")
    p.add_argument("--ranks", default="1,2", help="comma-separated N to run [default: 1,2]")
    p.add_argument(
        "--steps", type=int, default=40, help="steps per run (medians over them) [default: 40]"
    )
    p.add_argument(
        "--repeats", type=int, default=1, help="runs per N; the median run is shown [default: 1]"
    )
    p.add_argument("--strategy", default="ar", help="exchange strategy [default: ar]")
    p.add_argument("--sync-type", default="avg", help="avg or cdd [default: avg]")
    p.add_argument(
        "--batch-size", type=int, default=None, help="per-rank sub-batch [default: the model's]"
    )
    p.add_argument("--blas-threads", type=int, default=1, help="BLAS threads per rank [default: 1]")
    p.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override (value read as YAML), e.g. weight_exchange.overlap=never; repeatable",
    )
    p.add_argument(
        "--no-ceiling",
        dest="ceiling",
        action="store_false",
        help="skip the N independent single-rank runs side by side (the machine's ceiling)",
    )
    p.add_argument(
        "--shard-optimizer",
        choices=SHARD_MODES,
        default="off",
        help="ZeRO-1 (weight_exchange.shard_optimizer, BSP cdd): off, on, or both (each N "
        "with and without, side by side) [default: off]",
    )
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--independent", action="store_true", help=argparse.SUPPRESS)
    return p


#: ``--shard-optimizer``: the weight_exchange.shard_optimizer values each N runs with
SHARD_MODES = {"off": (False,), "on": (True,), "both": (False, True)}


def _overrides(args: argparse.Namespace, data: Path, run_dir: Path) -> dict[str, Any]:
    over: dict[str, Any] = {
        "data.dir": str(data),
        "output.run_dir": str(run_dir),
        "output.snapshot_freq": 0,
        "training.max_steps": args.steps,
        "training.print_freq": 10**9,
        "model.n_epochs": 1,
        "weight_exchange.exch_strategy": args.strategy,
        "weight_exchange.sync_type": args.sync_type,
    }
    if (data / MANIFEST).exists():  # the stored size, so models with larger crops (AlexNet) fit
        over["data.image_size"] = int(read_manifest(data)["size"])
    if args.batch_size:
        over["model.batch_size"] = args.batch_size
    return over | parse_sets(args.sets)


def parse_sets(sets: Sequence[str]) -> dict[str, Any]:
    """``["a.b=1", "c={x: [1, 2]}"]`` -> ``{"a.b": 1, "c": {"x": [1, 2]}}`` (values are YAML)."""
    import yaml

    from theanompi.errors import ConfigError

    out: dict[str, Any] = {}
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. model.batch_size=64")
        out[key.strip()] = yaml.safe_load(value)
    return out


def _worker(args: argparse.Namespace) -> int:
    """Under mpirun: one timed BSP run; rank 0 writes the summary to ``args.worker``.

    ``--independent``: every rank trains alone (``COMM_SELF``) at the same time, which
    measures what the machine gives N uncoupled single-rank jobs (the ceiling for BSP).
    """
    from theanompi.comm import install_abort_hook
    from theanompi.pytensor_env import configure

    configure(blas_threads=args.blas_threads)
    install_abort_hook()
    import contextlib
    import io

    from mpi4py import MPI

    from theanompi.bench._memory import param_bytes, peak_rss_bytes
    from theanompi.config import check_world_size, load_config
    from theanompi.models import create_model
    from theanompi.train.progress import TIMES
    from theanompi.train.run import run as train_run

    world = MPI.COMM_WORLD
    comm = MPI.COMM_SELF if args.independent else world
    with tempfile.TemporaryDirectory(prefix="tmpi-bench-") as tmp:
        cfg = load_config(None, args.model, _overrides(args, args.data, Path(tmp) / "run"))
        check_world_size(cfg, comm.Get_size())
        model = create_model(cfg.model)
        shard = cfg.weight_exchange.shard_optimizer and comm.Get_size() > 1
        state_mb = _state_mb_per_rank(model.optimizer, comm.Get_size() if shard else 1)
        world.Barrier()
        with contextlib.redirect_stdout(io.StringIO()):
            s = train_run(cfg, comm=comm, model=model)
    b = int(cfg.model.batch_size)
    mine = {k: s[f"median_{k}_s"] for k in TIMES}
    mine["peak_rss"] = peak_rss_bytes()  # the whole run: build, steps, exchanges, validation
    everyone = world.gather(mine, root=0)
    if world.Get_rank() == 0:
        n = world.Get_size()
        ips = sum(b / r["wall"] for r in everyone) if args.independent else n * b / mine["wall"]
        row = {
            "n": n,
            "independent": bool(args.independent),
            "batch_size": b,
            "steps": s["steps"],
            "model": cfg.model.name,
            "strategy": args.strategy,
            "sync_type": args.sync_type,
            "images_per_s": ips,
            "step_s": mine["wall"],
            "compute_s": mine["compute"],
            "exchange_s": mine["exchange"],
            "wait_s": mine["wait"],
            "hidden_s": mine["hidden"],
            "sync_s": mine["sync"],
            "shard_optimizer": bool(shard),
            "opt_state_mb_per_rank": state_mb,
            "param_mb": param_bytes(model.params) / MB,
            "peak_rss_mb": max(r["peak_rss"] for r in everyone) / MB,
            "peak_rss_mb_per_rank": [r["peak_rss"] / MB for r in everyone],
        }
        row["peak_rss_x_params"] = row["peak_rss_mb"] / row["param_mb"]
        args.worker.write_text(json.dumps(row))
    return 0


def _state_mb_per_rank(optimizer: Any, n: int) -> float:
    """The optimiser state one rank holds: its 1/N chunk of the parameter-shaped state when
    sharded (:class:`~theanompi.rules.sharded.ShardedUpdate`, chunks of a buffer padded to a
    multiple of N), the scalars whole."""
    shaped = [
        v.get_value(borrow=True) for i in range(len(optimizer.params)) for v in optimizer.slots(i)
    ]
    scalars = sum(v.get_value(borrow=True).nbytes for v in optimizer.state) - sum(
        a.nbytes for a in shaped
    )
    per_slot = len(shaped) // max(len(optimizer.params), 1)
    count = sum(a.size for a in shaped) // max(per_slot, 1)
    return (per_slot * -(-count // n) * 4 + scalars) / MB


def ensure_data(data: Path | None) -> Path:
    if data is not None:
        if not (data / MANIFEST).exists():
            from theanompi.errors import DataError

            raise DataError(f"--data {data}: no prep output there; run `make data` or omit --data")
        return data
    default = Path("data/digits")
    if (default / MANIFEST).exists():
        return default
    built = Path("bench_out/digits")
    if not (built / MANIFEST).exists():
        print(f"bench train: building the demo data set in {built} ...", flush=True)
        cli = [sys.executable, "-m", "theanompi.cli", "prep"]
        tree = built.parent / "digits_tree"
        subprocess.run([*cli, "demo", "--out", str(tree)], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(
            [*cli, "all", "-n", "2", "--src", str(tree), "--out", str(built), "--size", "32"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return built


def run_n(
    args: argparse.Namespace,
    data: Path,
    n: int,
    out: Path,
    independent: bool = False,
    *,
    placement: Placement | None = None,
    wrap: Callable[[list[str]], list[str]] | None = None,
    shard: bool = False,
) -> dict[str, Any]:
    """One timed run of ``n`` ranks; rank 0's summary row. ``placement`` says where the ranks
    go (default: this machine), ``wrap`` turns the mpirun command into the one to run (e.g.
    :meth:`SimCluster.on_head`)."""
    from theanompi.launch.mpirun import mpirun_command, mpirun_env
    from theanompi.launch.restart import run_started

    argv = [sys.executable, "-m", "theanompi.bench.train", "--worker", str(out)]
    argv += ["--data", str(data), "--model", args.model, "--steps", str(args.steps)]
    argv += ["--strategy", args.strategy, "--sync-type", args.sync_type]
    argv += ["--blas-threads", str(args.blas_threads)]
    if args.batch_size:
        argv += ["--batch-size", str(args.batch_size)]
    if independent:
        argv.append("--independent")
    for item in args.sets:
        argv += ["--set", item]
    if shard:
        argv += ["--set", "weight_exchange.shard_optimizer=true"]
    env = mpirun_env() | {
        "OPENBLAS_NUM_THREADS": str(args.blas_threads),
        "OMP_NUM_THREADS": str(args.blas_threads),
    }
    cmd = mpirun_command(n, argv, placement)
    proc = run_started(wrap(cmd) if wrap else cmd, timed_only=True, env=env)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        tail = [x for x in lines if x.startswith("tmpi: error")][:1] or lines[-5:]
        raise RuntimeError(f"bench train: N={n} failed ({proc.returncode}): " + " | ".join(tail))
    return json.loads(out.read_text())


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    runs = sorted(runs, key=lambda r: r["images_per_s"])
    return runs[len(runs) // 2] | {"repeats_images_per_s": [r["images_per_s"] for r in runs]}


def _rss_cell(row: dict[str, Any]) -> str:
    """``max (x params)``, plus every rank's peak when there are several; ``-`` if unmeasured."""
    if "peak_rss_mb" not in row:
        return "-"
    ranks = row["peak_rss_mb_per_rank"]
    each = "" if len(ranks) == 1 else " [" + " ".join(f"{v:.0f}" for v in ranks) + "]"
    return f"{row['peak_rss_mb']:.0f} ({row['peak_rss_x_params']:.1f}x){each}"


def _sharding_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per N run with and without ZeRO-1: what sharding took off the largest per-rank peak
    RSS and the optimizer state, and its step time against the unsharded one."""
    out = []
    for r in rows:
        plain = next((q for q in rows if q["n"] == r["n"] and not q["independent"]
                      and not q.get("shard_optimizer")), None)  # fmt: skip
        if r.get("shard_optimizer") and plain:
            less = max(plain["peak_rss_mb_per_rank"]) - max(r["peak_rss_mb_per_rank"])
            out.append(
                f"N={r['n']} ZeRO-1: peak RSS per rank {less:.0f} MB less than unsharded "
                f"(optimizer state {plain['opt_state_mb_per_rank']:.0f} -> "
                f"{r['opt_state_mb_per_rank']:.0f} MB per rank); step time "
                f"{r['step_s'] / plain['step_s']:.2f}x unsharded"
            )
    return out


def _table(rows: list[dict[str, Any]]) -> str:
    base = next((r["images_per_s"] for r in rows if r["n"] == 1 and not r["independent"]), None)
    head = (
        f"{'run':<26} {'images/s':>9} {'vs N=1':>7} {'step ms':>8} {'compute':>8} "
        f"{'exchange':>9} {'wait':>6} {'opt state MB':>12} {'peak RSS MB/rank (x params)':>28}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        what = (
            f"{r['n']} x 1 rank, side by side"
            if r["independent"]
            else f"BSP N={r['n']} ({r['batch_size']}/rank)"
            + (" ZeRO-1" if r.get("shard_optimizer") else "")
        )
        state = f"{r['opt_state_mb_per_rank']:.0f}" if "opt_state_mb_per_rank" in r else "-"
        up = f"{r['images_per_s'] / base:.2f}x" if base else "-"
        lines.append(
            f"{what:<26} {r['images_per_s']:>9,.0f} {up:>7} {r['step_s'] * 1e3:>8.1f} "
            f"{r['compute_s'] * 1e3:>8.1f} {r['exchange_s'] * 1e3:>9.2f} {r['wait_s'] * 1e3:>6.2f} "
            f"{state:>12} {_rss_cell(r):>28}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, with ``--worker``, one timed run under mpirun); returns an exit code."""
    args = _parser().parse_args(argv)
    if args.worker is not None:
        return _worker(args)
    if under_mpirun():
        print("bench train: run it without mpirun; it launches N=1 and N=2 itself", file=sys.stderr)
        return 2
    from theanompi.errors import UserError

    try:
        parse_sets(args.sets)  # a bad --set is one line here, not N ranks' tracebacks
        data = ensure_data(args.data)
        ranks = [int(x) for x in args.ranks.split(",") if x.strip()]
        rows = []
        with tempfile.TemporaryDirectory(prefix="tmpi-bench-") as tmp:
            for n in ranks:
                modes = [(False, sh) for sh in SHARD_MODES[args.shard_optimizer]]
                modes += [(True, False)] if args.ceiling and n > 1 else []
                for ind, sh in modes:
                    runs = [
                        run_n(args, data, n, Path(tmp) / f"n{n}_{ind}_{sh}_{i}.json", ind, shard=sh)
                        for i in range(args.repeats)
                    ]
                    rows.append(_median_run(runs))
    except (UserError, RuntimeError) as err:
        print(f"tmpi: error: {err}", file=sys.stderr)
        return getattr(err, "exit_code", 1)
    print(
        f"bench train: BSP {args.strategy}/{args.sync_type}, model {args.model}, {args.steps} "
        f"steps per run, median of {args.repeats} run(s), {args.blas_threads} BLAS thread(s) "
        f"per rank, {os.cpu_count()} cores; per-step medians in ms"
    )
    print(_table(rows))
    one = next((r for r in rows if r["n"] == 1 and not r["independent"]), None)
    for r in rows:
        if one and r["n"] == 2 and not r["independent"]:
            ratio = r["images_per_s"] / one["images_per_s"]
            print(
                f"N=2 / N=1 = {ratio:.2f}x (goal >= 1.7x): {'met' if ratio >= 1.7 else 'NOT met'}"
            )
        if r["independent"]:
            bsp = next((q for q in rows if q["n"] == r["n"] and not q["independent"]), None)
            if bsp:
                print(
                    f"N={r['n']} BSP / {r['n']} independent single-rank runs = "
                    f"{bsp['images_per_s'] / r['images_per_s']:.2f} (BSP efficiency on this machine)"
                )
    for line in _sharding_lines(rows):
        print(line)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
