"""``tmpi eval``: validate a checkpoint on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from theanompi.cli._options import (
    LAUNCH,
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

__all__ = ["app", "evaluate"]

app = typer.Typer()

Checkpoint = Annotated[
    Path | None,
    typer.Option("--checkpoint", help="Checkpoint file (default: the latest in the run dir)."),
]
PerClass = Annotated[
    bool, typer.Option("--per-class", help="Add per-class accuracy with synset names.")
]
SavePredictions = Annotated[
    bool, typer.Option("--save-predictions", help="Write top-5 class indices per image.")
]
Backend = Annotated[
    str | None,
    typer.Option("--backend", help="Compiler: c (default) or jax (training.backend)."),
]


def evaluate(
    config: ConfigPath = None,
    model: ModelName = None,
    sets: SetKeys = None,
    n: NProcs = None,
    hostfile: Hostfile = None,
    hosts: Hosts = None,
    mpi_args: MpiArgs = None,
    backend: Backend = None,
    data: DataDir = None,
    run_dir: RunDir = None,
    checkpoint: Checkpoint = None,
    per_class: PerClass = False,
    save_predictions: SavePredictions = False,
) -> None:
    """Validate a checkpoint: top-1 and top-5 error, loss, images/s (identical for any -n).

    --run-dir alone evaluates that run as it was trained (its config.yaml: model and data).
    """
    from theanompi.config import load_config, run_config

    if config is None and model is None:
        config = run_config(run_dir)

    over = _overrides(
        sets,
        **{
            "data.dir": str(data) if data else None,
            "output.run_dir": str(run_dir) if run_dir else None,
            "training.backend": backend,
        },
    )
    cfg = load_config(config, model, over)  # validate before starting any MPI job

    def before(placement: Any) -> None:  # what the launcher checks before mpirun starts
        _check_data(cfg, ("val",), placement)
        _check_checkpoint(cfg, checkpoint, placement)

    _relaunch_if_asked(n, hostfile, hosts, mpi_args, before=before)
    _start(n)
    from theanompi.train.evaluate import run

    run(cfg, checkpoint=checkpoint, per_class=per_class, save_predictions=save_predictions)


def _check_checkpoint(cfg: Any, checkpoint: Path | None, placement: Any) -> None:
    """The launcher's check that there is a checkpoint to evaluate (exit 3, one line, before
    any rank starts); across hosts a path missing here is left to the ranks' own check."""
    from theanompi.train.evaluate import resolve_checkpoint

    where = Path(checkpoint) if checkpoint else Path(cfg.output.checkpoint_dir)
    if placement.hosts and not where.exists():
        return
    resolve_checkpoint(cfg, checkpoint)


_PANELS = {
    LAUNCH: ["n", "hostfile", "hosts", "mpi_args", "backend"],
    "Data": ["data"],
    "Output": ["run_dir", "checkpoint", "per_class", "save_predictions"],
}
app.command("eval", cls=_RegistryHelp)(in_panels(evaluate, _PANELS))
