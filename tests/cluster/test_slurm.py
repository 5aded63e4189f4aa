"""On a simulated two-node Slurm cluster (``pipelines/slurm_sim.sh``): a user's plain batch script
trains across both nodes, and SIGUSR1 (Slurm's preemption/time-limit warning) ends in a
checkpoint, a requeue by the job itself and a resumed run with the same final parameters."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from theanompi.launch.testing import REPO

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.serial]

SIM = REPO / "pipelines" / "slurm_sim.sh"
EPOCHS = 4
JOB = """#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=2 --requeue
#SBATCH --output={out}/%j.out --open-mode=append
cd {repo}
tmpi train -n 4 --model digits --data {data} --epochs {epochs} --run-dir "$RUN"
"""


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


def test_batch_script_preempted_requeues_itself_and_resumes_to_the_same_parameters(
    slurm: dict[str, str], digits_data: Path, tmp_path: Path
) -> None:
    script = tmp_path / "job.sh"  # the user's plain batch script: no trap, no exec
    script.write_text(JOB.format(out=tmp_path, repo=REPO, data=digits_data, epochs=EPOCHS))

    ref = _submit(slurm, script, tmp_path / "ref")  # uninterrupted
    done = _wait_done(slurm, ref, tmp_path / f"{ref}.out")
    ref_log = _text(tmp_path / f"{ref}.out")
    assert done["JobState"] == "COMPLETED", ref_log
    assert "4 ranks on 2 hosts: nodeA x2 (ranks 0-1), nodeB x2 (ranks 2-3)" in ref_log

    job = _submit(slurm, script, tmp_path / "pre")
    log = tmp_path / f"{job}.out"
    end = time.monotonic() + 300
    while "epoch 2/4 done" not in _text(log) and time.monotonic() < end:
        time.sleep(0.2)
    _run(slurm, "scancel", "--signal=USR1", job)  # what --signal=USR1@T sends
    done = _wait_done(slurm, job, log)
    text = _text(log)
    assert done["JobState"] == "COMPLETED" and done["Restarts"] == "1", text
    assert f"tmpi: requeued Slurm job {job}" in text
    resumed = re.search(r"resumed from \S+/(epoch_0002_step_\d+)\.npz", text)
    assert resumed, text  # the mid-epoch checkpoint written on the signal
    assert f"epoch {EPOCHS}/{EPOCHS} done" in text
    err = float(re.findall(r"val loss \S+ top-1 err ([\d.]+)%", text)[-1])
    assert err <= 10.0, text
    sacct = _run(slurm, "sacct", "-c", "-j", job, "-n", "-o", "state")
    assert sacct.split()[-1] == "COMPLETED", sacct

    final = f"checkpoints/epoch_{EPOCHS:04d}.npz"
    want, got = _params(tmp_path / "ref" / final), _params(tmp_path / "pre" / final)
    assert want.keys() == got.keys()
    assert all(np.array_equal(want[k], got[k]) for k in want), "resumed run differs"


@pytest.mark.skipif(
    os.environ.get("THEANOMPI_SLURM_FULL") != "1",
    reason="about 80 s more: `make test-slurm` runs it (THEANOMPI_SLURM_FULL=1)",
)
def test_full_usr1_kills_the_plain_script_and_the_launcher_requeues_the_job(
    slurm: dict[str, str], digits_data: Path, tmp_path: Path
) -> None:
    """``scancel --signal=USR1 --full`` also signals the untrapped batch script, which dies of
    it (the job FAILED, ExitCode 0:10) and takes the steps with it: the launcher, which
    outlives it here (proctrack/linuxproc), requeues the job, and the restart resumes from the
    last epoch checkpoint to the end."""
    script = tmp_path / "job.sh"
    script.write_text(JOB.format(out=tmp_path, repo=REPO, data=digits_data, epochs=EPOCHS))
    job = _submit(slurm, script, tmp_path / "full")
    log = tmp_path / f"{job}.out"
    end = time.monotonic() + 300
    while "epoch 2/4 done" not in _text(log) and time.monotonic() < end:
        time.sleep(0.2)
    _run(slurm, "scancel", "--signal=USR1", "--full", job)
    done = _wait_done(slurm, job, log)
    text = _text(log)
    assert done["JobState"] == "COMPLETED" and done["Restarts"] == "1", text
    assert "died of SIGUSR1" in text and f"tmpi: requeued Slurm job {job}" in text
    assert re.search(r"resumed from \S+/epoch_0002\.npz", text), text
    assert f"epoch {EPOCHS}/{EPOCHS} done" in text
