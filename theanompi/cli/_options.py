"""What the ``tmpi`` commands share: option types, the registry-aware help, the ``-n``
relaunch, MPI start-up, ``--set`` overrides and the placement flags."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from theanompi.comm import under_mpirun
from theanompi.errors import ConfigError

NProcs = Annotated[
    int | None,
    typer.Option(
        "-n",
        "--np",
        help="Launch this many MPI ranks with mpirun (omit under mpirun). Across machines add "
        "--hostfile FILE or -H host1:slots,host2:slots, and --mpi-args '...' for mpirun; "
        "inside a Slurm allocation -n alone uses it.",
    ),
]
ConfigPath = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="Run config YAML (default: configs/config.yaml)."),
]
ModelName = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="Model config: configs/<MODEL>.yaml or a path; or a registered model without a "
        "config file ({model.name}), built from the model schema defaults.",
    ),
]
DataDir = Annotated[
    Path | None, typer.Option("--data", help="Prep output folder (overrides data.dir).")
]
RunDir = Annotated[
    Path | None, typer.Option("--run-dir", help="Run folder for checkpoints and records.")
]
SetKeys = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override any key: --set section.key=value (repeatable)."),
]


class _RegistryHelp(TyperCommand):
    """A command whose option help names ``{section.key}``'s choices, read from the registries
    only when the help is shown (so ``tmpi --help`` imports none of them)."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        from theanompi.config import fill_choices

        for param in self.params:
            text = getattr(param, "help", None)
            if text and "{" in text:
                param.help = fill_choices(text)
        super().format_help(ctx, formatter)


def _relaunch_if_asked(n: int | None, max_restarts: int = 0, output: Any = None) -> None:
    """``-n N`` outside mpirun: re-run this very command under ``mpirun -n N`` and exit with its code.

    ``max_restarts`` relaunches a failed run from the latest checkpoint of ``output`` (the
    config's ``output`` section: its checkpoint and record dirs)."""
    if n is None or under_mpirun():
        return
    from theanompi.launch.mpirun import relaunch

    argv = sys.argv[1:]
    dirs = {}
    if output is not None:
        dirs = {"checkpoint_dir": output.checkpoint_dir, "record_dir": output.record_dir}
    raise typer.Exit(relaunch(n, argv, max_restarts=max_restarts, **dirs))


def _start(n_expected: int | None) -> None:
    """Common start-up of an MPI command: PyTensor set-up, abort hook, rank-count check."""
    from theanompi.comm import install_abort_hook, world
    from theanompi.pytensor_env import configure

    configure()
    install_abort_hook()
    from theanompi.launch.supervise import watch_launcher

    watch_launcher()  # started by `tmpi ... -n N`: stop when the launcher is gone
    from theanompi.comm import describe_hosts, local_size, log
    from theanompi.pytensor_env import fit_threads_to_node

    log(f"tmpi: {describe_hosts()}")  # collective: every rank, before any set-up
    fit_threads_to_node(local_size())
    launched = os.environ.get("THEANOMPI_LAUNCHED")
    size = world().Get_size()
    if n_expected is not None and launched is None and size != n_expected:
        raise ConfigError(
            f"-n {n_expected} given but mpirun started {size} ranks; drop -n under mpirun"
        )


def _overrides(sets: list[str] | tuple[str, ...] | None, **flags: Any) -> dict[str, Any]:
    """``section.key -> value`` from the flags (``None``: not given), then each ``--set``."""
    from theanompi.config import parse_override

    over = dict(flags)
    for text in sets or []:
        key, value = parse_override(text)
        over[key] = value
    return over


def _take_placement_flags() -> None:
    """Move ``--hostfile``/``-H``/``--mpi-args`` (any command with ``-n``) out of the command
    line into the launcher's environment variables (:class:`theanompi.launch.hosts.Placement`)."""
    from theanompi.launch.hosts import split_placement_flags

    found, rest = split_placement_flags(sys.argv[1:])
    if found:
        os.environ.update(found)
        sys.argv[1:] = rest
