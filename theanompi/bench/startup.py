"""Benchmark start-up: seconds from the ``tmpi train -n N`` command to rank 0's first step.

``tmpi bench startup`` runs ``tmpi train -n N`` (default N=2) on the digits demo data
``--repeats`` times (one untimed run first warms the compile cache) and prints, per phase,
the median, min and max over the runs: the launcher (the CLI, its checks, ``mpirun``
starting the ranks), rank 0's imports and config, MPI init, the set-up before the model
(run dir, node checks, loaders), the model's graph build, PyTensor's rewrites, the loads of
the compiled C modules, and the first step. Rank 0 writes its marks where
``$THEANOMPI_STARTUP_TRACE`` says (:mod:`theanompi.io.startup_trace`). Goal: <= 3 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from theanompi.bench.train import ensure_data
from theanompi.comm import under_mpirun
from theanompi.io.startup_trace import TRACE_ENV

__all__ = ["main", "phases"]

GOAL_S = 3.0
#: the rows of the table, in order; they add up to the total
PHASES = (
    "launcher",
    "imports + config",
    "MPI init",
    "set-up",
    "graph build",
    "rewrites",
    "module loads",
    "first step",
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tmpi bench startup", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="N of tmpi train -n N [default: 2]")
    p.add_argument("--repeats", type=int, default=5, help="timed runs [default: 5]")
    p.add_argument("--model", default="digits", help="model config [default: digits]")
    p.add_argument(
        "--data",
        type=Path,
        default=None,
        help="prep output [default: data/digits, built if missing]",
    )
    return p


def phases(t0: float, trace: dict[str, Any]) -> dict[str, float]:
    """Seconds per phase of one run that started at ``t0`` (wall clock), from rank 0's trace."""
    m, spans = trace["marks"], trace["spans"]
    start = trace["process_start"] or m["mpi_start"]  # without /proc: imports count as launcher
    rewrites = spans.get("compile", 0.0) - spans.get("loads", 0.0)
    build = m["build_end"] - m["build_start"]
    return {
        "launcher": start - t0,
        "imports + config": m["mpi_start"] - start,
        "MPI init": m["mpi_end"] - m["mpi_start"],
        "set-up": m["build_start"] - m["mpi_end"],
        "graph build": build - spans.get("compile", 0.0),
        "rewrites": rewrites,
        "module loads": spans.get("loads", 0.0),
        "first step": m["first_step"] - m["build_end"],
        "total": m["first_step"] - t0,
    }


def _tmpi() -> list[str]:
    """The ``tmpi`` script a user runs (beside this Python), else ``python -m theanompi.cli``."""
    script = Path(sys.executable).with_name("tmpi")
    return [str(script)] if script.exists() else [sys.executable, "-m", "theanompi.cli"]


def _one(args: argparse.Namespace, data: Path, tmp: Path, i: int) -> dict[str, float]:
    trace = tmp / f"trace-{i}.json"
    cmd = [*_tmpi(), "train", "-n", str(args.ranks), "--model", args.model, "--data", str(data)]
    cmd += ["--run-dir", str(tmp / "run"), "--overwrite", "--epochs", "1", "--max-steps", "2"]
    env = os.environ | {TRACE_ENV: str(trace)}
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0 or not trace.exists():
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"tmpi train -n {args.ranks} exited {proc.returncode}: {tail}")
    return phases(t0, json.loads(trace.read_text()))


def _table(runs: list[dict[str, float]]) -> str:
    lines = [f"{'phase':<18} {'median s':>9} {'min':>7} {'max':>7}", "-" * 44]
    for name in (*PHASES, "total"):
        values = [r[name] for r in runs]
        if name == "total":
            lines.append("-" * 44)
        lines.append(
            f"{name:<18} {statistics.median(values):9.2f} {min(values):7.2f} {max(values):7.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns an exit code."""
    args = _parser().parse_args(argv)
    if under_mpirun():
        print("bench startup: run it without mpirun; it launches tmpi train -n N", file=sys.stderr)
        return 2
    from theanompi.errors import UserError

    try:
        data = ensure_data(args.data)
        with tempfile.TemporaryDirectory(prefix="tmpi-bench-startup-") as tmp:
            _one(args, data, Path(tmp), -1)  # warm the compile cache (and the OS's file cache)
            runs = [_one(args, data, Path(tmp), i) for i in range(args.repeats)]
    except (UserError, RuntimeError) as err:
        print(f"tmpi: error: {err}", file=sys.stderr)
        return getattr(err, "exit_code", 1)
    print(f"tmpi train -n {args.ranks} --model {args.model}: command to rank 0's first step")
    print(f"({args.repeats} runs, warm compile cache)\n")
    print(_table(runs))
    total = statistics.median(r["total"] for r in runs)
    verdict = "met" if total <= GOAL_S else "not met"
    print(f"\ncommand to first step: {total:.2f} s (goal <= {GOAL_S:.0f} s: {verdict})")
    return 0
