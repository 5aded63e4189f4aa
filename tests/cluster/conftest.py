"""A simulated two-node cluster (network namespaces, 2 ranks per node) for the cluster tests."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence

import pytest

from theanompi.launch.mpirun import mpirun_env
from theanompi.launch.simcluster import SimCluster, unavailable
from theanompi.launch.testing import REPO

_WHY = unavailable()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimCluster]:
    """Two nodes, ``nodea`` (198.18.0.1, the head) and ``nodeb`` (198.18.0.2), 2 slots each;
    always torn down. Skips where namespaces cannot be made (not root, no iproute2)."""
    if _WHY:
        pytest.skip(f"simulated cluster unavailable: {_WHY}")
    with SimCluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


def head_run(
    cluster: SimCluster,
    argv: Sequence[str],
    timeout: float = 300,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``argv`` on the head node (where mpirun runs), as a user there would; no check."""
    full = mpirun_env(os.environ | {"PYTHONPATH": str(REPO)} | (env or {}))
    for key in ("THEANOMPI_HOSTFILE", "THEANOMPI_HOSTS", "THEANOMPI_MPI_ARGS"):
        full.pop(key, None)
    return subprocess.run(
        cluster.on_head(list(map(str, argv))),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full,
        cwd=cwd or REPO,
    )


def tmpi_on_cluster(
    cluster: SimCluster, *args: str, n: int = 4, use_host_list: bool = False, **kw: object
) -> subprocess.CompletedProcess[str]:
    """``tmpi <args> -n n --hostfile H --mpi-args "..."`` (or ``-H``) from the head node."""
    hosts = ["-H", cluster.host_list] if use_host_list else ["--hostfile", str(cluster.hostfile)]
    argv = [sys.executable, "-m", "theanompi.cli", *args, "-n", str(n), *hosts]
    return head_run(cluster, [*argv, "--mpi-args", cluster.mpi_args], **kw)  # type: ignore[arg-type]


def show(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
