"""``tmpi bench startup``: a real ``tmpi train -n 2`` whose rank 0 writes its start-up marks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from theanompi.bench.startup import PHASES, phases


def test_phases_add_up_to_the_total() -> None:
    marks = {"mpi_start": 10.9, "mpi_end": 11.0, "build_start": 11.2, "build_end": 12.5}
    trace = {
        "process_start": 10.4,
        "marks": {**marks, "first_step": 12.7},
        "spans": {"compile": 1.1, "loads": 0.5},
    }
    got = phases(10.0, trace)
    assert got["launcher"] == pytest.approx(0.4) and got["rewrites"] == pytest.approx(0.6)
    assert got["graph build"] == pytest.approx(0.2) and got["module loads"] == pytest.approx(0.5)
    assert sum(got[p] for p in PHASES) == pytest.approx(got["total"]) == pytest.approx(2.7)


@pytest.mark.mpi
def test_one_run_prints_every_phase_and_the_verdict(cli, digits_data: Path) -> None:
    """One warm-up and one timed ``tmpi train -n 2`` on digits (~10 s)."""
    out = cli("bench", "startup", "--repeats", "1", "--data", str(digits_data), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {}
    for line in out.stdout.splitlines():
        m = re.match(r"^(\S.*?)\s+(-?\d+\.\d\d)\s+(-?\d+\.\d\d)\s+(-?\d+\.\d\d)$", line)
        if m:
            rows[m[1]] = float(m[2])
    assert list(rows) == [*PHASES, "total"], out.stdout
    assert all(v >= 0 for v in rows.values()), rows
    assert sum(rows[p] for p in PHASES) == pytest.approx(rows["total"], abs=0.05)
    assert re.search(
        r"command to first step: \d+\.\d\d s \(goal <= 3 s: (met|not met)\)", out.stdout
    )


def test_bad_data_is_one_line(cli, tmp_path: Path) -> None:
    out = cli("bench", "startup", "--data", str(tmp_path))
    assert out.returncode == 3, out.stderr
    assert out.stderr.startswith("tmpi: error: --data ") and len(out.stderr.splitlines()) == 1
