"""Across two simulated nodes (network namespaces, 2 ranks each, TCP over a veth): the launch
flags, exchangers, BSP and EASGD training, eval, and a node dying mid-run."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from theanompi.io.record import read_record
from theanompi.launch.hosts import Placement
from theanompi.launch.mpirun import mpirun_command
from theanompi.launch.simcluster import SimCluster
from theanompi.launch.testing import REPO, tmpi

from .conftest import head_run, kill_and_wait, show, start_until, tmpi_on_cluster

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.serial]

LAYOUT = "4 ranks on 2 hosts: nodea x2 (ranks 0-1), nodeb x2 (ranks 2-3)"


def _placement(cluster: SimCluster) -> Placement:
    return Placement.from_env(
        {"THEANOMPI_HOSTFILE": str(cluster.hostfile), "THEANOMPI_MPI_ARGS": cluster.mpi_args}
    )


@pytest.fixture(scope="module")
def digits(cluster: SimCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits demo data, prepped by ``tmpi prep all -n 4`` across the two nodes."""
    root = tmp_path_factory.mktemp("digits")
    out = tmpi("prep", "demo", "--out", str(root / "tree"))
    assert out.returncode == 0, out.stderr
    args = ["prep", "all", "--src", root / "tree", "--out", root / "data", "--size", "32"]
    out = tmpi_on_cluster(cluster, *map(str, args), timeout=300)
    assert out.returncode == 0, show(out)
    return root / "data"


def test_ranks_see_two_hosts_and_local_ranks_from_mpi(cluster: SimCluster) -> None:
    code = (
        "from theanompi.comm import describe_hosts, local_rank, local_size, world;"
        "import socket; d = describe_hosts();"
        "print(world().Get_rank(), socket.gethostname(), local_rank(), local_size(), d)"
    )
    out = head_run(cluster, mpirun_command(4, [sys.executable, "-c", code], _placement(cluster)))
    assert out.returncode == 0, show(out)
    rows = sorted(line.split(maxsplit=4) for line in out.stdout.splitlines())
    assert [r[:4] for r in rows] == [
        ["0", "nodea", "0", "2"],
        ["1", "nodea", "1", "2"],
        ["2", "nodeb", "0", "2"],
        ["3", "nodeb", "1", "2"],
    ]
    assert all(r[4] == LAYOUT for r in rows)


def test_every_exchanger_bit_identical_across_nodes(cluster: SimCluster) -> None:
    """tests/exchange/mpi_exchange.py at N=4 over the veth: every strategy and compressor
    within its bound of the float64 reference, and the same bytes on all four ranks."""
    script = REPO / "tests" / "exchange" / "mpi_exchange.py"
    cmd = mpirun_command(4, [sys.executable, str(script)], _placement(cluster))
    out = head_run(cluster, cmd, timeout=600)
    assert out.returncode == 0 and "all checks passed" in out.stdout, show(out)


