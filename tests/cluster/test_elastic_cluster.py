"""Elastic training across the simulated two-node cluster (2 slots each), the digits CNN for 8
epochs with ``tmpi train -n 4 --min-np 2``, each ending within 2 points of top-1 error of an
undisturbed run on the same cluster:

* one job, both faults: rank 3 on nodeb SIGKILLs itself (its daemon lives): the other 3 shrink
  and go on (ULFM); then every process of nodeb is SIGKILLed, its mpirun daemon too, which ends
  the mpirun job (Open MPI's runtime cannot lose a daemon): the launcher relaunches on nodea's
  2 slots from the last checkpoint. Exit 0, the next step within 15 s, no process left;
* started on nodea only, a host discovery script offers nodeb from epoch 3 on: the job grows
  to 4 ranks for the last epochs."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from theanompi.io.record import read_record
from theanompi.launch.simcluster import SimCluster

from .conftest import kill_and_wait, start_until, tmpi_on_cluster

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.serial]

EPOCHS = 8


def _args(data: Path, run: Path) -> list[str]:
    return [
        "--min-np", "2", "--model", "digits", "--data", str(data), "--run-dir", str(run),
        "--epochs", str(EPOCHS), "--set", "training.print_freq=1",
    ]  # fmt: skip


def _top1(record: list[dict[str, Any]]) -> float:
    return [r for r in record if r["kind"] == "epoch"][-1]["val_top1_err"]


@pytest.fixture(scope="module")
def undisturbed(
    cluster: SimCluster, digits_data: Path, tmp_path_factory: pytest.TempPathFactory
) -> float:
    """The final top-1 error (a fraction) of the same run left alone on both nodes."""
    run = tmp_path_factory.mktemp("undisturbed") / "run"
    out = tmpi_on_cluster(cluster, "train", *_args(digits_data, run), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return _top1(read_record(run))


def _ends_near(record: list[dict[str, Any]], undisturbed: float, world: int) -> None:
    assert record[-1]["kind"] == "end" and record[-1]["world_size"] == world, record[-1]
    assert [r["epoch"] for r in record if r["kind"] == "epoch"] == list(range(EPOCHS))
    got = _top1(record)
    print(f"top-1 error {100 * got:.2f} % vs {100 * undisturbed:.2f} % undisturbed")
    assert abs(got - undisturbed) <= 0.02, (got, undisturbed)


def _none_left(cluster: SimCluster) -> None:
    deadline = time.monotonic() + 15
    while (cluster.pids(0) or cluster.pids(1)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cluster.pids(0) == [] and cluster.pids(1) == []


def test_a_lost_rank_then_a_lost_node_and_the_job_goes_on(
    cluster: SimCluster,
    digits_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    undisturbed: float,
) -> None:
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "theanompi.cli", "train", "-n", "4"]
    argv += ["--hostfile", str(cluster.hostfile), "--mpi-args", cluster.mpi_args]
    monkeypatch.setenv("THEANOMPI_FAIL", "kill:3:8")  # launch rank 3, on nodeb, before step 9
    pattern = rf"epoch 2/{EPOCHS} step 2/"  # N=3: 16 steps an epoch
    proc, lines = start_until(cluster, [*argv, *_args(digits_data, run)], pattern)
    said = "".join(lines)
    assert re.search(r"elastic: lost rank 3 \(nodeb\); 3 of 4 ranks go on from step 8 ", said), said
    node_b = cluster.pids(1)  # its daemon and rank 2
    killed = time.time()
    rest, took = kill_and_wait(proc, node_b, timeout=240)
    assert proc.returncode == 0, said[-2000:] + rest[-3000:]
    assert "tmpi: elastic: going on without nodeb: 2 ranks on hosts 198.18.0.1:2" in rest, rest
    assert "Traceback" not in rest, rest[-3000:]
    rec = read_record(run)
    first = min(r["time"] for r in rec if r["kind"] == "step" and r["time"] > killed)
    print(f"node lost -> next step {first - killed:.1f} s; job end {took:.1f} s after")
    assert first - killed < 15.0
    _ends_near(rec, undisturbed, world=2)
    _none_left(cluster)


def test_a_node_offered_by_the_discovery_script_is_taken_in(
    cluster: SimCluster, digits_data: Path, tmp_path: Path, undisturbed: float
) -> None:
    """Started on nodea only (the discovery script offers its 2 slots); from epoch 3 on the
    script offers nodeb too: the ranks stop at a step boundary and the job goes on on 4."""
    offered = tmp_path / "hosts"
    a, b = (f"{h}:{cluster.slots}" for h in cluster.addresses)
    offered.write_text(a + "\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {offered}\n")
    script.chmod(0o755)
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "theanompi.cli", "train", "-n", "4"]
    argv += ["--host-discovery-script", str(script), "--mpi-args", cluster.mpi_args]
    proc, lines = start_until(cluster, [*argv, *_args(digits_data, run)], rf"epoch 3/{EPOCHS} ")
    assert "2 ranks on 1 host: nodea x2" in "".join(lines), "".join(lines)
    offered.write_text(f"{a}\n{b}\n")
    t_offered = time.time()
    rest, _ = kill_and_wait(proc, [], timeout=240)
    assert proc.returncode == 0, "".join(lines)[-2000:] + rest[-3000:]
    assert f"tmpi: elastic: growing: 4 ranks on hosts {a}, {b}, from " in rest, rest
    assert "4 ranks on 2 hosts: nodea x2 (ranks 0-1), nodeb x2 (ranks 2-3)" in rest, rest
    rec = read_record(run)
    grown = [r for r in rec if r["kind"] == "start"][-1]
    assert grown["world_size"] == 4 and grown["start_epoch"] >= 2  # from epoch 3 on (0-based)
    first = min(r["time"] for r in rec if r["kind"] == "step" and r["time"] > grown["time"])
    print(f"nodeb offered -> first step on 4 ranks {first - t_offered:.1f} s")
    _ends_near(rec, undisturbed, world=4)
    _none_left(cluster)
