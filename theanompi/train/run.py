"""``tmpi train``: build the run's parts from a validated config and hand them to the Trainer.

This is where the config stops: every part below takes explicit values, so ``--strategy``
can be followed from the CLI to ``create_rule`` to the exchanger.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from theanompi.errors import ConfigError

__all__ = ["run", "create_rule", "build_model", "save_config", "train_loader", "check_accumulate"]


def create_rule(cfg: Any) -> Any:
    """The sync rule named by ``weight_exchange.sync_rule``, built from its config section."""
    from theanompi.rules import RULES

    we = cfg.weight_exchange
    return RULES.get(we.sync_rule).from_config(we, seed=cfg.randomness.seed)


def build_model(
    section: Any,
    input_shape: tuple[int, int, int],
    batch_size: int,
    model: Any = None,
    backend: str = "c",
) -> Any:
    """``create_model(section)`` (or the given model), checked against the data's input shape
    and compiled for ``batch_size`` by ``backend`` (``training.backend``)."""
    if model is None:
        from theanompi.models import create_model

        model = create_model(section)
    if tuple(model.input_shape) != tuple(input_shape):
        raise ConfigError(
            f"model {section.name!r} takes inputs {tuple(model.input_shape)} but the data gives "
            f"{tuple(input_shape)}; set model.input_size / channels to match"
        )
    model.build(int(batch_size), backend=backend)
    return model


def run(
    cfg: Any,
    *,
    resume: bool = False,
    overwrite: bool = False,
    comm: Any = None,
    model: Any = None,
) -> dict[str, Any]:
    """Train ``cfg`` with its sync rule on the ranks of ``comm`` (default: the world).

    Parameters
    ----------
    cfg
        A validated :class:`theanompi.config.Config`.
    resume
        Continue from the latest checkpoint in ``cfg.output.checkpoint_dir``; the config
        stored there is compared with ``cfg`` first (:mod:`theanompi.train.rundir`).
    overwrite
        Delete an earlier run's checkpoints and record in the run dir first; without it
        (or ``resume``) a run dir holding a run is refused.
    comm
        The job's communicator.
    model
        An already created model (default ``create_model(cfg.model)``); tests pass one.

    Returns
    -------
    dict
        The summary, the same on every rank: ``epochs``, ``steps``, ``val_top1_err``,
        ``val_top5_err``, ``val_loss``, ``val_n``, ``images_per_s``, ``t_compute`` /
        ``t_exchange`` / ``t_wait`` / ``t_wall`` / ``t_hidden`` / ``t_sync`` (mean s per
        step; hidden: of the exchange, under compute; sync: waited for the slowest rank before
        the exchange, not in ``t_exchange``), ``median_*_s``,
        ``seconds``, ``checkpoint``, ``interrupted``, and the rule's own fields.
    """
    from mpi4py import MPI

    from theanompi.data import ValLoader
    from theanompi.io.timeline import Timeline
    from theanompi.pytensor_env import CompileTurn
    from theanompi.train.evaluate import collective
    from theanompi.train.startup import check_nodes

    comm = MPI.COMM_WORLD if comm is None else comm
    rule = create_rule(cfg)
    rule.check_world(comm.Get_size())
    from theanompi.train.rundir import check_run_dir

    n_workers = rule.n_workers(comm.Get_size())
    check_run_dir(comm, cfg, resume=resume, overwrite=overwrite, n_workers=n_workers)
    collective(comm, save_config, cfg, comm.Get_rank() == 0)  # the run dir was accepted
    wcomm = rule.worker_comm(comm)
    server = rule.server(comm)
    timeline = Timeline(cfg.output.timeline or None, comm)
    collective(comm, check_nodes, comm, str(cfg.data.dir), str(cfg.output.run_dir))
    turn = CompileTurn(comm, compiles=server is None)  # compile once per node

    def setup() -> tuple[Any, Any, Any] | None:
        if server is not None:
            return None
        rank, size = wcomm.Get_rank(), wcomm.Get_size()
        with turn:
            train = train_loader(cfg, rank, size)
            val = ValLoader(cfg, rank, size)
            built = build_model(
                cfg.model, train.input_shape, cfg.model.batch_size, model, cfg.training.backend
            )
            check_accumulate(built, cfg.training.accumulate_steps)
        if cfg.data.verify == "all":  # --verify-data: every batch file, shared over the ranks
            t0 = MPI.Wtime()
            n = train.ds.verify(rank, size) + val.ds.verify(rank, size)
            if rank == 0:
                total = len(train.ds.files) + len(val.ds.files)
                print(
                    f"verify-data: {total} batch files match the manifest digests "
                    f"({n} checked here in {MPI.Wtime() - t0:.2f} s, the rest by the other ranks)",
                    flush=True,
                )
        return train, val, built

    parts = collective(comm, setup)
    from theanompi.launch.watchdog import Watchdog

    with Watchdog(
        comm, float(cfg.training.stall_timeout), stacks_dir=f"{cfg.output.run_dir}/stacks"
    ) as watchdog:
        if server is not None:
            mine = server.serve()
        else:
            train, val, model = parts
            mine = _fit(cfg, rule, wcomm, train, val, model, timeline, resume, watchdog)
    timeline.close()
    # every rank returns the first worker's summary, with what the servers add (serve_s)
    everyone = comm.allgather((server is not None, mine))
    summary = dict(next(part for serving, part in everyone if not serving))
    for serving, part in everyone:
        if serving:
            summary.update(part)
    return summary


def train_loader(cfg: Any, rank: int, size: int) -> Any:
    """This rank's :class:`~theanompi.data.TrainLoader`. With ``training.accumulate_steps``
    K > 1 an optimiser step takes K of its steps (sub-batches), so ``training.max_steps``,
    which counts optimiser steps, caps it at ``K * max_steps``; an epoch must hold K."""
    import dataclasses

    from theanompi.data import TrainLoader

    k, cap = int(cfg.training.accumulate_steps), int(cfg.training.max_steps)
    if k > 1 and cap:
        training = dataclasses.replace(cfg.training, max_steps=cap * k)
        cfg = dataclasses.replace(cfg, training=training)
    train = TrainLoader(cfg, rank, size)
    if train.steps_per_epoch < k:
        raise ConfigError(
            f"training.accumulate_steps={k} needs {k} sub-batches per rank and epoch, but the "
            f"data gives {train.steps_per_epoch} per rank ({size} rank(s), sub-batches of "
            f"{train.batch_size}); use accumulate_steps <= {train.steps_per_epoch} or fewer ranks"
        )
    return train


def check_accumulate(model: Any, k: int) -> None:
    """One-line ``ConfigError`` when ``k`` > 1 but ``model`` cannot accumulate gradients
    (``compute_grads(x, y, accumulate=True)`` and ``scale_grads``, as
    :class:`theanompi.models.Model` has them)."""
    if k <= 1:
        return
    import inspect

    try:
        ok = "accumulate" in inspect.signature(model.compute_grads).parameters
    except (AttributeError, TypeError, ValueError):
        ok = False
    if not (ok and callable(getattr(model, "scale_grads", None))):
        raise ConfigError(
            f"training.accumulate_steps={k} needs a model with compute_grads(x, y, "
            f"accumulate=True) and scale_grads(factor) (theanompi.models.Model has both); "
            f"{type(model).__name__} lacks them: set training.accumulate_steps: 1"
        )


def _snapshotter(cfg: Any, rule: Any, comm: Any, model: Any) -> Any:
    """The run's checkpoint writer/reader, its meta naming the config and the rule."""
    from theanompi.registry import source_of
    from theanompi.train.snapshot import Snapshotter

    rule_meta = {"config": cfg.to_dict(), "rule": rule.name}
    source = source_of(str(cfg.model.name))  # a user's model: the file it was trained with
    if source:
        rule_meta["model_source"] = source
    return Snapshotter(
        cfg.output.checkpoint_dir,
        cfg.output.snapshot_freq,
        comm,
        model,
        local_opt=rule.local_opt_state,
        meta=rule_meta,
        keep_last=int(cfg.output.keep_last),
    )


