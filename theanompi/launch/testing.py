"""Test helpers: run real ``mpirun`` jobs and the real ``tmpi`` CLI in subprocesses.

Used by the test suite's fixtures (``tests/conftest.py``) and importable from any test module.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from theanompi.launch.mpirun import mpirun_command, mpirun_env
from theanompi.launch.restart import run_started

__all__ = ["REPO", "run_mpi", "tmpi"]

REPO = Path(__file__).resolve().parents[2]


def run_mpi(
    n: int,
    args: Sequence[str],
    timeout: float = 300,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``python <args>`` on ``n`` real MPI ranks; return the finished process (text output).

    With ``check`` (the default) a non-zero exit fails the test and shows both streams. A
    launch that mpirun failed to start (no rank ran) goes again, as the launcher's does.
    """
    cmd = mpirun_command(n, [sys.executable, *map(str, args)])
    full_env = mpirun_env(os.environ | {"PYTHONPATH": str(REPO)} | (env or {}))
    proc = run_started(cmd, timeout=timeout, env=full_env, cwd=cwd or REPO)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"mpirun -n {n} {' '.join(map(str, args))} exited {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
        )
    return proc


def tmpi(
    *args: str,
    timeout: float = 600,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run the ``tmpi`` CLI as a user would (``python -m theanompi.cli ...``); no check."""
    full_env = os.environ | {"PYTHONPATH": str(REPO)} | (env or {})
    return subprocess.run(
        [sys.executable, "-m", "theanompi.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=cwd or REPO,
    )
