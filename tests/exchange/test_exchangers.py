"""Every exchanger under real ``mpirun -n N``: exact vs float64, bit-identical, errors at N=3."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from theanompi.comm import under_mpirun

SCRIPT = Path(__file__).with_name("mpi_exchange.py")


@pytest.mark.mpi
@pytest.mark.skipif(under_mpirun(), reason="already under mpirun: test_world runs instead")
@pytest.mark.parametrize("n", [1, 2, 3, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_exchangers_under_mpirun(mpirun, n: int) -> None:
    """All strategies x {mean, sum} x 2 steps in one launch (N=3: ar only, others must refuse)."""
    proc = mpirun(n, [SCRIPT], timeout=240)
    assert "all checks passed" in proc.stdout, proc.stdout
    if n == 3:
        assert proc.stdout.count("ConfigError ok") == 6, proc.stdout


@pytest.mark.mpi
@pytest.mark.skipif(not under_mpirun(), reason="only when pytest itself runs under mpirun")
def test_world() -> None:
    """Under ``mpirun -n N pytest``: the same checks on COMM_WORLD, whatever N is."""
    from mpi4py import MPI

    spec = importlib.util.spec_from_file_location("mpi_exchange", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    comm = MPI.COMM_WORLD
    names = ["ar", "asa32", "asa16", "copper", "ar_per_array", *mod.VARIANTS]
    fails = mod.check(comm, names, ["mean", "sum"])
    assert comm.allreduce(len(fails)) == 0, fails