def _start_point(
    snap: Any, model: Any, comm: Any, resume: bool, n_epochs: int, log: Any, k: int = 1
) -> tuple[int, int, str | None, int]:
    """(epoch, step, last checkpoint, step in epoch) to start from: the checkpoint's on
    resume, else zeros with rank 0's parameters and optimizer state broadcast. A mid-epoch
    checkpoint counts optimiser steps of the ``accumulate_steps`` it was written with: a
    different ``k`` would restart the loader elsewhere, so it is refused."""
    from theanompi.models.params import bcast_values

    start_epoch, step, last_ckpt, start_in_epoch = 0, 0, None, 0
    if resume:
        ck = snap.restore()
        start_epoch, step, last_ckpt = ck.epoch, ck.step, str(ck.path)
        start_in_epoch = int(ck.meta.get("step_in_epoch", 0))  # a mid-epoch checkpoint
        written = ck.meta.get("config", {}).get("training", {}).get("accumulate_steps", 1)
        if start_in_epoch and int(written) != k:
            raise ConfigError(
                f"resume: {ck.path.name} was written mid-epoch with training.accumulate_steps="
                f"{written}, now {k}; set training.accumulate_steps: {written} to resume it "
                "(change it at an epoch checkpoint)"
            )
        log(f"resumed from {ck.path} (epoch {start_epoch}, step {step})")
        if start_epoch >= n_epochs:
            log(
                f"{start_epoch} epoch(s) already done of model.n_epochs={n_epochs}; "
                "nothing to train (raise --epochs to continue)"
            )
    else:
        bcast_values(model.params, comm)
        bcast_values(model.opt_state, comm)
    return start_epoch, step, last_ckpt, start_in_epoch


