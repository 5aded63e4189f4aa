"""Every exchanger and compressor under real ``mpirun -n N``: vs float64, bit-identical, refusals."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from theanompi.comm import under_mpirun

SCRIPT = Path(__file__).with_name("mpi_exchange.py")


def _script():
    """``mpi_exchange.py`` as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("mpi_exchange", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.mpi
@pytest.mark.skipif(under_mpirun(), reason="already under mpirun: test_world runs instead")
@pytest.mark.parametrize(
    "n",
    [
        1,
        2,
        pytest.param(3, marks=pytest.mark.serial),
        pytest.param(4, marks=pytest.mark.serial),
        pytest.param(8, marks=[pytest.mark.slow, pytest.mark.serial]),
    ],
)
def test_exchangers_under_mpirun(mpirun, n: int) -> None:
    """All cases x {mean, sum} x 2 steps in one launch (N=3: power-of-2 strategies refuse).

    N > 2 runs in the serial part: its ranks share 2 cores and pass hundreds of small messages,
    each waiting for a rank the scheduler has parked; beside another job (the parallel part's
    other worker) N=4 took 33 s, alone 4.3 s (N=3: 16 / 2.8 s, N=8: 36 / 10 s)."""
    mod = _script()
    proc = mpirun(n, [SCRIPT], timeout=300)
    assert "all checks passed" in proc.stdout, proc.stdout
    cases = mod.default_cases()
    assert all(f"  {case:20s} mean " in proc.stdout for case in cases), proc.stdout
    if n & (n - 1):
        refusing = [c for c in cases if mod.needs_power_of_two(c)]
        assert refusing and proc.stdout.count("ConfigError ok") == 2 * len(refusing), proc.stdout


@pytest.mark.mpi
@pytest.mark.skipif(not under_mpirun(), reason="only when pytest itself runs under mpirun")
def test_world() -> None:
    """Under ``mpirun -n N pytest``: the same checks on COMM_WORLD, whatever N is."""
    from mpi4py import MPI

    mod = _script()
    comm = MPI.COMM_WORLD
    fails = mod.check(comm, mod.default_cases(), ["mean", "sum"])
    assert comm.allreduce(len(fails)) == 0, fails
