"""On a simulated two-node Slurm cluster (``pipelines/slurm_sim.sh``): a user's plain batch script
(no ``exec``, no ``trap``) trains across both nodes, and each way a cluster interrupts it ends
in a checkpoint, a requeue and a resumed run to the last epoch: SIGUSR1 to the job's steps
(``--signal=USR1@T``, ``scancel --signal=USR1``), SIGUSR1 to every process of the job, the
batch script included (``scancel --full``), and preemption by a job of a higher-priority
partition (SIGTERM, GraceTime, requeue). Each test takes 20-25 s: a job, its requeue hold
(``cred_expire``, 5 s) and the resumed job; the reference run is shared.

Each interruption lands at a known step: the job is held there (its rank 0 stops itself,
the others are stopped beside it) until the signal is pending. Sent at a moment read from
the job's output instead, Slurm's delivery, a scheduling cycle or more under load, once
landed after the run's last step (no requeue: a failed test)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from theanompi.io.record import read_record
from theanompi.launch.testing import REPO

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.serial]

SIM = REPO / "pipelines" / "slurm_sim.sh"
EPOCHS = 4
HOLD = 30  # a step of the third epoch (12 steps an epoch on 4 ranks), where a signal lands
JOB = """#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=2 --requeue
#SBATCH --output={out}/%j.out --open-mode=append
cd {repo}
tmpi train -n 4 --model digits --data {data} --epochs {epochs} --run-dir "$RUN"
"""
# the plain script whose first run (not the requeued one) holds before step {hold}
HELD_JOB = JOB.replace(
    "cd {repo}\n",
    'cd {repo}\n[ "${{SLURM_RESTART_COUNT:-0}}" = 0 ] && export THEANOMPI_FAIL=stop:0:{hold}\n',
)


def _env_from(exports: str) -> dict[str, str]:
    """The environment after ``eval "$(slurm_sim.sh up DIR)"``, less this process's MPI
    variables (pytest may itself run under mpirun)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k == "THEANOMPI_CACHE"
        or not k.startswith(("OMPI_", "PMIX_", "PRTE_", "THEANOMPI_", "SLURM_"))
    }
    for key, value in re.findall(r"^export (\w+)=(.*)$", exports, re.M):
        env[key] = value.replace("$PATH", env.get("PATH", ""))
    return env


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The simulated cluster's environment (SLURM_CONF, PATH); always torn down."""
    if os.geteuid() != 0:
        pytest.skip("the simulated Slurm cluster needs root (network namespaces, slurmd)")
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("the simulated Slurm cluster needs iproute2 and util-linux")
    where = tmp_path_factory.mktemp("slurm")
    try:
        up = subprocess.run(
            [str(SIM), "up", str(where)], capture_output=True, text=True, timeout=600
        )
        if up.returncode != 0 and shutil.which("slurmctld") is None:
            pytest.skip(f"slurm could not be installed: {up.stderr.strip()[-300:]}")
        assert up.returncode == 0, up.stderr
        yield _env_from(up.stdout)
    finally:
        subprocess.run([str(SIM), "down", str(where)], capture_output=True, timeout=120)


def _run(env: dict[str, str], *argv: str) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, f"{argv}: {out.stderr}"
    return out.stdout


def _submit(env: dict[str, str], script: Path, run: Path) -> str:
    job_env = env | {"RUN": str(run)}
    return _run(job_env, "sbatch", "--parsable", str(script)).strip()


def _job(env: dict[str, str], job: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S*)", _run(env, "scontrol", "show", "job", "-o", job)))


