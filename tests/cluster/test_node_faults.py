"""A remote node's processes killed mid-training under ``tmpi train -n 4`` across the simulated
two-node cluster: only its ranks (its mpirun daemon alive), or only its daemon. Either way the
launcher ends with one line naming the host (mpirun's banners and the survivors' "Socket
closed" reports dropped), exit 1, and no process left on either node. (SIGKILL of the whole
node: ``test_cluster.py::test_killing_one_node_ends_the_job_naming_the_host``.) A daemon that
never reported back at launch is a start failure: the launch goes again."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

from theanompi.launch.simcluster import SimCluster
from theanompi.launch.testing import REPO

from .conftest import kill_and_wait, show, start_until, tmpi_on_cluster

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.serial]

sys.path.insert(0, str(REPO / "tests" / "fault"))
from harness import tiny_train_args, write_tiny_data  # noqa: E402

_LINES = {
    "ranks": r"tmpi: error: rank [23] \(pid \d+\) on host nodeb was killed by signal 9 "
    r"\(SIGKILL\); mpirun stopped the other ranks",
    "daemon": r"tmpi: error: lost host nodeb \(ranks 2-3\): its mpirun daemon died or the node "
    r"went down; mpirun stopped the other ranks",
}


def _name(pid: int) -> str:
    try:
        return Path(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()).name
    except OSError:
        return ""


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_data(tmp_path_factory.mktemp("node_faults") / "data")


@pytest.mark.parametrize("what", ["ranks", "daemon"])
def test_a_killed_remote_node_is_one_line(
    cluster: SimCluster, data: Path, tmp_path: Path, what: str
) -> None:
    train, *args = tiny_train_args(data, tmp_path / "r", "--set", "training.print_freq=1")
    argv = [sys.executable, "-m", "theanompi.cli", train, "-n", "4"]
    argv += ["--hostfile", str(cluster.hostfile), "--mpi-args", cluster.mpi_args, *args]
    proc, _ = start_until(cluster, argv, r"epoch 2/\d+ step \d+/")  # training reached epoch 2
    wanted = "python" if what == "ranks" else "prted"
    victims = [p for p in cluster.pids(1) if _name(p).startswith(wanted)]
    assert victims, [(p, _name(p)) for p in cluster.pids(1)]
    rest, took = kill_and_wait(proc, victims)
    assert proc.returncode == 1, rest[-3000:]
    assert took < 30, took
    after = [ln for ln in rest.splitlines() if not re.search(r"\| lr [\d.e-]+$|img/s", ln)]
    errors = [ln for ln in after if re.search(r"error|\*\*\*|^---|abort", ln, re.I)]
    assert len(errors) == 1 and re.fullmatch(_LINES[what], errors[0]), rest[-3000:]
    deadline = time.monotonic() + 15
    while (cluster.pids(0) or cluster.pids(1)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cluster.pids(0) == [] and cluster.pids(1) == []


def test_a_daemon_that_never_reported_back_is_launched_again(
    cluster: SimCluster, data: Path, tmp_path: Path
) -> None:
    """nodeb's launch agent exits 255 before its daemon starts, once (as one CI run saw, no
    rank placed yet): mpirun says "A daemon failed to report back", the launcher says it
    launches again, and the second launch trains to the end."""
    count = tmp_path / "count"
    once = f'n=$(cat {count} 2>/dev/null || echo 0); echo $((n + 1)) > {count}; [ "$n" -ge 1 ] || exit 255;'
    train, *args = tiny_train_args(data, tmp_path / "r", epochs=1)
    with cluster.node_setup(1, once):
        proc = tmpi_on_cluster(cluster, train, *args, timeout=240)
    assert proc.returncode == 0, show(proc)
    assert (
        proc.stderr.count(
            "tmpi: mpirun failed to start (its daemon on 198.18.0.2 never reported back); "
            "launching again (2/3)"
        )
        == 1
    ), show(proc)
    assert count.read_text().strip() == "2"
