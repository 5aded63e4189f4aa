"""``tmpi train``: build the run's parts from a validated config and hand them to the Trainer.

This is where the config stops: every part below takes explicit values, so ``--strategy``
can be followed from the CLI to ``create_rule`` to the exchanger.
"""

from __future__ import annotations

from typing import Any

from theanompi.errors import ConfigError

__all__ = ["run", "create_rule", "build_model"]


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
        ``t_exchange`` / ``t_wait`` / ``t_wall`` (mean s per step), ``median_*_s``,
        ``seconds``, ``checkpoint``, ``interrupted``, and the rule's own fields.
    """
    from mpi4py import MPI

    from theanompi.data import TrainLoader, ValLoader
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
            train = TrainLoader(cfg, rank, size)
            val = ValLoader(cfg, rank, size)
            built = build_model(
                cfg.model, train.input_shape, cfg.model.batch_size, model, cfg.training.backend
            )
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

    with Watchdog(comm, float(cfg.training.stall_timeout)) as watchdog:
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


def _snapshotter(cfg: Any, rule: Any, comm: Any, model: Any) -> Any:
    """The run's checkpoint writer/reader, its meta naming the config and the rule."""
    from theanompi.train.snapshot import Snapshotter

    rule_meta = {"config": cfg.to_dict(), "rule": rule.name}
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
    snap: Any, model: Any, comm: Any, resume: bool, n_epochs: int, log: Any
) -> tuple[int, int, str | None, int]:
    """(epoch, step, last checkpoint, step in epoch) to start from: the checkpoint's on
    resume, else zeros with rank 0's parameters and optimizer state broadcast."""
    from theanompi.models.params import bcast_values

    start_epoch, step, last_ckpt, start_in_epoch = 0, 0, None, 0
    if resume:
        ck = snap.restore()
        start_epoch, step, last_ckpt = ck.epoch, ck.step, str(ck.path)
        start_in_epoch = int(ck.meta.get("step_in_epoch", 0))  # a mid-epoch checkpoint
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
        steps_per_epoch=train.steps_per_epoch,
        dropped_sub_batches=train.dropped,
        batch_size=train.batch_size,
        lr_scale=scale,
        warmup_steps=warmup,
        config=cfg.to_dict(),
        **rule.settings(),
    )
    return record


def _loop_settings(cfg: Any, n_epochs: int) -> Any:
    """The Trainer loop's plain settings, read off the config."""
    from theanompi.train.trainer import LoopSettings

    return LoopSettings(
        n_epochs=n_epochs,
        print_freq=int(cfg.training.print_freq),
        check_every=int(cfg.weight_exchange.check_every),
        checkpoint_every_steps=int(cfg.output.checkpoint_every_steps),
        checkpoint_every_minutes=float(cfg.output.checkpoint_every_minutes),
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
    from theanompi.models.params import check_same_layout
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
    start_epoch, step, last_ckpt, start_in_epoch = _start_point(
        snap, model, comm, resume, n_epochs, log
    )
    rule.setup(model, comm)
    b = train.batch_size
    global_batch = b * size
    scale = lr_scale(cfg.training.lr_scaling, global_batch, cfg.training.lr_reference_batch)
    warmup = round(float(cfg.training.warmup_epochs) * train.steps_per_epoch)
    log(
        f"{rule.world_size} rank(s), model {cfg.model.name}, {rule.describe()}, batch {b}/worker "
        f"({global_batch} global on {size} worker(s)), {n_epochs} epochs"
        + (f", lr x {scale:g}" if scale != 1 else "")
        + (f", warm-up {warmup} steps" if warmup else "")
    )
    log(train.summary)
    record = _open_record(cfg, rule, train, size, rank == 0, resume, start_epoch, scale, warmup)
    trainer = Trainer(
        model=model,
        rule=rule,
        comm=comm,
        train=train,
        val=val,
        snap=snap,
        record=record,
        timeline=timeline,
        schedule=LRSchedule(scale, warmup),
        settings=_loop_settings(cfg, n_epochs),
        watchdog=watchdog,
    )
    try:
        return trainer.fit(start_epoch, step, last_ckpt, start_in_epoch)
    finally:
        record.close()
