"""The pieces of a loop of your own under real ``mpirun -n N``: ``DistributedOptimizer`` against a
float64 reference, ``broadcast_parameters``, ``allreduce``, ``init``; and one rank alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from theanompi.launch.testing import REPO

SCRIPT = Path(__file__).with_name("mpi_distributed.py")


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_a_loop_of_your_own_under_mpirun(mpirun, tmp_path: Path, n: int) -> None:
    out = tmp_path / "final.npz"
    proc = mpirun(n, [SCRIPT, out], timeout=600)
    assert "all checks passed" in proc.stdout, proc.stdout
    assert "ar+none: equal on every rank" in proc.stdout
    assert "ar+shard: the unsharded parameters and state" in proc.stdout
    assert ("asa32+fp16" in proc.stdout) == (n == 2)  # power-of-2 strategies at N=2 only
    final = np.load(out)
    for r in range(1, n):  # bit-identical replicas after K steps
        for i in range(2):
            assert final[f"r{r}_{i}"].tobytes() == final[f"r0_{i}"].tobytes()


def test_one_rank_without_mpirun(tmp_path: Path) -> None:
    """``python script.py`` alone: one rank, the same answers (no exchange needed)."""
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "one.npz")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert out.returncode == 0 and "all checks passed" in out.stdout, out.stderr[-3000:]


def test_a_float64_parameter_is_one_line() -> None:
    import pytensor
    import pytensor.tensor as pt

    import theanompi as tm
    from theanompi.errors import ConfigError

    w = pytensor.shared(np.zeros(3), name="w64")
    x = pt.vector("x")
    with pytest.raises(ConfigError, match=r"parameter 'w64' is float64; .*float32"):
        tm.DistributedOptimizer(tm.SGD([w], 0.1), pt.sum(w * x), [x])
