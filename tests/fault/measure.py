"""Measure each fault scenario of docs/reliability.md: exit code, seconds to exit, seconds until
no process is left, and steps lost (``python tests/fault/measure.py [--repeat K] [names...]``).

The tiny MLP of tests/fault (10 steps an epoch at N=2, a checkpoint every epoch); medians of
``--repeat`` runs. Prints one Markdown table row per scenario.
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Job, mpirun_argv, tiny_train_args, tmpi_argv, write_tiny_data  # noqa: E402

from theanompi.io.checkpoint import latest_checkpoint, load_checkpoint  # noqa: E402
from theanompi.io.record import read_record  # noqa: E402


def _last_step(text: str) -> int:
    """The global step of the last progress line (``epoch E/N step k/K``) in ``text``."""
    found = re.findall(r"epoch (\d+)/\d+ step (\d+)/(\d+)", text)
    return max(((int(e) - 1) * int(n) + int(k) for e, k, n in found), default=0)


def _ckpt_step(run: Path) -> int:
    ck = latest_checkpoint(run / "checkpoints")
    return load_checkpoint(ck).step if ck else 0


def scenario(name: str, data: Path, work: Path) -> dict[str, object]:
    run = work / name
    shutil.rmtree(run, ignore_errors=True)
    args = tiny_train_args(data, run, epochs=30 if name == "restart" else 100000)
    launched = tmpi_argv(args[0], "-n", "2", *args[1:])
    argv = mpirun_argv(2, *args) if name.startswith("mpirun") else launched
    if name == "restart":
        argv += ["--max-restarts", "1"]
    faults: dict[str, Callable[[Job], None]] = {
        "launcher-SIGTERM": lambda j: j.kill(j.pid, signal.SIGTERM),
        "launcher-SIGKILL": lambda j: j.kill(j.pid, signal.SIGKILL),
        "ctrl-c": lambda j: j.killpg(signal.SIGINT),
        "mpirun-ctrl-c": lambda j: j.killpg(signal.SIGINT),
        "mpirun-SIGUSR1": lambda j: j.kill(j.mpirun_pid(), signal.SIGUSR1),
        "rank-SIGKILL": lambda j: j.kill(j.rank_pid(1), signal.SIGKILL),
        "mpirun-SIGKILL": lambda j: j.kill(j.mpirun_pid(), signal.SIGKILL),
        "restart": lambda j: j.kill(j.rank_pid(1), signal.SIGKILL),
    }
    with Job(argv) as job:
        job.wait_for(r"epoch 3/\d+ step 5/", timeout=300)
        faults[name](job)
        done_before = _last_step(job.stdout)  # at the fault, to a progress line
        resumed_s, resumed_step = None, None
        if name == "restart":
            m = job.wait_for(r"resumed from .*step (\d+)\)", timeout=120)
            resumed_s = time.monotonic() - (job.t_fault or 0)
            resumed_step = int(m.group(1))
        end = job.wait(timeout=300)
        left, gone_s = job.wait_gone(30)
    rec = read_record(run)
    ends = [r for r in rec if r.get("kind") == "end"]
    if resumed_step is not None:  # trained before the fault, not in the checkpoint resumed
        lost = done_before - resumed_step
    else:  # trained before the stop (the end record's count, else the last progress line)
        lost = (ends[-1]["steps"] if ends else done_before) - _ckpt_step(run)
    if "-v" in sys.argv:
        print(name, done_before, ends[-1]["steps"] if ends else None, _ckpt_step(run), resumed_step)
    return {
        "exit": end.returncode,
        "exit_s": end.seconds,
        "gone_s": gone_s if not left else float("inf"),
        "lost_steps": max(0, lost),
        "end_record": bool(rec) and rec[-1].get("kind") == "end",
        "resume_line": "(continue with --resume)" in end.stdout,
        "resumed_s": resumed_s,
    }


def main(argv: list[str] | None = None) -> int:
    names = [
        "launcher-SIGTERM",
        "launcher-SIGKILL",
        "ctrl-c",
        "mpirun-SIGUSR1",
        "mpirun-ctrl-c",
        "rank-SIGKILL",
        "mpirun-SIGKILL",
        "restart",
    ]
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("-v", action="store_true", help="print each run")
    ap.add_argument("names", nargs="*", default=names)
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="tmpi-fault-"))
    data = write_tiny_data(work / "data")
    print(
        "| scenario | exit | s to exit | s until no process | steps lost | end record | resume line |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in a.names:
        rows = [scenario(name, data, work) for _ in range(a.repeat)]
        med = {k: statistics.median(r[k] for r in rows) for k in ("exit_s", "gone_s", "lost_steps")}
        exits = sorted({r["exit"] for r in rows})
        ends = sum(bool(r["end_record"]) for r in rows)
        lines = sum(bool(r["resume_line"]) for r in rows)
        extra = ""
        if name == "restart":
            extra = f" (resumed after {statistics.median(r['resumed_s'] for r in rows):.1f} s)"
        print(
            f"| {name} | {','.join(map(str, exits))} | {med['exit_s']:.2f}{extra} | "
            f"{med['gone_s']:.2f} | {med['lost_steps']:.0f} | {ends}/{len(rows)} | "
            f"{lines}/{len(rows)} |",
            flush=True,
        )
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
