"""``tmpi bench cluster`` on real namespaces: the table at the smallest settings, and teardown on
SIGTERM; plus the pieces that need neither (the ratios, bad arguments)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from theanompi.bench.cluster import _verdicts, main
from theanompi.launch.mpirun import mpirun_env
from theanompi.launch.simcluster import PREFIX, unavailable
from theanompi.launch.testing import REPO

_WHY = unavailable()
needs_ns = pytest.mark.skipif(bool(_WHY), reason=f"simulated cluster unavailable: {_WHY}")
TINY = ["--arch", "{channels: [8], fc: 16, dropout: 0}", "--batch-size", "16"]


def _left(pid: int) -> list[str]:
    """This bench process's namespaces and veths still present (other tests' are not ours)."""
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    mine = re.compile(rf"^(?:{PREFIX}|tsv){pid}x\d+[ab]$")
    return [w for w in (ns + links).replace(":", " ").replace("@", " ").split() if mine.match(w)]


def _bench(*args: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "theanompi.cli", "bench", "cluster", *args]
    env = mpirun_env(os.environ | {"PYTHONPATH": str(REPO)})
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO
    )


def _row(setup: str, ips: float, step: float, compute: float, exchange: float) -> dict:
    return {
        "setup": setup,
        "images_per_s": ips,
        "step_s": step,
        "compute_s": compute,
        "exchange_s": exchange,
    }


def test_verdicts_compare_side_by_side_rows() -> None:
    rows = [
        _row("N=2 1/node overlap never", 600.0, 0.40, 0.19, 0.21),
        _row("N=2 1/node overlap always", 900.0, 0.22, 0.20, 0.01),
        _row("N=4 2/node hier. never", 300.0, 1.7, 0.3, 1.4),
        _row("N=4 2/node hier. always", 600.0, 0.7, 0.3, 0.35),
        _row("N=2 1/node PyTorch DDP", 1000.0, 0.25, 0.19, 0.06),
    ]
    text = "\n".join(_verdicts(rows))
    assert "overlap on / off images/s = 1.50x (goal >= 1.4x): met" in text
    assert "= 1.05x (goal <= 1.15x): met" in text  # 0.22 / max(0.20, 0.21)
    assert "ours (overlap always) / DDP images/s = 0.90x (goal >= 1.0x): NOT met" in text
    assert "hierarchical / flat exchange ms = 0.25x (goal <= 0.5x): met" in text
    assert "hierarchical exchange = 350 ms (goal <= 400 ms): met" in text


def test_help_lists_the_options(cli) -> None:
    out = cli("bench", "cluster", "--help")
    assert out.returncode == 0, out.stderr
    assert "usage: tmpi bench cluster" in out.stdout and "--setups" in out.stdout


def test_bad_setup_is_one_line(capsys) -> None:
    rc = main(["--setups", "overlap,bogus"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [
        "tmpi: error: --setups 'bogus': choose from overlap, hierarchical, ddp"
    ]


@needs_ns
@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.serial
def test_smallest_run_prints_the_table_and_leaves_no_namespace(digits_data: Path) -> None:
    proc = _bench(*TINY, "--setups", "overlap,ddp", "--steps", "2", "--repeats", "1",
                  "--data", str(digits_data))  # fmt: skip
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-3000:]
    assert "tbf rate 1gbit burst 256kb latency 50ms" in out
    for setup in ("N=2 1/node overlap never", "N=2 1/node overlap always"):
        assert any(line.startswith(setup) for line in out.splitlines()), out
    assert "overlap on / off images/s = " in out
    if "torch" not in err:  # the twin runs where torch is installed
        assert "N=2 1/node PyTorch DDP" in out and "/ DDP images/s = " in out
    assert _left(proc.pid) == []


@needs_ns
@pytest.mark.mpi
@pytest.mark.serial
def test_sigterm_tears_the_namespaces_down(digits_data: Path) -> None:
    proc = _bench(*TINY, "--setups", "overlap", "--steps", "200", "--data", str(digits_data))
    try:
        deadline = time.monotonic() + 60
        while not _left(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _left(proc.pid), "the bench never built its namespaces"
        time.sleep(2)  # into the first mpirun job
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err[-2000:]
    assert _left(proc.pid) == []