def _wait_done(env: dict[str, str], job: str, log: Path, timeout: float = 600) -> dict[str, str]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        fields = _job(env, job)
        if fields["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            return fields
        time.sleep(1)
    _run(env, "scancel", job)
    pytest.fail(f"job {job} not done in {timeout} s: {fields}\n{_text(log)}")


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _params(checkpoint: Path) -> dict[str, np.ndarray]:
    with np.load(checkpoint) as z:
        return {k: z[k] for k in z.files if k != "meta"}


@pytest.fixture(scope="module")
def reference(
    slurm: dict[str, str], digits_data: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, np.ndarray]:
    """The final parameters of the plain script's run left alone."""
    where = tmp_path_factory.mktemp("reference")
    job = _submit(slurm, _script(where, digits_data, EPOCHS, JOB), where / "run")
    done = _wait_done(slurm, job, where / f"{job}.out")
    log = _text(where / f"{job}.out")
    assert done["JobState"] == "COMPLETED", log
    assert "4 ranks on 2 hosts: nodeA x2 (ranks 0-1), nodeB x2 (ranks 2-3)" in log
    return _params(where / "run" / f"checkpoints/epoch_{EPOCHS:04d}.npz")


def _script(where: Path, data: Path, epochs: int, job_text: str) -> Path:
    script = where / "job.sh"
    script.write_text(job_text.format(out=where, repo=REPO, data=data, epochs=epochs, hold=HOLD))
    return script


def _started(
    env: dict[str, str], data: Path, where: Path, epochs: int, job_text: str, until: str
) -> tuple[str, Path]:
    """The script ``job_text`` submitted, once its output holds ``until``: (job, its output
    file)."""
    job = _submit(env, _script(where, data, epochs, job_text), where / "run")
    log = where / f"{job}.out"
    end = time.monotonic() + 300
    while until.format(epochs=epochs) not in _text(log) and time.monotonic() < end:
        time.sleep(0.2)
    return job, log


def _ranks(run: Path) -> list[int]:
    """The pids of the ranks (on both nodes: one pid namespace) of the job training ``run``."""
    want = f"RUN={run}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            env = (proc / "environ").read_bytes().split(b"\0") if proc.name.isdigit() else []
        except OSError:
            continue
        if want in env and any(v.startswith(b"OMPI_COMM_WORLD_RANK=") for v in env):
            pids.append(int(proc.name))
    return pids


def _state(pid: int) -> str:
    """``pid``'s state letter (``T``: stopped), ``X`` once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def _pending(pid: int, signums: tuple[int, ...]) -> bool:
    """Whether one of ``signums`` waits for stopped ``pid``."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return False
    masks = [int(line.split()[1], 16) for line in lines if line.startswith(("SigPnd", "ShdPnd"))]
    return any(mask >> (signum - 1) & 1 for mask in masks for signum in signums)


def _held(env: dict[str, str], data: Path, where: Path) -> tuple[str, Path, list[int]]:
    """The plain script submitted with launch rank 0 stopping itself before step ``HOLD`` of
    its first run (``THEANOMPI_FAIL=stop``), in its third epoch, and the other ranks, waiting
    on it in that step's exchange, stopped too: (job, its output file, the ranks' pids).
    Slurm's signal, whose delivery under load can take longer than the rest of the run, then
    lands at that step."""
    job = _submit(env, _script(where, data, EPOCHS, HELD_JOB), where / "run")
    log = where / f"{job}.out"
    end = time.monotonic() + 300
    while time.monotonic() < end:
        pids = _ranks(where / "run")
        if len(pids) == 4 and "T" in map(_state, pids):
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            return job, log, pids
        time.sleep(0.2)
    pytest.fail(f"job {job}: no rank stopped at step {HOLD} in 300 s\n{_text(log)}")


def _released(pids: list[int]) -> None:
    """SIGCONT to the held ranks once one has a stop request pending (SIGUSR1 from Slurm or
    mpirun, SIGTERM), or runs again (Slurm may send SIGCONT first): a signal reaches only
    the ranks of Slurm's steps (nodeB's; nodeA's are mpirun's), and one rank's request stops
    them all at one step."""
    end = time.monotonic() + 120
    while time.monotonic() < end:
        if any(
            _pending(pid, (signal.SIGUSR1, signal.SIGTERM)) or _state(pid) != "T" for pid in pids
        ):
            break
        time.sleep(0.02)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def _resumed_to_the_end(env: dict[str, str], job: str, log: Path, epochs: int) -> str:
    """The job's output, once it is COMPLETED after a requeue: it resumed from a checkpoint
    written after its second epoch, trained to the last epoch, and no mpirun box."""
    done = _wait_done(env, job, log)
    text = _text(log)
    assert done["JobState"] == "COMPLETED" and int(done["Restarts"]) >= 1, text
    assert f"tmpi: requeued Slurm job {job}" in text
    found = re.search(r"resumed from \S+/epoch_(\d{4})(_step_\d+)?\.npz", text)
    assert found and 2 <= int(found[1]) < epochs, text
    assert f"epoch {epochs}/{epochs} done" in text
    assert "-----" not in text, text  # the ranks' own lines said it all
    err = float(re.findall(r"val loss \S+ top-1 err ([\d.]+)%", text)[-1])
    assert err <= 10.0, text
    sacct = _run(env, "sacct", "-c", "-j", job, "-n", "-o", "state")
    assert sacct.split()[-1] == "COMPLETED", sacct
    return text


def _same(reference: dict[str, np.ndarray], run: Path) -> None:
    got = _params(run / f"checkpoints/epoch_{EPOCHS:04d}.npz")
    assert reference.keys() == got.keys()
    assert all(np.array_equal(reference[k], got[k]) for k in reference), "resumed run differs"


def test_usr1_to_the_steps_checkpoints_requeues_and_resumes_to_the_same_parameters(
    slurm: dict[str, str], reference: dict[str, np.ndarray], digits_data: Path, tmp_path: Path
) -> None:
    job, log, ranks = _held(slurm, digits_data, tmp_path)
    _run(slurm, "scancel", "--signal=USR1", job)  # what --signal=USR1@T sends
    _released(ranks)
    text = _resumed_to_the_end(slurm, job, log, EPOCHS)
    assert re.search(r"resumed from \S+/epoch_0002_step_\d+\.npz", text), text  # the signal's
    _same(reference, tmp_path / "run")


def test_usr1_to_every_process_of_the_job_requeues_and_resumes_to_the_last_epoch(
    slurm: dict[str, str], digits_data: Path, tmp_path: Path
) -> None:
    """``scancel --signal=USR1 --full`` kills the untrapped batch script, and the job ends
    under the ranks: the launcher, which outlives the script here (proctrack/linuxproc; under
    proctrack/cgroup Slurm kills it too, see docs/cluster.md), requeues the job once the ranks
    have stopped (mpirun's daemons live on until Slurm's SIGKILL, KillWait later)."""
    job, log, ranks = _held(slurm, digits_data, tmp_path)
    _run(slurm, "scancel", "--signal=USR1", "--full", job)
    _released(ranks)
    _resumed_to_the_end(slurm, job, log, EPOCHS)


def test_preemption_by_a_higher_priority_partition_resumes_to_the_same_parameters(
    slurm: dict[str, str], reference: dict[str, np.ndarray], digits_data: Path, tmp_path: Path
) -> None:
    """A job of partition ``urgent`` (PriorityTier 2) needs a CPU of the training job's nodes:
    Slurm sends the training job's steps SIGTERM (GraceTime=30 before SIGKILL); its ranks
    stop at a step boundary with a checkpoint, the job goes back to the queue, the
    preemptor runs, and the job resumes by itself to the same final parameters (BSP)."""
    job, log, ranks = _held(slurm, digits_data, tmp_path)
    urgent = _run(
        slurm, "sbatch", "--parsable", "-p", "urgent", "-N1", "-n1",
        f"--output={tmp_path}/urgent.out", "--wrap", "hostname",
    ).strip()  # fmt: skip
    _released(ranks)
    text = _resumed_to_the_end(slurm, job, log, EPOCHS)
    assert re.search(r"resumed from \S+/epoch_0002_step_\d+\.npz", text), text  # held there
    first = _job(slurm, urgent)
    assert first["JobState"] == "COMPLETED", first
    assert first["StartTime"] <= _job(slurm, job)["StartTime"], "the preemptor ran first"
    _same(reference, tmp_path / "run")


ELASTIC_JOB = """#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=2 --no-kill
#SBATCH --output={out}/%j.out --open-mode=append
cd {repo}
export THEANOMPI_FAIL=kill:3:8  # launch rank 3, on nodeB, before its step 9
tmpi train -n 4 --min-np 2 --model digits --data {data} --epochs {epochs} --run-dir "$RUN" \\
  --set training.print_freq=1
"""


def test_elastic_a_lost_rank_then_node_b_down_and_the_job_goes_on(
    slurm: dict[str, str], digits_data: Path, tmp_path: Path
) -> None:
    """Last of this module: it takes nodeB down. ``sbatch --no-kill``, ``tmpi train -n 4
    --min-np 2``: rank 3 on nodeB SIGKILLs itself (3 go on, ULFM), then every process of
    nodeB, its slurmd too: the launcher relaunches on nodeA's 2 slots of the allocation, and
    the job completes (Slurm marks nodeB DOWN, and --no-kill keeps the job)."""
    until = "epoch 2/{epochs} step 2/"
    job, log = _started(slurm, digits_data, tmp_path, EPOCHS, ELASTIC_JOB, until)
    text = _text(log)
    assert "elastic: lost rank 3 (nodeB); 3 of 4 ranks go on from step 8 " in text, text
    pids = subprocess.run(["ip", "netns", "pids", "tmslB"], capture_output=True, text=True)
    for pid in pids.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    done = _wait_done(slurm, job, log)
    text = _text(log)
    assert done["JobState"] == "COMPLETED", text
    assert "tmpi: elastic: going on without nodeB: 2 ranks on Slurm allocation nodeA:2" in text
    rec = read_record(tmp_path / "run")
    assert rec[-1]["kind"] == "end" and rec[-1]["world_size"] == 2, rec[-1]
    assert [r["epoch"] for r in rec if r["kind"] == "epoch"] == list(range(EPOCHS))
