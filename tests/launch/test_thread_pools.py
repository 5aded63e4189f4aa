"""BLAS/OpenMP threads per rank = the node's cores / its ranks, set and reported through
``threadpoolctl``: inside real ranks under mpirun, and in ``tmpi info``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from theanompi.launch.mpirun import mpirun_command, mpirun_env
from theanompi.launch.testing import REPO
from theanompi.pytensor_env import unconfigured_env

# a rank as `tmpi train` starts one, except that the guess before MPI starts is wrong
# (no OMPI_COMM_WORLD_LOCAL_SIZE, as under a launcher that does not set it): the BLAS pools
# load with cores threads, and fit_threads_to_node sets them to cores / ranks per node
RANK = """
import os
os.environ.pop("OMPI_COMM_WORLD_LOCAL_SIZE")
for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
    os.environ.pop(var, None)
from theanompi.pytensor_env import configure, fit_threads_to_node, thread_pools, _node_cores
configure()
import numpy, pytensor.tensor
from theanompi.comm import local_size, world
def blas():
    return sorted((p["internal_api"], p["num_threads"]) for p in thread_pools()
                  if p["user_api"] == "blas")
before = blas()
n = fit_threads_to_node(local_size())
print(world().Get_rank(), _node_cores(), n, before, blas(), os.environ["OMP_NUM_THREADS"],
      sep="|", flush=True)
"""


def _cores() -> int:
    return len(os.sched_getaffinity(0))


@pytest.mark.mpi
def test_two_ranks_get_the_cores_split_between_them(mpirun, tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    out = mpirun(2, [script], env={"PYTENSOR_FLAGS": ""}, timeout=120)
    rows = sorted(line.split("|") for line in out.stdout.splitlines() if "|" in line)
    assert [r[0] for r in rows] == ["0", "1"], out.stdout
    for _, cores, n, before, after, omp in rows:
        want = max(1, int(cores) // 2)  # 1 per rank on the 2-core machine
        assert int(n) == want and omp == str(want)
        pools = eval(after)  # noqa: S307 - our own repr of [(api, threads), ...]
        assert pools and {api for api, _ in pools} == {"openblas"}, after
        assert all(t == want for _, t in pools), (before, after)
        assert all(t == int(cores) for _, t in eval(before)), before  # noqa: S307


def test_info_lists_the_loaded_thread_pools(cli) -> None:
    out = cli("info")
    assert out.returncode == 0, out.stderr
    pools = [ln for ln in out.stdout.splitlines() if ln.startswith("thread pool")]
    linked = [ln for ln in pools if ln.endswith("/libscipy_openblas.so")]
    assert len(linked) == 1, out.stdout
    assert "openblas (blas) 0." in linked[0] and f", {_cores()} thread(s): " in linked[0]


@pytest.mark.mpi
def test_info_under_two_ranks_reports_their_threads() -> None:
    """``mpirun -n 2 tmpi info`` from a clean environment (this process's own thread settings,
    made for one process, left out): rank 0 reports cores / 2 threads in every BLAS pool."""
    cmd = mpirun_command(2, [sys.executable, "-m", "theanompi.cli", "info"])
    env = mpirun_env(unconfigured_env() | {"PYTHONPATH": str(REPO)})
    out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    want = max(1, _cores() // 2)
    pools = [ln for ln in out.stdout.splitlines() if ln.startswith("thread pool")]
    assert pools and all(f", {want} thread(s): " in ln for ln in pools), out.stdout
    assert any(ln.split() == ["blas", "threads", str(want)] for ln in out.stdout.splitlines())
