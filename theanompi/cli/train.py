"""``tmpi train``: its options, gathered into one :class:`TrainSettings`, and the run."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Annotated, Any, NamedTuple

import typer

from theanompi.cli._options import (
    ConfigPath,
    DataDir,
    Hostfile,
    Hosts,
    ModelName,
    MpiArgs,
    NProcs,
    RunDir,
    SetKeys,
    _check_data,
    _overrides,
    _RegistryHelp,
    _relaunch_if_asked,
    _start,
    in_panels,
)
from theanompi.comm import under_mpirun
from theanompi.errors import ConfigError

__all__ = ["app", "train", "run_training", "TrainSettings"]

app = typer.Typer()

# The options of `tmpi train` ({section.key} in a help text lists that key's choices).
Rule = Annotated[str | None, typer.Option("--rule", help="Sync rule: {weight_exchange.sync_rule}.")]
Strategy = Annotated[
    str | None,
    typer.Option("--strategy", help="Exchange strategy: {weight_exchange.exch_strategy}."),
]
Compression = Annotated[
    str | None,
    typer.Option("--compression", help="Values on the wire: {weight_exchange.compression}."),
]
SyncType = Annotated[
    str | None,
    typer.Option(
        "--sync-type", help="BSP: average parameters or gradients ({weight_exchange.sync_type})."
    ),
]
Epochs = Annotated[int | None, typer.Option("--epochs", help="Number of epochs (model.n_epochs).")]
BatchSize = Annotated[
    int | None,
    typer.Option("--batch-size", help="Per-worker sub-batch; must divide the file batch B."),
]
Lr = Annotated[float | None, typer.Option("--lr", help="Initial learning rate.")]
Seed = Annotated[int | None, typer.Option("--seed", help="Random seed.")]
MaxSteps = Annotated[int | None, typer.Option("--max-steps", help="Cap steps per epoch (0: all).")]
AvgFreq = Annotated[
    int | None, typer.Option("--avg-freq", help="EASGD: elastic exchange every K steps.")
]
GossipP = Annotated[
    float | None,
    typer.Option("--gossip-p", help="GOSGD: probability of a push after a step, in (0, 1]."),
]
ShardOptimizer = Annotated[
    bool,
    typer.Option(
        "--shard-optimizer",
        help="BSP with --sync-type cdd: each rank keeps the optimizer state of 1/N of the "
        "parameters and updates only those (ZeRO-1; weight_exchange.shard_optimizer).",
    ),
]
LrScaling = Annotated[
    str | None,
    typer.Option(
        "--lr-scaling",
        help="{training.lr_scaling}; linear: lr x global batch / training.lr_reference_batch.",
    ),
]
WarmupEpochs = Annotated[
    float | None,
    typer.Option("--warmup-epochs", help="Ramp the lr up linearly over these epochs."),
]
Backend = Annotated[
    str | None,
    typer.Option("--backend", help="Compiler of the step functions: {training.backend}."),
]
Timeline = Annotated[
    Path | None,
    typer.Option("--timeline", help="Write a Chrome trace of every rank's spans here."),
]
StallTimeout = Annotated[
    float | None,
    typer.Option(
        "--stall-timeout",
        help="End the job (exit 1) naming the rank(s) a collective has waited this many "
        "seconds for (training.stall_timeout; 0: off).",
    ),
]
Deterministic = Annotated[
    bool, typer.Option("--deterministic", help="No shuffle, crop or mirror randomness.")
]
Resume = Annotated[
    bool,
    typer.Option(
        "--resume",
        help="Continue from the latest checkpoint in the run dir (its stored config is "
        "compared with this one: a changed model, arch, batch size or data layout refuses).",
    ),
]
Overwrite = Annotated[
    bool,
    typer.Option(
        "--overwrite",
        help="Start again in a run dir that holds a run: delete its checkpoints and record "
        "(only those). Without it or --resume such a run dir is refused.",
    ),
]
VerifyData = Annotated[
    bool,
    typer.Option(
        "--verify-data",
        help="Check every batch against the prep manifest's digests before training "
        "(data.verify=all; by default each batch is checked when first read).",
    ),
]
PrintConfig = Annotated[
    bool,
    typer.Option(
        "--print-config",
        help="Print the resolved config (every key, flags and --set applied) as YAML and "
        "exit; `tmpi train --config FILE` takes it back.",
    ),
]
MaxRestarts = Annotated[
    int,
    typer.Option(
        "--max-restarts",
        help="With -n: after a rank failure or stall, relaunch with --resume from the "
        "latest checkpoint, at most this many times (as torchrun).",
    ),
]
MinNp = Annotated[
    int | None,
    typer.Option(
        "--min-np",
        help="Elastic (BSP): a lost rank leaves and the others go on from the last in-memory "
        "commit while at least this many are left (elastic.min_np; as horovodrun).",
    ),
]
MaxNp = Annotated[
    int | None,
    typer.Option(
        "--max-np",
        help="Elastic: grow to at most this many ranks as the discovery script offers slots "
        "(elastic.max_np; default -n).",
    ),
]
HostDiscoveryScript = Annotated[
    Path | None,
    typer.Option(
        "--host-discovery-script",
        help="Elastic: a script that prints the hosts available now, one host:slots a line, "
        "asked every 2 s; the job grows to new ones (elastic.host_discovery_script).",
    ),
]
OnSignal = Annotated[
    str | None,
    typer.Option(
        "--on-signal",
        metavar="checkpoint|requeue",
        help="After a stop signal (SIGUSR1 as Slurm's --signal=USR1@T sends, Ctrl-C, SIGTERM) "
        "and its step-boundary checkpoint: checkpoint (exit 130) or requeue (exit 75; in a "
        "Slurm batch job also scontrol requeue). Default: requeue in a Slurm batch job "
        "submitted with --requeue, else checkpoint. A requeued job resumes by itself.",
    ),
]


# The groups below are the panels of `tmpi train --help` (the class name is the title).
@dataclass(frozen=True)
class Launch:
    """How many ranks, where they run, and what compiles their steps."""

    n: int | None = None
    hostfile: str | None = None
    hosts: str | None = None
    mpi_args: str | None = None
    backend: str | None = None


@dataclass(frozen=True)
class Exchange:
    """How the replicas are kept together."""

    rule: str | None = None
    strategy: str | None = None
    compression: str | None = None
    sync_type: str | None = None
    avg_freq: int | None = None
    gossip_p: float | None = None
    shard_optimizer: bool = False


@dataclass(frozen=True)
class Data:
    """What the steps read, and its randomness."""

    data_dir: Path | None = None
    verify_data: bool = False
    seed: int | None = None
    deterministic: bool = False


@dataclass(frozen=True)
class Schedule:
    """How long and at what rate."""

    epochs: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    lr_scaling: str | None = None
    warmup_epochs: float | None = None
    max_steps: int | None = None


@dataclass(frozen=True)
class Output:
    """Where the run is written, and what happens to a run already there."""

    run_dir: Path | None = None
    timeline: Path | None = None
    resume: bool = False
    overwrite: bool = False


@dataclass(frozen=True)
class Reliability:
    """What ends a stuck job and how often a failed one is relaunched."""

    stall_timeout: float | None = None
    max_restarts: int = 0
    on_signal: str | None = None
    min_np: int | None = None
    max_np: int | None = None
    host_discovery_script: Path | None = None


class _Key(NamedTuple):
    field: str  # a TrainSettings field: group.name
    key: str  # the config key the flag sets: section.key
    on: Any = True  # a bool flag: the value it sets when given


# Each flag that sets a config key, in the order the overrides are applied. A flag left at
# None (or a bool flag not given) sets nothing; a path is passed as text.
_CONFIG_KEYS = (
    _Key("exchange.rule", "weight_exchange.sync_rule"),
    _Key("exchange.strategy", "weight_exchange.exch_strategy"),
    _Key("exchange.sync_type", "weight_exchange.sync_type"),
    _Key("exchange.compression", "weight_exchange.compression"),
    _Key("exchange.avg_freq", "weight_exchange.avg_freq"),
    _Key("exchange.gossip_p", "weight_exchange.gossip_p"),
    _Key("exchange.shard_optimizer", "weight_exchange.shard_optimizer"),
    _Key("data.data_dir", "data.dir"),
    _Key("output.run_dir", "output.run_dir"),
    _Key("schedule.epochs", "model.n_epochs"),
    _Key("schedule.batch_size", "model.batch_size"),
    _Key("schedule.lr", "model.learning_rate"),
    _Key("data.seed", "randomness.seed"),
    _Key("data.deterministic", "randomness.deterministic"),
    _Key("data.verify_data", "data.verify", on="all"),
    _Key("schedule.max_steps", "training.max_steps"),
    _Key("schedule.lr_scaling", "training.lr_scaling"),
    _Key("schedule.warmup_epochs", "training.warmup_epochs"),
    _Key("launch.backend", "training.backend"),
    _Key("reliability.stall_timeout", "training.stall_timeout"),
    _Key("reliability.min_np", "elastic.min_np"),
    _Key("reliability.max_np", "elastic.max_np"),
    _Key("reliability.host_discovery_script", "elastic.host_discovery_script"),
    _Key("output.timeline", "output.timeline"),
)


@dataclass(frozen=True)
class TrainSettings:
    """Everything ``tmpi train`` was given, by group; built once from the command's flags."""

    config: Path | None = None
    model: str | None = None
    sets: tuple[str, ...] = ()
    print_config: bool = False
    launch: Launch = Launch()
    exchange: Exchange = Exchange()
    data: Data = Data()
    schedule: Schedule = Schedule()
    output: Output = Output()
    reliability: Reliability = Reliability()

    @classmethod
    def from_flags(cls, flags: dict[str, Any]) -> TrainSettings:
        """Sort the command's parameters, by name, into their groups."""
        flags = dict(flags)
        groups = {}
        for f in fields(cls):
            if is_dataclass(f.default):
                group = type(f.default)
                groups[f.name] = group(**{g.name: flags.pop(g.name) for g in fields(group)})
        sets = tuple(flags.pop("sets") or ())
        return cls(sets=sets, **groups, **flags)  # a parameter in no group is refused here

    @classmethod
    def panels(cls) -> dict[str, list[str]]:
        """``{group class name: its fields}``: the help panels of ``tmpi train``'s options."""
        return {
            type(f.default).__name__: [g.name for g in fields(f.default)]
            for f in fields(cls)
            if is_dataclass(f.default)
        }

    def overrides(self) -> dict[str, Any]:
        """``section.key -> value`` for :func:`~theanompi.config.load_config`: the flags
        (``None``: not given) by :data:`_CONFIG_KEYS`, then each ``--set``."""
        flags = {}
        for row in _CONFIG_KEYS:
            group, name = row.field.split(".")
            value = getattr(getattr(self, group), name)
            if isinstance(value, bool):
                value = row.on if value else None
            elif isinstance(value, Path):
                value = str(value)
            flags[row.key] = value
        return _overrides(self.sets, **flags)


