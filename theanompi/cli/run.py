"""``tmpi run``: start any script on N ranks, as ``torchrun``/``horovodrun`` do, with ``tmpi train``'s
supervision and exit codes."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path
from typing import Annotated

import typer

from theanompi.cli._options import Hostfile, Hosts, MpiArgs, NProcs
from theanompi.comm import under_mpirun
from theanompi.errors import ConfigError, UserError

__all__ = ["app", "run", "run_script"]

app = typer.Typer()

Script = Annotated[
    Path,
    typer.Argument(
        help="The Python script every rank runs (as `python SCRIPT ARGS...`).", show_default=False
    ),
]
ScriptArgs = Annotated[
    list[str] | None,
    typer.Argument(help="The script's own arguments, passed on untouched.", show_default=False),
]

#: every option before SCRIPT is ours, everything after it the script's (even -n or --help)
_CONTEXT = {"allow_interspersed_args": False, "ignore_unknown_options": True}


def run(
    script: Script,
    args: ScriptArgs = None,
    n: NProcs = None,
    hostfile: Hostfile = None,
    hosts: Hosts = None,
    mpi_args: MpiArgs = None,
) -> None:
    """Run SCRIPT [ARGS]... on every rank: tmpi run -n 2 train.py --lr 0.1.

    The script sets itself up with `import theanompi as tm; tm.init()` (or trains a config
    with tm.fit); `mpirun -n N python SCRIPT` works too. With -n the launcher supervises the
    job as `tmpi train -n N` does: Ctrl-C stops it (exit 130), a failed rank is one line
    naming it (exit 1), a theanompi error in the script is its one line and exit code, and
    no process is left behind. Options go before SCRIPT; to pass the script an -H,
    --host, --hostfile or --mpi-args of its own, write `tmpi run -n 2 -- SCRIPT ARGS...`.
    """
    run_script(script, list(args or []), n, hostfile, hosts, mpi_args)


app.command("run", context_settings=_CONTEXT)(run)  # its options sit in the Launch panel


def run_script(
    script: Path,
    args: list[str],
    n: int | None = None,
    hostfile: str | None = None,
    hosts: str | None = None,
    mpi_args: str | None = None,
) -> None:
    """With ``n`` outside mpirun: launch ``tmpi run SCRIPT ARGS`` on ``n`` ranks under the
    launcher's supervision and exit with the job's code. Otherwise (a rank, or one process):
    :func:`theanompi.init`, then the script as ``__main__``."""
    _check_script(script)
    if n is not None and not under_mpirun():
        from theanompi.launch.hosts import Placement
        from theanompi.launch.mpirun import mpirun_command, relaunch

        placement = Placement.from_flags(hostfile, hosts, mpi_args)
        mpirun_command(n, [], placement)  # -n < 1, more ranks than the hosts' slots: one line
        # "--": the ranks' `tmpi` takes no placement flag out of the script's arguments
        raise typer.Exit(relaunch(n, ["run", "--", str(script), *args], placement=placement))
    from theanompi.comm import describe_hosts, log, world
    from theanompi.distributed import init

    init()
    log(f"tmpi: {describe_hosts()}")  # collective: every rank, before the script
    size = world().Get_size()
    if n is not None and "THEANOMPI_LAUNCHED" not in os.environ and size != n:
        raise ConfigError(f"-n {n} given but mpirun started {size} ranks; drop -n under mpirun")
    _run_as_main(script, args)


def _check_script(script: Path) -> None:
    if str(script).startswith("-"):
        raise ConfigError(f"unknown option {str(script)!r} before the script; see tmpi run --help")
    if not script.is_file():
        raise ConfigError(f"script {str(script)!r} not found (from {os.getcwd()})")


def _run_as_main(script: Path, args: list[str]) -> None:
    """``python SCRIPT ARGS`` in this process: ``sys.argv`` and ``sys.path[0]`` as Python sets
    them, the script as ``__main__``; its exceptions propagate (``theanompi.cli.main`` turns a
    :class:`~theanompi.errors.UserError` into its one line and exit code)."""
    argv, path0 = sys.argv, sys.path[0] if sys.path else None
    sys.argv = [str(script), *args]
    folder = str(script.resolve().parent)
    if sys.path:
        sys.path[0] = folder
    else:
        sys.path.insert(0, folder)
    try:
        runpy.run_path(str(script), run_name="__main__")
    except Exception as err:
        if isinstance(err, UserError):
            raise
        # as `python SCRIPT` shows it: the traceback from the script's frame on, through the
        # abort hook (theanompi.init's), which ends the job with one line naming the rank
        tb = err.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != str(script):
            tb = tb.tb_next
        tb = tb or err.__traceback__
        sys.excepthook(type(err), err.with_traceback(tb), tb)  # Python prints __traceback__
        raise
    finally:
        sys.argv = argv
        if path0 is not None:
            sys.path[0] = path0
