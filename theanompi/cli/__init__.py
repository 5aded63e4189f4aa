"""The ``tmpi`` command line: prep, train, eval, plot, info and bench, each with ``--help``."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from theanompi.comm import under_mpirun
from theanompi.errors import ConfigError, UserError

__all__ = ["app", "main"]

app = typer.Typer(
    help="Data-parallel training of PyTensor models over MPI with pluggable sync rules.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(
    help="Benchmarks that print side-by-side ratios (medians).", no_args_is_help=True
)
app.add_typer(bench_app, name="bench")

try:  # the prep stage is its own package; mount its commands as `tmpi prep ...`
    from prep.cli import app as prep_app

    app.add_typer(prep_app, name="prep")
except ModuleNotFoundError as _err:  # pragma: no cover - only while prep is absent
    if _err.name not in ("prep", "prep.cli"):
        raise

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


def _overrides(sets: list[str] | None, **flags: Any) -> dict[str, Any]:
    from theanompi.config import parse_override

    over = dict(flags)
    for text in sets or []:
        key, value = parse_override(text)
        over[key] = value
    return over


@app.command(cls=_RegistryHelp)
def train(
    n: NProcs = None,
    config: ConfigPath = None,
    model: ModelName = None,
    rule: Annotated[
        str | None, typer.Option("--rule", help="Sync rule: {weight_exchange.sync_rule}.")
    ] = None,
    strategy: Annotated[
        str | None,
        typer.Option("--strategy", help="Exchange strategy: {weight_exchange.exch_strategy}."),
    ] = None,
    compression: Annotated[
        str | None,
        typer.Option("--compression", help="Values on the wire: {weight_exchange.compression}."),
    ] = None,
    sync_type: Annotated[
        str | None,
        typer.Option(
            "--sync-type",
            help="BSP: average parameters or gradients ({weight_exchange.sync_type}).",
        ),
    ] = None,
    data: DataDir = None,
    run_dir: RunDir = None,
    epochs: Annotated[
        int | None, typer.Option("--epochs", help="Number of epochs (model.n_epochs).")
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option("--batch-size", help="Per-worker sub-batch; must divide the file batch B."),
    ] = None,
    lr: Annotated[float | None, typer.Option("--lr", help="Initial learning rate.")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Random seed.")] = None,
    max_steps: Annotated[
        int | None, typer.Option("--max-steps", help="Cap steps per epoch (0: all).")
    ] = None,
    avg_freq: Annotated[
        int | None, typer.Option("--avg-freq", help="EASGD: elastic exchange every K steps.")
    ] = None,
    gossip_p: Annotated[
        float | None,
        typer.Option("--gossip-p", help="GOSGD: probability of a push after a step, in (0, 1]."),
    ] = None,
    lr_scaling: Annotated[
        str | None,
        typer.Option(
            "--lr-scaling",
            help="{training.lr_scaling}; linear: lr x global batch / training.lr_reference_batch.",
        ),
    ] = None,
    warmup_epochs: Annotated[
        float | None,
        typer.Option("--warmup-epochs", help="Ramp the lr up linearly over these epochs."),
    ] = None,
    backend: Annotated[
        str | None,
        typer.Option("--backend", help="Compiler of the step functions: {training.backend}."),
    ] = None,
    timeline: Annotated[
        Path | None,
        typer.Option("--timeline", help="Write a Chrome trace of every rank's spans here."),
    ] = None,
    stall_timeout: Annotated[
        float | None,
        typer.Option(
            "--stall-timeout",
            help="End the job (exit 1) naming the rank(s) a collective has waited this many "
            "seconds for (training.stall_timeout; 0: off).",
        ),
    ] = None,
    deterministic: Annotated[
        bool, typer.Option("--deterministic", help="No shuffle, crop or mirror randomness.")
    ] = False,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="Continue from the latest checkpoint in the run dir (its stored config is "
            "compared with this one: a changed model, arch, batch size or data layout refuses).",
        ),
    ] = False,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help="Start again in a run dir that holds a run: delete its checkpoints and record "
            "(only those). Without it or --resume such a run dir is refused.",
        ),
    ] = False,
    verify_data: Annotated[
        bool,
        typer.Option(
            "--verify-data",
            help="Check every batch against the prep manifest's digests before training "
            "(data.verify=all; by default each batch is checked when first read).",
        ),
    ] = False,
    max_restarts: Annotated[
        int,
        typer.Option(
            "--max-restarts",
            help="With -n: after a rank failure or stall, relaunch with --resume from the "
            "latest checkpoint, at most this many times (as torchrun).",
        ),
    ] = 0,
    sets: SetKeys = None,
) -> None:
    """Train a model with a sync rule. -n counts every rank, a rule's server included.

    --model names configs/<MODEL>.yaml, a YAML path, or a registered model that has no
    config file (e.g. --model mlp): its model section is then the schema defaults.
    """
    from theanompi.config import check_world_size, load_config

    over = _overrides(
        sets,
        **{
            "weight_exchange.sync_rule": rule,
            "weight_exchange.exch_strategy": strategy,
            "weight_exchange.sync_type": sync_type,
            "weight_exchange.compression": compression,
            "weight_exchange.avg_freq": avg_freq,
            "weight_exchange.gossip_p": gossip_p,
            "data.dir": str(data) if data else None,
            "output.run_dir": str(run_dir) if run_dir else None,
            "model.n_epochs": epochs,
            "model.batch_size": batch_size,
            "model.learning_rate": lr,
            "randomness.seed": seed,
            "randomness.deterministic": True if deterministic else None,
            "data.verify": "all" if verify_data else None,
            "training.max_steps": max_steps,
            "training.lr_scaling": lr_scaling,
            "training.warmup_epochs": warmup_epochs,
            "training.backend": backend,
            "training.stall_timeout": stall_timeout,
            "output.timeline": str(timeline) if timeline else None,
        },
    )
    cfg = load_config(config, model, over)  # validate before starting any MPI job
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {max_restarts}")
    if max_restarts and (n is None or (under_mpirun() and "THEANOMPI_LAUNCHED" not in os.environ)):
        raise ConfigError("--max-restarts needs -n N (the launcher restarts mpirun); drop it")
    if n is not None and not under_mpirun():
        check_world_size(cfg, n)
    _relaunch_if_asked(n, max_restarts, cfg.output)
    _start(n)
    from theanompi.comm import world

    check_world_size(cfg, world().Get_size())
    from theanompi.launch.signals import StopFlag
    from theanompi.train.run import run

    with StopFlag():  # a Ctrl-C before the loop (or on a serving rank) waits for the loop
        summary = run(cfg, resume=resume, overwrite=overwrite)
    if summary["interrupted"]:  # stopped at a step boundary; checkpoints valid
        raise typer.Exit(130)


@app.command("eval")
def evaluate(
    n: NProcs = None,
    config: ConfigPath = None,
    model: ModelName = None,
    data: DataDir = None,
    run_dir: RunDir = None,
    checkpoint: Annotated[
        Path | None,
        typer.Option("--checkpoint", help="Checkpoint file [default: latest in the run dir]."),
    ] = None,
    per_class: Annotated[
        bool, typer.Option("--per-class", help="Add per-class accuracy with synset names.")
    ] = False,
    save_predictions: Annotated[
        bool, typer.Option("--save-predictions", help="Write top-5 class indices per image.")
    ] = False,
    backend: Annotated[
        str | None,
        typer.Option("--backend", help="Compiler: c (default) or jax (training.backend)."),
    ] = None,
    sets: SetKeys = None,
) -> None:
    """Validate a checkpoint: top-1 and top-5 error, loss, images/s (identical for any -n)."""
    from theanompi.config import load_config

    over = _overrides(
        sets,
        **{
            "data.dir": str(data) if data else None,
            "output.run_dir": str(run_dir) if run_dir else None,
            "training.backend": backend,
        },
    )
    cfg = load_config(config, model, over)  # validate before starting any MPI job
    _relaunch_if_asked(n)
    _start(n)
    from theanompi.train.evaluate import run

    run(cfg, checkpoint=checkpoint, per_class=per_class, save_predictions=save_predictions)


@app.command()
def plot(
    run_dir: Annotated[Path, typer.Argument(help="Run folder (holds record/).")],
    out: Annotated[
        Path | None, typer.Option("--out", help="PNG path [default: <run_dir>/record/curves.png].")
    ] = None,
) -> None:
    """Plot train/val loss and error curves of a run's record as a PNG."""
    from theanompi.cli.plot import plot_run

    path = plot_run(run_dir, out)
    typer.echo(f"wrote {path}")