def _open_record(
    cfg: Any,
    rule: Any,
    train: Any,
    n_workers: int,
    enabled: bool,
    resume: bool,
    start_epoch: int,
    scale: float,
    warmup: int,
    steps_per_epoch: int,
) -> Any:
    """The run's record (written by rank 0 only), opened with its ``start`` entry."""
    from theanompi.io.record import RecordWriter

    record = RecordWriter(
        cfg.output.record_dir, enabled=enabled, keep_before_epoch=start_epoch if resume else None
    )
    record.write(
        "start",
        rule=rule.name,
        world_size=rule.world_size,
        n_workers=n_workers,
        resume=resume,
        start_epoch=start_epoch,
        steps_per_epoch=steps_per_epoch,
        dropped_sub_batches=train.dropped,
        batch_size=train.batch_size,
        accumulate_steps=int(cfg.training.accumulate_steps),
        lr_scale=scale,
        warmup_steps=warmup,
        config=cfg.to_dict(),
        **rule.settings(),
    )
    return record


def save_config(cfg: Any, write: bool = True) -> Path | None:
    """``<run_dir>/config.yaml``: the resolved config (:func:`theanompi.config.print_config`,
    which ``load_config`` reads back), written atomically where ``write`` (rank 0). Left as is
    when it holds that text already, or when it is the config the run was loaded from (a note
    says so). Returns the path written, else None."""
    if not write:
        return None
    from theanompi.config import RUN_CONFIG, print_config
    from theanompi.errors import resource_error
    from theanompi.io.atomic import atomic_write

    path = Path(cfg.output.run_dir) / RUN_CONFIG
    text = print_config(cfg)
    try:
        if path.is_file() and path.read_text() == text:
            return None
        if cfg.sources and Path(cfg.sources[0]).is_file() and path.samefile(cfg.sources[0]):
            print(f"note: {path} is the config this run was loaded from; kept", file=sys.stderr)
            return None
    except (OSError, ValueError):  # unreadable: replaced below
        pass
    try:
        with atomic_write(path) as tmp:
            tmp.write_text(text)
    except OSError as err:
        raise resource_error(err, "the run's config", path) or err from None
    return path


