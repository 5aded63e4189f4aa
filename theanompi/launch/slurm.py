"""Slurm's side of a job: a restart to resume, a stop signal that requeues, mpirun's daemons kept alive.

Slurm warns a job before its time limit or a preemption with a signal (``#SBATCH
--signal=USR1@90``, ``scancel --signal=USR1``): the ranks stop at a step boundary and write a
checkpoint (:class:`~theanompi.launch.signals.StopFlag`), then rank 0 puts the job back in
the queue (``scontrol requeue``), as Lightning's ``SLURMEnvironment(auto_requeue=True)`` does.
The requeued job starts again with ``SLURM_RESTART_COUNT`` >= 1 and ``tmpi train`` resumes
from the run dir's latest checkpoint by itself.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = [
    "ON_SIGNAL",
    "EXIT_REQUEUED",
    "EXIT_STOPPED",
    "restart_count",
    "job_id",
    "job_fields",
    "wants_requeue",
    "requeue",
    "stop_code",
    "requeue_after_stop",
    "prted_agent_args",
    "main",
]

#: ``tmpi train --on-signal``: what a stop signal does once the checkpoint is written
ON_SIGNAL = ("checkpoint", "requeue")
#: stopped on a signal, checkpoint written, to be run again (requeued under Slurm): EX_TEMPFAIL
EXIT_REQUEUED = 75
EXIT_STOPPED = 130  # stopped on a signal, checkpoint written: ``--resume`` continues it


def job_id(env: Mapping[str, str] | None = None) -> str | None:
    """The Slurm job this process runs in (None outside one)."""
    env = os.environ if env is None else env
    return env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or None


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How often Slurm has requeued and restarted this job (0: first run, or no Slurm)."""
    env = os.environ if env is None else env
    text = env.get("SLURM_RESTART_COUNT", "")
    return int(text) if text.isdigit() and job_id(env) else 0