@app.command()
def info() -> None:
    """Print versions of MPI, mpi4py, PyTensor, numpy, the BLAS PyTensor links, and the device."""
    from theanompi.pytensor_env import blas_info, configure

    configure()
    import mpi4py
    import numpy
    import pytensor
    from mpi4py import MPI

    from theanompi._version import __version__

    rows = [
        ("theanompi", __version__),
        ("python", sys.version.split()[0]),
        ("mpi", MPI.Get_library_version().splitlines()[0].strip()),
        ("mpi4py", mpi4py.__version__),
        ("mpi ranks", str(MPI.COMM_WORLD.Get_size())),
        ("numpy", numpy.__version__),
        ("pytensor", pytensor.__version__),
        ("pytensor linker", f"{pytensor.config.linker} ({pytensor.config.mode})"),
        ("pytensor floatX", pytensor.config.floatX),
        ("pytensor compiledir", pytensor.config.compiledir),
    ]
    blas = blas_info()
    rows += [
        ("blas library", blas["library"]),
        ("blas threads", blas["threads"]),
        ("blas ldflags", blas["ldflags"] or "(none)"),
    ]
    rows.append(("device", _device()))
    if MPI.COMM_WORLD.Get_rank() == 0:
        width = max(len(k) for k, _ in rows)
        for key, value in rows:
            typer.echo(f"{key:<{width}}  {value}")