def test_bsp_digits_on_2x2_then_eval_equals_one_node(
    cluster: SimCluster, digits: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    out = tmpi_on_cluster(
        cluster, "train", "--data", str(digits), "--run-dir", str(run), timeout=900
    )
    assert out.returncode == 0, show(out)
    assert f"tmpi: {LAYOUT}" in out.stdout
    ends = [r for r in read_record(run) if r["kind"] == "epoch"]
    assert ends, out.stdout[-2000:]
    assert ends[-1]["val_top1_err"] <= 0.10, ends[-1]

    # eval across the nodes (-H form) equals eval on one node, to the last digit
    across = tmpi_on_cluster(
        cluster, "eval", "--data", str(digits), "--run-dir", str(run), use_host_list=True
    )
    assert across.returncode == 0, show(across)
    report = next((run / "checkpoints").glob("*.eval.json"))
    a = json.loads(report.read_text())
    report.unlink()
    local = tmpi("eval", "-n", "1", "--data", str(digits), "--run-dir", str(run))
    assert local.returncode == 0, local.stderr
    b = json.loads(report.read_text())
    assert a["ranks"] == 4 and b["ranks"] == 1
    for key in ("images", "top1_error", "top5_error", "loss"):
        assert a[key] == b[key], (key, a[key], b[key])


def test_easgd_with_the_server_on_node_a(cluster: SimCluster, digits: Path, tmp_path: Path) -> None:
    out = tmpi_on_cluster(
        cluster,
        "train",
        "--rule",
        "EASGD",
        "--data",
        str(digits),
        "--run-dir",
        str(tmp_path / "e"),
        "--epochs",
        "2",
        timeout=900,
    )
    assert out.returncode == 0, show(out)
    assert f"tmpi: {LAYOUT}" in out.stdout  # rank 0, the server, is on nodea
    assert "easgd" in out.stdout.lower()


def test_killing_one_node_ends_the_job_naming_the_host(
    cluster: SimCluster, digits: Path, tmp_path: Path
) -> None:
    """SIGKILL every process of nodeb (its daemon and both ranks) mid-training: the job ends
    within a minute with exit 1 and one line naming nodeb and its ranks (mpirun's banner
    dropped); nothing is left on either node."""
    args = ["--data", str(digits), "--run-dir", str(tmp_path / "k"), "--epochs", "50"]
    argv = [sys.executable, "-m", "theanompi.cli", "train", "-n", "4"]
    argv += ["--hostfile", str(cluster.hostfile), "--mpi-args", cluster.mpi_args, *args]
    argv += ["--set", "training.print_freq=1"]
    proc, lines = start_until(cluster, argv, "img/s")  # training printed a step
    rest, took = kill_and_wait(proc, cluster.pids(1))
    after = rest.splitlines()
    assert proc.returncode == 1, rest[-3000:]
    assert took < 60, took
    named = [line for line in after if "nodeb" in line or "198.18.0.2" in line]
    errors = [line for line in after if "error" in line.lower() or line.startswith("---")]
    one = (
        "tmpi: error: lost host nodeb (ranks 2-3): its mpirun daemon died or the node went "
        "down; mpirun stopped the other ranks"
    )
    assert named == errors == [one], rest[-3000:]  # mpirun's banner and the ranks' reports gone
    assert "tmpi-placement" not in "".join(lines) + rest  # the launcher's own traffic
    assert cluster.pids(0) == [] and cluster.pids(1) == []


def test_start_up_names_the_node_whose_data_differs_or_is_missing(
    cluster: SimCluster, digits: Path, tmp_path: Path
) -> None:
    """nodeb sees other files at the data path (a bind mount in its own mount namespace)."""
    other = tmp_path / "other"
    shutil.copytree(digits, other)
    manifest = other / "misc" / "manifest.json"
    man = json.loads(manifest.read_text())
    manifest.write_text(json.dumps(man | {"checksum": "0123abcd"}))
    empty = tmp_path / "empty"
    empty.mkdir()
    args = ["train", "--data", str(digits), "--run-dir", str(tmp_path / "r")]
    with cluster.node_setup(1, f"mount --bind {other} {digits}"):
        out = tmpi_on_cluster(cluster, *args, timeout=300)
    assert out.returncode == 3, show(out)
    assert (
        f"tmpi: error: data folder {str(digits)!r} differs between nodea and nodeb " in out.stderr
    )
    assert f"(manifest checksum {man['checksum']} vs 0123abcd)" in out.stderr
    with cluster.node_setup(1, f"mount --bind {empty} {digits}"):
        out = tmpi_on_cluster(cluster, *args, timeout=300)
    assert out.returncode == 3, show(out)
    errors = [line for line in out.stderr.splitlines() if "error" in line]
    assert errors == [
        f"tmpi: error: data folder {str(digits)!r} (its misc/manifest.json) is missing on nodeb "
        "but present on nodea; copy it there or use a shared file system"
    ], show(out)