def train(
    config: ConfigPath = None,
    model: ModelName = None,
    print_config: PrintConfig = False,
    sets: SetKeys = None,
    n: NProcs = None,
    hostfile: Hostfile = None,
    hosts: Hosts = None,
    mpi_args: MpiArgs = None,
    backend: Backend = None,
    rule: Rule = None,
    strategy: Strategy = None,
    compression: Compression = None,
    sync_type: SyncType = None,
    avg_freq: AvgFreq = None,
    gossip_p: GossipP = None,
    shard_optimizer: ShardOptimizer = False,
    data_dir: DataDir = None,
    verify_data: VerifyData = False,
    seed: Seed = None,
    deterministic: Deterministic = False,
    epochs: Epochs = None,
    batch_size: BatchSize = None,
    lr: Lr = None,
    lr_scaling: LrScaling = None,
    warmup_epochs: WarmupEpochs = None,
    max_steps: MaxSteps = None,
    run_dir: RunDir = None,
    timeline: Timeline = None,
    resume: Resume = False,
    overwrite: Overwrite = False,
    stall_timeout: StallTimeout = None,
    max_restarts: MaxRestarts = 0,
    on_signal: OnSignal = None,
    min_np: MinNp = None,
    max_np: MaxNp = None,
    host_discovery_script: HostDiscoveryScript = None,
) -> None:
    """Train a model with a sync rule. -n counts every rank, a rule's server included.

    --model names configs/<MODEL>.yaml, a YAML path, or a registered model that has no
    config file (e.g. --model mlp): its model section is then the schema defaults.
    """
    run_training(TrainSettings.from_flags(locals()))  # locals(): just the parameters, here


