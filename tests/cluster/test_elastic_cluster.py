"""Elastic training across the simulated two-node cluster (2 slots each): the digits CNN for 8
epochs with ``tmpi train -n 4 --min-np 2 --host-discovery-script S``, one job through all three
changes of the world, ending within 2 points of top-1 error of an undisturbed run:

1. it starts on nodea only (the script offers its 2 slots); from epoch 3 on the script offers
   nodeb too: the ranks stop at a step boundary and the job goes on on 4;
2. 4 steps into the grown job rank 3 (on nodeb) is SIGKILLed, its daemon alive: the other 3
   shrink and go on in the same job (ULFM);
3. 4 steps later every process of nodeb is SIGKILLed, its mpirun daemon too, which ends the
   mpirun job (Open MPI's runtime cannot lose a daemon): the launcher relaunches on nodea's 2
   slots from the last checkpoint, and does not take nodeb back though the script still
   offers it.

Where the 2 ranks stop for the growth depends on timing (the launcher asks the script every
2 s; epoch 4 to 6 here), so the kills count steps from it, not epochs.

Exit 0, no process left on either node. About 30 s: the undisturbed run and the job are 8
epochs each (the issue's bar); the three changes share one job (a module fixture) so as not to
pay two more, and each is checked by its own test."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from theanompi.io.record import read_record
from theanompi.launch.simcluster import SimCluster

from .conftest import kill_and_wait, start_until, tmpi_on_cluster

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.serial]

EPOCHS = 8
STEP = rf"epoch \d+/{EPOCHS} step \d+/"  # a progress line (print_freq 1: every step)
STEPS_BETWEEN = 4  # steps trained between two changes of the world


def _args(data: Path, run: Path) -> list[str]:
    return [
        "--min-np", "2", "--model", "digits", "--data", str(data), "--run-dir", str(run),
        "--epochs", str(EPOCHS), "--set", "training.print_freq=1",
    ]  # fmt: skip


def _top1(record: list[dict[str, Any]]) -> float:
    return [r for r in record if r["kind"] == "epoch"][-1]["val_top1_err"]


def _read_until(proc: subprocess.Popen[str], pattern: str, lines: list[str]) -> str:
    """Lines of ``proc`` (appended to ``lines``) until one matches ``pattern``: that line."""
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if re.search(pattern, line):
            return line
    pytest.fail(f"no line matched {pattern!r}:\n" + "".join(lines[-40:]))


def _rank_pid(cluster: SimCluster, node: int, rank: int) -> int:
    """The pid of launch rank ``rank`` in node ``node``."""
    for pid in cluster.pids(node):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"OMPI_COMM_WORLD_RANK={rank}".encode() in env:
            return pid
    pytest.fail(f"no rank {rank} in node {node}")


@dataclass(frozen=True)
class Job:
    """What the one elastic job left: its output, exit code, record and the times of each change
    (the test's clock), beside the undisturbed run's record."""

    said: str
    after_node: str
    code: int
    record: list[dict[str, Any]]
    #: the record as it stood just before nodeb went: the node's relaunch resumes from the
    #: epoch's checkpoint and drops that epoch's entries, the 4- and 3-rank steps among them
    before_node: list[dict[str, Any]]
    undisturbed: list[dict[str, Any]]
    t_offered: float
    t_rank: float
    t_node: float
    hosts: tuple[str, str]
    left: tuple[list[int], list[int]]

    def starts(self) -> list[dict[str, Any]]:
        return [r for r in self.record if r["kind"] == "start"]

    def first_step_after(self, t: float, record: list[dict[str, Any]] | None = None) -> float:
        steps = [r["time"] for r in (record or self.record) if r["kind"] == "step"]
        return min(s for s in steps if s > t)


@pytest.fixture(scope="module")
def job(cluster: SimCluster, digits_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Job:
    calm = tmp_path_factory.mktemp("undisturbed") / "run"
    out = tmpi_on_cluster(cluster, "train", *_args(digits_data, calm), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    tmp_path = tmp_path_factory.mktemp("elastic")
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
    try:
        assert "2 ranks on 1 host: nodea x2" in "".join(lines), "".join(lines)
        offered.write_text(f"{a}\n{b}\n")  # 1. nodeb comes
        t_offered = time.time()
        _read_until(proc, r"4 ranks on 2 hosts: nodea x2 \(ranks 0-1\), nodeb x2", lines)
        for _ in range(STEPS_BETWEEN):  # where the 2 ranks stopped for it depends on timing
            _read_until(proc, STEP, lines)
        os.kill(_rank_pid(cluster, 1, 3), signal.SIGKILL)  # 2. rank 3 goes
        t_rank = time.time()
        _read_until(proc, r"elastic: lost rank 3 \(nodeb\); 3 of 4 ranks go on from step ", lines)
        for _ in range(STEPS_BETWEEN):
            _read_until(proc, STEP, lines)
    except BaseException:
        proc.kill()
        raise
    before_node = read_record(run)
    t_node = time.time()
    rest, _ = kill_and_wait(proc, cluster.pids(1), timeout=240)  # 3. nodeb goes
    deadline = time.monotonic() + 15
    while (cluster.pids(0) or cluster.pids(1)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return Job(
        said="".join(lines) + rest,
        after_node=rest,
        code=proc.returncode,
        record=read_record(run),
        before_node=before_node,
        undisturbed=read_record(calm),
        t_offered=t_offered,
        t_rank=t_rank,
        t_node=t_node,
        hosts=(a, b),
        left=(cluster.pids(0), cluster.pids(1)),
    )


def test_the_job_ends_well_on_nodea_leaving_no_process(job: Job) -> None:
    assert job.code == 0, job.said[-4000:]
    assert "Traceback" not in job.said, job.said[-3000:]
    assert job.record[-1]["kind"] == "end" and job.record[-1]["world_size"] == 2, job.record[-1]
    assert [r["epoch"] for r in job.record if r["kind"] == "epoch"] == list(range(EPOCHS))
    assert job.left == ([], [])


def test_grown_on_nodeb_when_the_script_offers_it(job: Job) -> None:
    a, b = job.hosts
    assert f"tmpi: elastic: growing: 4 ranks on hosts {a}, {b}, from " in job.said, job.said
    assert job.said.count("elastic: growing") == 1, job.said  # nodeb, lost, is not taken back
    starts = job.starts()
    assert [s["world_size"] for s in starts] == [2, 4, 3, 2], starts
    assert starts[1]["start_epoch"] >= 2  # grown from epoch 3 on (0-based)
    seconds = job.first_step_after(starts[1]["time"], job.before_node) - job.t_offered
    print(f"nodeb offered -> first step on 4 ranks {seconds:.1f} s")  # no bar: 3.5 s quiet,
    # 17 s in a CI run under load with a launch that failed to start and went again
    on_4 = [r for r in job.before_node if r["kind"] == "step" and starts[1]["time"] < r["time"]]
    on_4 = [r for r in on_4 if r["time"] < starts[2]["time"]]
    assert len(on_4) >= STEPS_BETWEEN, on_4  # trained on 4 ranks until rank 3 was killed


def test_a_lost_rank_leaves_and_three_go_on_within_5_s(job: Job) -> None:
    shrunk = job.starts()[2]
    assert shrunk["world_size"] == 3 and shrunk["elastic"]["lost_ranks"] == [3], shrunk
    seconds = job.first_step_after(job.t_rank, job.before_node) - job.t_rank
    print(f"rank 3 lost -> next step {seconds:.1f} s")
    assert seconds < 5.0
    steps = [r for r in job.before_node if r["kind"] == "step" and r["time"] < job.t_rank]
    done = max(r["step"] for r in steps)
    redone = done - shrunk["elastic"]["step"]
    assert 0 <= redone <= 1, (done, shrunk["elastic"])  # elastic.commit_every_steps: 1


def test_a_lost_node_goes_on_on_nodea_within_15_s(job: Job) -> None:
    assert "tmpi: elastic: going on without nodeb: 2 ranks on hosts 198.18.0.1:2" in job.after_node
    seconds = job.first_step_after(job.t_node) - job.t_node
    print(f"nodeb lost -> next step {seconds:.1f} s")
    assert seconds < 15.0


def test_top1_within_2_points_of_an_undisturbed_run(job: Job) -> None:
    got, undisturbed = _top1(job.record), _top1(job.undisturbed)
    print(f"top-1 error {100 * got:.2f} % vs {100 * undisturbed:.2f} % undisturbed")
    assert abs(got - undisturbed) <= 0.02, (got, undisturbed)
