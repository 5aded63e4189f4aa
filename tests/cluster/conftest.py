"""A simulated two-node cluster (network namespaces, 2 ranks per node) for the cluster tests."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence

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


def start_until(
    cluster: SimCluster, argv: Sequence[str], pattern: str
) -> tuple[subprocess.Popen[str], list[str]]:
    """``argv`` started on the head node (stdout and stderr as one text stream), read until a
    line matches ``pattern``: the running process and the lines read; fails the test if the
    output ends first."""
    env = mpirun_env(os.environ | {"PYTHONPATH": str(REPO)})
    proc = subprocess.Popen(
        cluster.on_head(list(map(str, argv))),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if re.search(pattern, line):
            return proc, lines
    proc.kill()
    pytest.fail(f"no line matched {pattern!r}:\n" + "".join(lines[-40:]))


def kill_and_wait(
    proc: subprocess.Popen[str], pids: Iterable[int], timeout: float = 90
) -> tuple[str, float]:
    """SIGKILL ``pids`` (those already gone are skipped), then wait for ``proc``: the rest of
    its output and the seconds from the kill to its end (``proc`` is killed after
    ``timeout``, failing the test)."""
    killed = time.monotonic()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    try:
        rest, _ = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return rest, time.monotonic() - killed


def show(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
