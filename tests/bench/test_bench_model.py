"""``tmpi bench model`` prints PyTorch's peak RSS beside ours (issue 41's memory bar): the
PyTorch twin's own process, as ``/usr/bin/time`` would count it, read back from that process."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from theanompi.launch.testing import REPO

pytest.importorskip("torch")


def test_the_bench_prints_pytorchs_peak_rss_beside_ours(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "theanompi.bench.model", "--case", "small_cnn:8", "--steps", "1"]
        + ["--rounds", "1", "--no-compile", "--threads", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    # torch's import alone is resident: a real process's peak, not a placeholder
    assert 100 < row["torch_peak_rss_mb"] < 4000, row
    assert row["rss_ratio"] == pytest.approx(row["peak_rss_mb"] / row["torch_peak_rss_mb"])
    line = next(ln for ln in proc.stdout.splitlines() if "peak RSS" in ln)
    torch_mb = re.search(r"torch (\d+) MB \(its process\) \| ours/torch ([\d.]+)", line)
    assert torch_mb and int(torch_mb[1]) == round(row["torch_peak_rss_mb"]), line
    assert "| PyTorch peak RSS MB | RSS ours/PyTorch |" in proc.stdout
