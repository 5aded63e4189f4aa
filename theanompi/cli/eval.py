"""``tmpi eval``: validate a checkpoint on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from theanompi.cli._options import (
    ConfigPath,
    DataDir,
    ModelName,
    NProcs,
    RunDir,
    SetKeys,
    _overrides,
    _relaunch_if_asked,
    _start,
)

__all__ = ["app", "evaluate"]

app = typer.Typer()

Checkpoint = Annotated[
    Path | None,
    typer.Option("--checkpoint", help="Checkpoint file [default: latest in the run dir]."),
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


@app.command("eval")
def evaluate(
    n: NProcs = None,
    config: ConfigPath = None,
    model: ModelName = None,
    data: DataDir = None,
    run_dir: RunDir = None,
    checkpoint: Checkpoint = None,
    per_class: PerClass = False,
    save_predictions: SavePredictions = False,
    backend: Backend = None,
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
