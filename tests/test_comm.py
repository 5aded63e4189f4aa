"""The abort hook and launcher under real mpirun: one failing rank stops the job with one line."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from theanompi.comm import is_power_of_two
from theanompi.io.atomic import atomic_write, write_json
from theanompi.launch.mpirun import mpirun_env

RAISER = """
import sys, time
from theanompi.comm import install_abort_hook, world
install_abort_hook()
comm = world()
if comm.Get_rank() == int(sys.argv[1]):
    time.sleep(0.5)
    raise RuntimeError("boom from the test")
comm.Barrier()  # the other ranks would wait here forever without the hook
"""


@pytest.mark.mpi
def test_one_rank_raising_aborts_the_job_quickly(mpirun, tmp_path: Path) -> None:
    script = tmp_path / "raiser.py"
    script.write_text(RAISER)
    start = time.monotonic()
    out = mpirun(2, [script, "1"], timeout=60, check=False)
    assert time.monotonic() - start < 30
    assert out.returncode != 0
    assert "tmpi: error on rank 1/2: RuntimeError: boom from the test" in out.stderr


def test_power_of_two() -> None:
    assert [n for n in range(1, 17) if is_power_of_two(n)] == [1, 2, 4, 8, 16]
    assert not is_power_of_two(0)


def test_atomic_write_leaves_nothing_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "out.json"
    write_json(target, {"a": 1})
    with pytest.raises(ValueError), atomic_write(target) as tmp:
        tmp.write_text("half")
        raise ValueError("interrupted")
    assert target.read_text().strip().startswith("{") and '"a": 1' in target.read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


NODE = """
import os, sys
os.environ.pop("OMPI_COMM_WORLD_LOCAL_SIZE")  # as under a launcher that does not set it
for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
    if not os.environ.get(var):  # the test passes "" for unset
        os.environ.pop(var, None)
from theanompi.pytensor_env import configure, fit_threads_to_node, _node_cores
configure()
from theanompi.comm import describe_hosts, local_rank, local_size, world
d = describe_hosts()
threads = fit_threads_to_node(local_size())
print(world().Get_rank(), local_rank(), local_size(), threads, _node_cores(),
      os.environ["OPENBLAS_NUM_THREADS"], "|", d, flush=True)
"""


@pytest.mark.mpi
def test_local_rank_size_and_threads_come_from_mpi(mpirun, tmp_path: Path) -> None:
    script = tmp_path / "node.py"
    script.write_text(NODE)
    env = {"OPENBLAS_NUM_THREADS": "", "OMP_NUM_THREADS": "", "PYTENSOR_FLAGS": ""}
    out = mpirun(3, [script], env=env, timeout=120)
    rows = sorted(line.split("|")[0].split() for line in out.stdout.splitlines())
    assert [r[:3] for r in rows] == [["0", "0", "3"], ["1", "1", "3"], ["2", "2", "3"]]
    cores = int(rows[0][4])
    assert all(r[3] == r[5] == str(max(1, cores // 3)) for r in rows), rows
    import socket

    assert f"| 3 ranks on 1 host: {socket.gethostname()} x3 (ranks 0-2)" in out.stdout


@pytest.mark.mpi
def test_threads_the_user_set_are_kept(mpirun, tmp_path: Path) -> None:
    script = tmp_path / "node.py"
    script.write_text(NODE)
    out = mpirun(2, [script], env={"OPENBLAS_NUM_THREADS": "7", "PYTENSOR_FLAGS": ""}, timeout=120)
    assert all(line.split()[3] == line.split()[5] == "7" for line in out.stdout.splitlines())


SHOW_BTL = "import os, theanompi; print(os.environ.get('OMPI_MCA_btl'))"


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, "^ofi"),  # a singleton: libfabric's BTL would only sleep 1 s in MPI_Init
        ({"OMPI_MCA_btl": "self,tcp"}, "self,tcp"),  # the user's choice wins
        ({"OMPI_COMM_WORLD_SIZE": "2"}, "None"),  # a launched rank keeps its launcher's
        ({"SLURM_PROCID": "0"}, "None"),
    ],
)
def test_a_process_without_a_launcher_starts_mpi_without_the_libfabric_btl(
    env: dict[str, str], want: str
) -> None:
    base = {k: v for k, v in os.environ.items() if k != "OMPI_MCA_btl"}
    base = {k: v for k, v in base.items() if not k.startswith(("OMPI_COMM", "SLURM_", "PMI"))}
    out = subprocess.run(
        [sys.executable, "-c", SHOW_BTL], env=base | env, capture_output=True, text=True
    )
    assert out.stdout.strip() == want, out.stderr


def test_jobs_tmpi_launches_leave_the_libfabric_btl_out_unless_set() -> None:
    assert mpirun_env({})["OMPI_MCA_btl"] == "^ofi"
    assert mpirun_env({"OMPI_MCA_btl": "self,sm,ofi"})["OMPI_MCA_btl"] == "self,sm,ofi"
