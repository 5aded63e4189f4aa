"""The hierarchical exchanger across two simulated nodes (2 ranks each, real shared-memory
node split, TCP between the leaders over the veth)."""

from __future__ import annotations

import sys

import pytest

from theanompi.launch.hosts import Placement
from theanompi.launch.mpirun import mpirun_command
from theanompi.launch.simcluster import SimCluster
from theanompi.launch.testing import REPO

from .conftest import head_run, show

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.serial]


def test_hierarchical_equals_flat_across_two_nodes(cluster: SimCluster) -> None:
    """N=4, 2 per node: every strategy and compressor, hierarchical within its bound of the
    float64 reference and of the flat exchange, the same bytes on all four ranks."""
    script = REPO / "tests" / "exchange" / "mpi_hierarchical.py"
    placement = Placement.from_env(
        {"THEANOMPI_HOSTFILE": str(cluster.hostfile), "THEANOMPI_MPI_ARGS": cluster.mpi_args}
    )
    cases = "ar,ar+fp16,asa32,asa16,copper,copper+fp16"
    cmd = mpirun_command(4, [sys.executable, str(script), "--cases", cases], placement)
    out = head_run(cluster, cmd, timeout=600)
    assert out.returncode == 0 and "all checks passed" in out.stdout, show(out)
    assert "ar               mean nodes 2 " in out.stdout, show(out)  # the real node split