def _open_loggers(cfg: Any, record: Any, enabled: bool) -> list[Any]:
    """``output.loggers``, on the rank that writes the record (``enabled``), fed the record
    as it stands now (a resumed run's kept entries, then this start)."""
    if not enabled or not cfg.output.loggers:
        return []
    from theanompi.io.loggers import open_loggers
    from theanompi.io.record import read_record

    return open_loggers(cfg.output.loggers, cfg.output.run_dir, read_record(record.path))


def _loop_settings(cfg: Any, n_epochs: int) -> Any:
    """The Trainer loop's plain settings, read off the config."""
    from theanompi.train.trainer import LoopSettings

    return LoopSettings(
        n_epochs=n_epochs,
        print_freq=int(cfg.training.print_freq),
        check_every=int(cfg.weight_exchange.check_every),
        checkpoint_every_steps=int(cfg.output.checkpoint_every_steps),
        checkpoint_every_minutes=float(cfg.output.checkpoint_every_minutes),
        accumulate_steps=int(cfg.training.accumulate_steps),
    )


def _fit(
    cfg: Any,
    rule: Any,
    comm: Any,
    train: Any,
    val: Any,
    model: Any,
    timeline: Any,
    resume: bool,
    watchdog: Any = None,
) -> dict[str, Any]:
    """Start values (rank 0's or the checkpoint's), record, then the Trainer's loop."""
    from theanompi.io.loggers import close_all
    from theanompi.models.params import check_same_layout
    from theanompi.train.evaluate import collective
    from theanompi.train.rng import seed_rngs
    from theanompi.train.schedule import LRSchedule, lr_scale
    from theanompi.train.trainer import Trainer

    rank, size = comm.Get_rank(), comm.Get_size()
    tag = f"[{rule.name.lower()}]"
    log = (lambda text: print(f"{tag} {text}", flush=True)) if rank == 0 else (lambda text: None)
    n_epochs = int(cfg.model.n_epochs)
    check_same_layout(model.params, comm, "param")
    check_same_layout(model.opt_state, comm, "optimizer state")
    seed_rngs(model, cfg.randomness.seed, rule.world.Get_rank())
    snap = _snapshotter(cfg, rule, comm, model)
    k = int(cfg.training.accumulate_steps)
    start_epoch, step, last_ckpt, start_in_epoch = _start_point(
        snap, model, comm, resume, n_epochs, log, k
    )
    rule.setup(model, comm)
    b = train.batch_size
    global_batch = b * k * size  # images per optimiser step: what lr scaling counts
    spe = train.steps_per_epoch // k  # optimiser steps per epoch: what warm-up counts
    scale = lr_scale(cfg.training.lr_scaling, global_batch, cfg.training.lr_reference_batch)
    warmup = round(float(cfg.training.warmup_epochs) * spe)
    log(
        f"{rule.world_size} rank(s), model {cfg.model.name}, {rule.describe()}, batch {b}/worker"
        + (f" x {k} accumulated" if k > 1 else "")
        + f" ({global_batch} global on {size} worker(s)), {n_epochs} epochs"
        + (f", lr x {scale:g}" if scale != 1 else "")
        + (f", warm-up {warmup} steps" if warmup else "")
    )
    log(train.summary)
    if k > 1:
        left = train.steps_per_epoch - spe * k
        log(
            f"accumulate_steps {k}: an optimiser step = {k} sub-batches of {b} per worker, "
            f"{spe} optimiser steps/epoch"
            + (f"; {left} sub-batch(es) per rank and epoch dropped" if left else "")
        )
    record = _open_record(
        cfg, rule, train, size, rank == 0, resume, start_epoch, scale, warmup, spe
    )
    loggers = collective(comm, _open_loggers, cfg, record, rank == 0)
    trainer = Trainer(
        model=model,
        rule=rule,
        comm=comm,
        train=train,
        val=val,
        snap=snap,
        record=record,
        timeline=timeline,
        schedule=LRSchedule.from_config(cfg.model, scale, warmup, n_epochs * spe),
        settings=_loop_settings(cfg, n_epochs),
        watchdog=watchdog,
        loggers=loggers,
    )
    try:
        return trainer.fit(start_epoch, step, last_ckpt, start_in_epoch)
    finally:
        record.close()
        close_all(loggers)
