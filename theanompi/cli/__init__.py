"""The ``tmpi`` CLI, one module per command group; it may import anything, nothing imports it."""

from __future__ import annotations

import sys

import typer

from theanompi.cli._options import _take_placement_flags
from theanompi.cli.bench import app as bench_app
from theanompi.cli.eval import app as eval_app
from theanompi.cli.info import app as info_app
from theanompi.cli.plot import app as plot_app
from theanompi.cli.run import app as run_app
from theanompi.cli.train import app as train_app
from theanompi.errors import ConfigError, UserError

__all__ = ["app", "main"]

app = typer.Typer(
    help="Data-parallel training of PyTensor models over MPI with pluggable sync rules.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
for _commands in (train_app, eval_app, run_app, plot_app, info_app):  # unnamed: they join app
    app.add_typer(_commands)
app.add_typer(bench_app, name="bench")

try:  # the prep stage is its own package; mount its commands as `tmpi prep ...`
    from prep.cli import app as prep_app

    app.add_typer(prep_app, name="prep")
except ModuleNotFoundError as _err:  # pragma: no cover - only while prep is absent
    if _err.name not in ("prep", "prep.cli"):
        raise


def _whole_lines() -> None:
    """On a rank, write whole lines: mpirun merges the ranks' output, and with
    ``PYTHONUNBUFFERED`` a ``print`` is two writes (text, then newline), so another rank's line
    could land between them. Line buffering keeps each line one write, still as it comes."""
    from theanompi.comm import under_mpirun

    if under_mpirun():
        for stream in (sys.stdout, sys.stderr):
            if hasattr(stream, "reconfigure"):
                stream.reconfigure(line_buffering=True, write_through=False)


def main() -> None:
    """Console entry point: user errors become one line on stderr and a meaningful exit code."""
    try:
        _main()
    except SystemExit as done:  # after an elastic shrink: without MPI_Finalize (it would hang)
        from theanompi.comm import exit_if_shrunk

        exit_if_shrunk(done.code)
        raise


def _main() -> None:
    try:
        _whole_lines()
        _take_placement_flags()
        app()
    except UserError as err:
        if "mpi4py.MPI" in sys.modules:
            from mpi4py import MPI

            r = MPI.COMM_WORLD.Get_rank()
        else:  # before MPI starts every rank meets the same flag/config error: rank 0 reports
            from theanompi.comm import let_rank0_report, rank_from_env

            r = rank_from_env()
            let_rank0_report()
        if r == 0:
            print(f"tmpi: error: {err}", file=sys.stderr, flush=True)
        elif not isinstance(err, ConfigError) and not err.agreed:  # agreed: rank 0 reported
            print(f"tmpi: error on rank {r}: {err}", file=sys.stderr, flush=True)
        sys.exit(err.exit_code)


if __name__ == "__main__":
    main()