app.command(cls=_RegistryHelp)(in_panels(train, TrainSettings.panels()))


def run_training(s: TrainSettings) -> None:
    """Validate the config, relaunch under mpirun for ``-n`` (after the checks that need no
    rank), start MPI and train."""
    from theanompi.config import check_world_size, load_config, run_config
    from theanompi.train.plan import shrinks_in_place

    config = s.config
    if s.output.resume and config is None and s.model is None:  # the run as it was trained
        config = run_config(s.output.run_dir)
    cfg = load_config(config, s.model, s.overrides())  # validate before starting any MPI job
    if s.print_config:
        _print_config(cfg)
        return
    n, max_restarts = s.launch.n, s.reliability.max_restarts
    _check_on_signal(s.reliability.on_signal)
    output = _resume_on_restart(cfg, s.output, launcher=n is not None and not under_mpirun())
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {max_restarts}")
    if max_restarts and (n is None or (under_mpirun() and "THEANOMPI_LAUNCHED" not in os.environ)):
        raise ConfigError("--max-restarts needs -n N (the launcher restarts mpirun); drop it")
    if n is not None and not under_mpirun():
        check_world_size(cfg, n)
    launch = s.launch
    with _launcher_in_slurm(n):
        _relaunch_if_asked(
            n,
            launch.hostfile,
            launch.hosts,
            launch.mpi_args,
            max_restarts=max_restarts,
            output=cfg.output,
            before=lambda placement: _check_before_launch(cfg, output, placement),
            resume=output.resume,  # a restarted Slurm job's ranks continue the run
            elastic=cfg.elastic,  # --min-np: a lost rank or host leaves, new hosts come in
            in_place=shrinks_in_place(cfg),
        )
    from theanompi.io import startup_trace

    startup_trace.mark("mpi_start")
    _start(n)
    startup_trace.mark("mpi_end")
    from theanompi.comm import world

    check_world_size(cfg, world().Get_size())
    from theanompi.launch.signals import StopFlag
    from theanompi.train.run import run

    resume, overwrite = world().bcast((output.resume, output.overwrite), root=0)  # rank 0's
    with StopFlag():  # a Ctrl-C before the loop (or on a serving rank) waits for the loop
        summary = run(cfg, resume=resume, overwrite=overwrite)
    if summary["interrupted"]:  # stopped at a step boundary; checkpoints valid
        raise typer.Exit(_stop_code(s.reliability.on_signal))


