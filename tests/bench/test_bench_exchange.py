"""``tmpi bench exchange`` end to end at its smallest: real mpirun, every row, the goal ratios."""

from __future__ import annotations

import subprocess
import sys

from theanompi.bench.exchange import SMALL_SET_REPS
from theanompi.launch.testing import REPO


def test_small_set_runs_under_mpirun_and_reports_ratios() -> None:
    cmd = [sys.executable, "-m", "theanompi.bench.exchange", "--sizes", "2", "--sets", "small",
           "--reps", "1", "--strategies", "ar,asa32,asa16,ar_per_array"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert f"median of {SMALL_SET_REPS} exchanges" in out  # the small set gets 10x --reps
    for name in ("ar", "asa32", "asa16", "ar_per_array"):
        row = next(
            line.split()
            for line in out.splitlines()
            if line.split()[:4] == ["small", "999972", "2", name]
        )
        assert float(row[4]) > 0  # seconds per exchange
    assert "small    N=2: fused ar vs per-array" in out and "asa16 vs asa32" in out


def test_unknown_set_is_one_line() -> None:
    cmd = [sys.executable, "-m", "theanompi.bench.exchange", "--sets", "huge"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "unknown set 'huge'; choose from alexnet, small"