def _device() -> str:
    import platform

    cpu = f"cpu ({os.cpu_count()} cores, {platform.machine()})"
    try:
        import pycuda.driver as cuda  # type: ignore[import-not-found]

        cuda.init()
        if cuda.Device.count():
            return f"{cpu}; gpu: {cuda.Device(0).name()}"
    except Exception:  # noqa: BLE001 - pycuda absent or no GPU: CPU only
        pass
    return cpu


def _bench(module: str, args: list[str] | None) -> None:
    import importlib

    main_fn = importlib.import_module(module).main
    raise typer.Exit(main_fn(list(args or [])))


# --help goes to the bench's own argparse parser, which lists its options
_BENCH_CTX = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


@bench_app.command("prep", context_settings=_BENCH_CTX)
def bench_prep(ctx: typer.Context) -> None:
    """Images/s of prep: naive PIL baseline vs ours at 1 and 2 ranks."""
    _bench("prep.bench", ctx.args)


@bench_app.command("exchange", context_settings=_BENCH_CTX)
def bench_exchange(ctx: typer.Context) -> None:
    """Seconds and bus bandwidth per exchange: ar, asa32, asa16, copper, per-array ar, gloo."""
    _bench("theanompi.bench.exchange", ctx.args)


@bench_app.command("model", context_settings=_BENCH_CTX)
def bench_model(ctx: typer.Context) -> None:
    """Train-step images/s of our models vs PyTorch CPU, GEMM floor, compile times."""
    _bench("theanompi.bench.model", ctx.args)


@bench_app.command("train", context_settings=_BENCH_CTX)
def bench_train(ctx: typer.Context) -> None:
    """Training images/s at N=1 and N=2 with the compute/exchange/wait split."""
    _bench("theanompi.bench.train", ctx.args)


def _take_placement_flags() -> None:
    """Move ``--hostfile``/``-H``/``--mpi-args`` (any command with ``-n``) out of the command
    line into the launcher's environment variables (:class:`theanompi.launch.hosts.Placement`)."""
    from theanompi.launch.hosts import split_placement_flags

    found, rest = split_placement_flags(sys.argv[1:])
    if found:
        os.environ.update(found)
        sys.argv[1:] = rest


def main() -> None:
    """Console entry point: user errors become one line on stderr and a meaningful exit code."""
    try:
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