def _check_on_signal(mode: str | None) -> None:
    from theanompi.launch.slurm import ON_SIGNAL

    if mode is not None and mode not in ON_SIGNAL:
        raise ConfigError(f"--on-signal {mode!r}: choose one of {', '.join(ON_SIGNAL)}")


def _resume_on_restart(cfg: Any, output: Output, launcher: bool) -> Output:
    """A Slurm job requeued and started again (``SLURM_RESTART_COUNT`` >= 1) continues from
    its run dir's latest checkpoint, as with ``--resume`` (and never ``--overwrite``s it).
    The launcher hands the returned ``resume`` to :func:`_relaunch_if_asked`, which passes
    ``--resume`` on to the ranks; without one, rank 0's choice counts."""
    from theanompi.io.checkpoint import latest_checkpoint
    from theanompi.launch.slurm import job_id, restart_count

    restarts = restart_count()
    if not restarts or output.resume:
        return output
    latest = latest_checkpoint(cfg.output.checkpoint_dir)
    if latest is None:
        return output
    from theanompi.comm import rank_from_env

    if not launcher and rank_from_env() == 0:
        print(
            f"tmpi: Slurm job {job_id()} restarted ({restarts}): resuming from {latest}",
            file=sys.stderr,
            flush=True,
        )
    return dataclasses.replace(output, resume=True, overwrite=False)


@contextlib.contextmanager
def _launcher_in_slurm(n: int | None) -> Iterator[None]:
    """The launcher (``-n N``) inside a Slurm job: live through SIGUSR1 (Slurm's warning, sent
    to every process of the job with ``scancel --full``; mpirun and the ranks get their own),
    and requeue the job once the ranks have exited with :data:`EXIT_REQUEUED`."""
    from theanompi.launch.slurm import job_id, requeue_after_stop

    if n is None or under_mpirun() or job_id() is None:
        yield
        return
    old = signal.signal(signal.SIGUSR1, lambda *_: None)  # not SIG_IGN: mpirun gets SIG_DFL
    try:
        yield
    except typer.Exit as e:
        raise typer.Exit(requeue_after_stop(e.exit_code)) from None
    finally:
        signal.signal(signal.SIGUSR1, old)


def _stop_code(mode: str | None) -> int:
    """Rank 0's exit code for a stop (:func:`theanompi.launch.slurm.stop_code`), on every
    rank; without a launcher, rank 0 requeues the Slurm job itself."""
    from theanompi.comm import world
    from theanompi.launch.slurm import requeue_after_stop, stop_code

    comm = world()
    code = stop_code(mode) if comm.Get_rank() == 0 else None
    code = comm.bcast(code, root=0)
    if "THEANOMPI_LAUNCHED" not in os.environ:  # no launcher to requeue after the ranks
        comm.Barrier()
        if comm.Get_rank() == 0:
            code = requeue_after_stop(code)
        code = comm.bcast(code, root=0)
    return int(code)


def _print_config(cfg: Any) -> None:
    """``--print-config``: the resolved config as YAML on stdout (rank 0 only under mpirun)."""
    from theanompi.comm import rank_from_env
    from theanompi.config import print_config

    if rank_from_env() == 0:
        print(print_config(cfg), end="", flush=True)


def _check_before_launch(cfg: Any, output: Output, placement: Any) -> None:
    """What ``-n N`` checks before mpirun starts (the job checks it again: ``mpirun -n N tmpi
    train`` has no launcher): the run dir's refusals, naming make's variables under ``make``,
    then the data."""
    from theanompi.train.rundir import FLAG_WAYS_OUT, MAKE_WAYS_OUT, refuse_run_dir

    ways = MAKE_WAYS_OUT if os.environ.get("MAKELEVEL") else FLAG_WAYS_OUT
    refuse_run_dir(cfg, resume=output.resume, overwrite=output.overwrite, ways=ways)
    _check_data(cfg, ("train", "val"), placement)
