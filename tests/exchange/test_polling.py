"""The polling communicator under real ``mpirun``: the blocking calls' bytes, a sleeping wait."""

from __future__ import annotations

from pathlib import Path

import pytest

from theanompi.comm import under_mpirun

SCRIPT = Path(__file__).with_name("mpi_polling.py")

pytestmark = pytest.mark.skipif(under_mpirun(), reason="launches its own mpirun")


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_polling_comm_matches_blocking_calls_and_waits_asleep(mpirun, n: int) -> None:
    out = mpirun(n, [SCRIPT], timeout=180).stdout
    for name in ("Allreduce", "Alltoall", "Allgather", "Bcast", "Send/Recv", "Split"):
        assert f"OK {name} " in out, out
    assert "OK polling wait CPU" in out and "OK polling wait GIL" in out, out