def job_fields(job: str, scontrol: str | None = None) -> dict[str, str]:
    """``scontrol show job -o JOB`` as ``{key: value}`` ({} when scontrol fails)."""
    exe = scontrol or shutil.which("scontrol") or "scontrol"
    try:
        out = subprocess.run(
            [exe, "show", "job", "-o", job], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return {}
    if out.returncode != 0:
        return {}
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def _interrupted_by_us(fields: Mapping[str, str]) -> bool:
    """The job still runs, or only its batch script died of the stop signal (``scancel
    --signal=USR1 --full`` kills an untrapped bash script: FAILED, ExitCode 0:10)."""
    state = fields.get("JobState", "")
    if state in ("RUNNING", "COMPLETING"):
        return True
    return state == "FAILED" and fields.get("ExitCode", "") == f"0:{int(signal.SIGUSR1)}"


def wants_requeue(mode: str | None, env: Mapping[str, str] | None = None) -> bool:
    """Whether a stop ends in a requeue: ``--on-signal requeue``, or by default inside a Slurm
    batch job submitted requeueable (``sbatch --requeue``, or the cluster's ``JobRequeue=1``)."""
    if mode is not None:
        return mode == "requeue"
    job = job_id(env)
    if job is None:
        return False
    fields = job_fields(job)
    return fields.get("Requeue") == "1" and fields.get("BatchFlag") == "1"


def requeue(job: str) -> str | None:
    """``scontrol requeue JOB`` when the job was stopped by its signal (not cancelled);
    returns why not, or None when done."""
    fields = job_fields(job)
    if not fields:
        return f"scontrol show job {job} failed (is scontrol on PATH, SLURM_CONF set?)"
    if not _interrupted_by_us(fields):
        return f"job {job} is {fields.get('JobState', '?')}: not requeued"
    out = subprocess.run(
        ["scontrol", "requeue", job], capture_output=True, text=True, timeout=60, check=False
    )
    if out.returncode != 0:
        return f"scontrol requeue {job}: {(out.stderr or out.stdout).strip()}"
    return None


def stop_code(mode: str | None, env: Mapping[str, str] | None = None) -> int:
    """The exit code of a run stopped on a signal with its checkpoint written:
    :data:`EXIT_REQUEUED` where :func:`wants_requeue`, else :data:`EXIT_STOPPED`."""
    return EXIT_REQUEUED if wants_requeue(mode, env) else EXIT_STOPPED


def _script_died_of_stop(fields: Mapping[str, str]) -> bool:
    """The batch script died of SIGUSR1 (an untrapped bash under ``scancel --signal=USR1
    --full``: the job FAILED with ExitCode 0:10, taking its steps with it), in a job that
    may be requeued."""
    died = fields.get("JobState") == "FAILED" and fields.get("ExitCode") == f"0:{signal.SIGUSR1:d}"
    return died and fields.get("Requeue") == "1" and fields.get("BatchFlag") == "1"


def _settled(job: str, timeout: float = 60.0) -> dict[str, str]:
    """The job's fields once it is no longer COMPLETING: the ranks can see a host lost to
    the job's end (its steps killed) before Slurm has finished it, and while it completes
    its state does not yet say how it ended."""
    end = time.monotonic() + timeout
    fields = job_fields(job)
    while fields.get("JobState") == "COMPLETING" and time.monotonic() < end:
        time.sleep(0.5)
        fields = job_fields(job)
    return fields


def requeue_after_stop(code: int, env: Mapping[str, str] | None = None) -> int:
    """Once every rank has exited with ``code``, inside a Slurm job: requeue it when ``code``
    is :data:`EXIT_REQUEUED`, or when the batch script died of the stop signal (the job ended
    under the ranks before their checkpoint: the restart resumes from the one before). One
    line says so, or why not (a cancelled job stays cancelled: :data:`EXIT_STOPPED`).
    Returns the exit code to end with."""
    job = job_id(env)
    if job is None or code == 0:
        return code
    if code != EXIT_REQUEUED:
        if not _script_died_of_stop(_settled(job)):
            return code
        print(
            f"tmpi: the batch script of Slurm job {job} died of SIGUSR1 (untrapped; scancel "
            "--full), ending the job: requeueing it to resume from the latest checkpoint",
            file=sys.stderr,
            flush=True,
        )
    why = requeue(job)
    if why is None:
        print(f"tmpi: requeued Slurm job {job}; it resumes from its checkpoint", file=sys.stderr)
        return EXIT_REQUEUED
    print(f"tmpi: {why}", file=sys.stderr, flush=True)
    return EXIT_STOPPED if code == EXIT_REQUEUED else code


def prted_agent_args() -> list[str]:
    """mpirun arguments that start its remote daemons (``srun ... prted``) through
    ``python -m theanompi.launch.slurm prted``, which ignores SIGUSR1 and blocks SIGTERM:
    Slurm signals every process of a job step (``--signal=USR1@T``; SIGTERM on preemption
    or when the job ends, SIGKILL a grace time later), and a daemon that dies of USR1, or
    takes SIGTERM (it kills its ranks 0.5 s later), loses its node before the ranks reach a
    step boundary. The ranks it starts still get the signal (their StopFlag listens)."""
    return ["--prtemca", "prte_launch_agent", f"{sys.executable} -m theanompi.launch.slurm prted"]


def _exec_prted(argv: Sequence[str]) -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # kept across exec; the ranks set their own
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # kept too; prted's children unblock
    here = Path(sys.executable).parent / "prted"
    prted = str(here) if here.exists() else shutil.which("prted") or "prted"
    os.execv(prted, [prted, *argv])


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m theanompi.launch.slurm prted ARGS``: mpirun's daemon, SIGUSR1 ignored and
    SIGTERM blocked."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["prted"]:
        _exec_prted(args[1:])
    print("usage: python -m theanompi.launch.slurm prted ARGS", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
