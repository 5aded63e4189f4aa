"""What the ``tmpi`` commands share: option types, help panels, the registry-aware help, the
``-n`` relaunch and the checks before it, MPI start-up, ``--set`` overrides and the placement
flags."""

from __future__ import annotations

import copy
import os
import sys
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from typer.core import TyperCommand

from theanompi.comm import under_mpirun
from theanompi.errors import ConfigError
from theanompi.launch.hosts import PLACEMENT_FLAGS

F = TypeVar("F", bound=Callable[..., Any])

#: the help panel of the options that say how many ranks run where (every command with -n)
LAUNCH = "Launch"

NProcs = Annotated[
    int | None,
    typer.Option(
        "-n",
        "--np",
        help="Launch this many MPI ranks with mpirun (omit under mpirun); across machines add "
        "--hostfile or -H; inside a Slurm allocation -n alone uses it.",
        rich_help_panel=LAUNCH,
    ),
]


Hostfile = Annotated[str | None, PLACEMENT_FLAGS["hostfile"].option(LAUNCH)]
Hosts = Annotated[str | None, PLACEMENT_FLAGS["hosts"].option(LAUNCH)]
MpiArgs = Annotated[str | None, PLACEMENT_FLAGS["mpi_args"].option(LAUNCH)]
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


def in_panels(command: F, panels: Mapping[str, Iterable[str]]) -> F:
    """Put the options of ``command`` in help panels: ``{panel: [parameter names]}``.

    Each named parameter's ``typer.Option`` is copied with its ``rich_help_panel`` set, so
    an option type shared by several commands can sit in another panel elsewhere; the rest
    stay in the "Options" panel. Panels are listed in the order of their first parameter.
    """
    hints = typing.get_type_hints(command, include_extras=True)
    for panel, names in panels.items():
        for name in names:
            base, info = typing.get_args(hints[name])  # Annotated[type, typer.Option(...)]
            info = copy.copy(info)
            info.rich_help_panel = panel
            command.__annotations__[name] = Annotated[base, info]
    return command


def _relaunch_if_asked(
    n: int | None,
    hostfile: str | None = None,
    hosts: str | None = None,
    mpi_args: str | None = None,
    *,
    max_restarts: int = 0,
    output: Any = None,
    before: Callable[[Any], None] | None = None,
    resume: bool = False,
    elastic: Any = None,
    in_place: bool = True,
) -> None:
    """``-n N`` outside mpirun: re-run this very command under ``mpirun -n N`` and exit with its code.

    The placement (``--hostfile``, ``-H``, ``--mpi-args``; a Slurm allocation) is checked
    against ``n`` first, then ``before(placement)`` runs the checks that need no rank, so
    that a refusal is one line and nothing else (no mpirun banner). ``max_restarts``
    relaunches a failed run from the latest checkpoint of ``output`` (the config's
    ``output`` section: its checkpoint and record dirs); ``resume`` makes the first launch
    continue the run as well; ``elastic`` (the config's section) keeps a job with
    ``min_np`` going after a lost rank (in the same job where ``in_place``) or host and grows
    it to new hosts (:func:`~theanompi.launch.mpirun.relaunch`)."""
    if n is None or under_mpirun():
        return
    from theanompi.launch.hosts import Placement
    from theanompi.launch.mpirun import mpirun_command, relaunch

    placement = Placement.from_flags(hostfile, hosts, mpi_args)
    mpirun_command(n, [], placement)  # -n < 1, more ranks than the hosts' slots: one line
    if before is not None:
        before(placement)
    dirs = {}
    if output is not None:
        dirs = {"checkpoint_dir": output.checkpoint_dir, "record_dir": output.record_dir}
    argv = sys.argv[1:]
    code = relaunch(
        n,
        argv,
        placement=placement,
        max_restarts=max_restarts,
        resume=resume,
        elastic=elastic,
        in_place=in_place,
        **dirs,
    )
    raise typer.Exit(code)


def _check_data(cfg: Any, splits: Iterable[str], placement: Any) -> None:
    """The launcher's data check: the prep output ``data.dir`` is there and fits the config
    (every check :class:`~theanompi.data.loader.DataSet` makes when it opens a split: exit 3
    for missing or bad data, 2 for a config that does not fit it). Across hosts a folder
    missing here is left to the nodes' own check at start-up."""
    from theanompi.data.loader import DataSet
    from theanompi.io.dataset import MANIFEST

    if placement.hosts and not (Path(cfg.data.dir) / MANIFEST).exists():
        return
    for split in splits:
        DataSet(cfg, split)


def _start(n_expected: int | None) -> None:
    """Common start-up of an MPI command: PyTensor set-up, abort hook, rank-count check."""
    from theanompi.comm import install_abort_hook, world
    from theanompi.pytensor_env import configure

    configure()
    install_abort_hook()
    from theanompi.launch.launcher_watch import watch_launcher

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
    """Move ``--hostfile``/``-H``/``--mpi-args`` out of the command line, from anywhere on it,
    into their environment variables: the options of the commands with ``-n`` read them from
    there (``envvar``), and so does ``tmpi bench``'s launcher, whose commands hand their
    arguments on (:class:`theanompi.launch.hosts.Placement`)."""
    from theanompi.launch.hosts import split_placement_flags

    found, rest = split_placement_flags(sys.argv[1:])
    if found:
        os.environ.update(found)
        sys.argv[1:] = rest
