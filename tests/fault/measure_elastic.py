"""Measure elastic training's table in docs/reliability.md (``python tests/fault/measure_elastic.py
[--repeat K] [--data DIR]``): the digits CNN for 8 epochs on ``tmpi train -n 4 --min-np 2``,
undisturbed, then with one rank SIGKILLed mid-epoch (rank 3, and rank 0: the record's writer).

Per scenario, medians of ``--repeat`` runs: the exit code, the shrink's seconds (the record's
``elastic.seconds``), the seconds from the last step before the kill to the first after it
(an upper bound on kill -> next step: the victim dies right after that last step), the steps
redone, and the final top-1 error against the undisturbed run's. One Markdown row each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, Job, tmpi_argv  # noqa: E402

from theanompi.io.record import read_record  # noqa: E402

KILL_AT = 17  # before step 18: epoch 2 of 8, 5 of its 12 steps done (N=4)


def run(data: Path, work: Path, name: str, victim: int | None) -> dict[str, Any]:
    """One training run; its figures."""
    run_dir = work / name
    args = ["train", "-n", "4", "--min-np", "2", "--model", "digits", "--data", str(data)]
    args += ["--run-dir", str(run_dir), "--epochs", "8", "--set", "training.print_freq=1"]
    env = {"THEANOMPI_FAIL": f"kill:{victim}:{KILL_AT}"} if victim is not None else None
    with Job(tmpi_argv(*args), env=env) as job:
        out = job.wait(timeout=600)
    rec = read_record(run_dir)
    top1 = [r for r in rec if r["kind"] == "epoch"][-1]["val_top1_err"]
    row: dict[str, Any] = {"exit": out.returncode, "top1": 100 * top1}
    starts = [r for r in rec if r["kind"] == "start"]
    if victim is None or len(starts) < 2:
        return row
    change = starts[1]["elastic"]
    steps = [r for r in rec if r["kind"] == "step"]
    before = max((r for r in steps if r["time"] < starts[1]["time"]), key=lambda r: r["time"])
    after = min((r for r in steps if r["time"] > starts[1]["time"]), key=lambda r: r["time"])
    row.update(
        shrink=change["seconds"],
        next_step=after["time"] - before["time"],
        redone=before["step"] - change["step"],
        ranks=change["world_size"],
    )
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--data", type=Path, default=REPO / "data" / "digits")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        print("| fault | exit | ranks after | shrink | last step -> next | redone | top-1 |")
        print("|---|---|---|---|---|---|---|")
        for name, victim in (("none", None), ("rank 3", 3), ("rank 0", 0)):
            rows = [
                run(a.data, work, f"{name.replace(' ', '')}{i}", victim) for i in range(a.repeat)
            ]

            def med(key: str, rows: list[dict[str, Any]] = rows) -> float:
                return statistics.median(r[key] for r in rows)

            exits = sorted({r["exit"] for r in rows})
            if victim is None:
                print(f"| none | {exits} | 4 | | | | {med('top1'):.2f} % |")
                continue
            print(
                f"| kill -9 {name} at step {KILL_AT} | {exits} | {med('ranks'):g} | "
                f"{1000 * med('shrink'):.1f} ms | {med('next_step'):.2f} s | {med('redone'):g} | "
                f"{med('top1'):.2f} % |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
