"""``tmpi train``: check the run dir, build the rule, loaders and model, read the rest of the config into a plan, then train."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from theanompi.comm import collective
from theanompi.errors import ConfigError

if TYPE_CHECKING:
    from theanompi.train.elastic import Commit, Resume
    from theanompi.train.plan import FitPlan

__all__ = ["run", "create_rule", "build_model", "save_config", "train_loader", "check_accumulate"]


def create_rule(cfg: Any, size: int) -> tuple[Any, str]:
    """The sync rule named by ``weight_exchange.sync_rule``, built from its section for a job
    of ``size`` ranks, and a note of what elastic training changed in that section: its
    exchange stays serial (overlap auto), and a strategy that needs a power of 2 that ``size``
    is not gives way to the first that takes any N, with the same values on the wire."""
    import dataclasses

    from theanompi.comm import is_power_of_two
    from theanompi.exchange import STRATEGIES, any_n_strategies
    from theanompi.rules import RULES

    we, note = cfg.weight_exchange, ""
    if cfg.elastic.min_np and we.overlap == "auto":
        we = dataclasses.replace(we, overlap="never")
    cls = STRATEGIES.get(we.exch_strategy)
    swap = cfg.elastic.min_np and RULES.get(we.sync_rule).uses_strategy
    if swap and cls.requires_power_of_two and not is_power_of_two(size):
        other = any_n_strategies()[0]
        wire = cls.wire_compression(we.compression)
        on = other + ("" if wire == "none" else f"+{wire}")
        note = f"; {we.exch_strategy} needs a power of 2: {on} on {size}"
        we = dataclasses.replace(we, exch_strategy=other, compression=wire)
    return RULES.get(we.sync_rule).from_config(we, seed=cfg.randomness.seed), note


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

    from theanompi.io.timeline import Timeline
    from theanompi.launch.watchdog import Watchdog
    from theanompi.registry import source_of
    from theanompi.train.plan import FitPlan
    from theanompi.train.rundir import check_run_dir
    from theanompi.train.startup import check_nodes

    comm = MPI.COMM_WORLD if comm is None else comm
    rule, note = create_rule(cfg, comm.Get_size())
    if note and comm.Get_rank() == 0:  # elastic, relaunched on N that is no power of 2
        print(f"[{rule.name.lower()}] elastic: {note.lstrip('; ')}", flush=True)
    rule.check_world(comm.Get_size())
    n_workers = rule.n_workers(comm.Get_size())
    check_run_dir(comm, cfg, resume=resume, overwrite=overwrite, n_workers=n_workers)
    model_source = source_of(str(cfg.model.name))  # a user's model: the file it is trained with
    collective(comm, save_config, cfg, comm.Get_rank() == 0)  # the run dir was accepted
    wcomm, server = rule.worker_comm(comm), rule.server(comm)
    timeline = Timeline(cfg.output.timeline or None, comm)
    collective(comm, check_nodes, comm, str(cfg.data.dir), str(cfg.output.run_dir))
    parts = collective(comm, _setup, cfg, wcomm, model, server is None)
    plan = FitPlan.from_config(cfg, resume, model_source)
    stall, stacks = float(cfg.training.stall_timeout), f"{cfg.output.run_dir}/stacks"
    if plan.elastic and plan.elastic.in_place:  # BSP: every rank a worker
        mine, comm = _fit_elastic(cfg, plan, comm, (rule, *parts), timeline, stall, stacks)
    else:
        with Watchdog(comm, stall, stacks_dir=stacks) as watchdog:
            if server is not None:
                mine = server.serve()
            else:
                mine = _fit(plan, rule, wcomm, *parts, timeline, watchdog)
    timeline.close()
    # every rank returns the first worker's summary, with what the servers add (serve_s)
    everyone = comm.allgather((server is not None, mine))
    summary = dict(next(part for serving, part in everyone if not serving))
    for serving, part in everyone:
        if serving:
            summary.update(part)
    return summary


def _fit_elastic(
    cfg: Any,
    plan: FitPlan,
    comm: Any,
    parts: tuple[Any, ...],
    timeline: Any,
    stall: float,
    stacks: str,
) -> tuple[dict[str, Any], Any]:
    """:func:`~theanompi.train.elastic.train_elastic` of the rule and loaders ``parts``
    (rebuilt from ``cfg`` for the ranks left after a loss) and the built model; returns the
    summary and the world it ended on."""
    from theanompi.launch.slurm import EXIT_REQUEUED, job_id
    from theanompi.launch.watchdog import Watchdog
    from theanompi.train.elastic import Commit, train_elastic

    model, elastic = parts[-1], plan.elastic
    assert elastic is not None
    commit = Commit(model, elastic.commit_every_steps)

    def fit(c: Any, p: tuple[Any, ...], resume: Resume | None) -> dict[str, Any]:
        rule, train, val, _ = p
        with Watchdog(c, stall, stacks_dir=stacks) as watchdog:
            return _fit(plan, rule, c, train, val, model, timeline, watchdog, commit, resume)

    def rebuild(c: Any) -> tuple[tuple[Any, ...], str]:
        rule, note = create_rule(cfg, c.Get_size())
        rule.worker_comm(c)  # every rank a worker
        return (rule, *_loaders(cfg, c.Get_rank(), c.Get_size()), model), note

    return train_elastic(
        comm,
        parts,
        min_np=elastic.min_np,
        commit=commit,
        fit=fit,
        rebuild=rebuild,
        log=(lambda t: print(f"[{parts[0].name.lower()}] {t}", flush=True)),
        stop_code=lambda: EXIT_REQUEUED if job_id() is not None else 1,
    )


def _loaders(cfg: Any, rank: int, size: int) -> tuple[Any, Any]:
    """Rank ``rank`` of ``size``'s training and validation loaders."""
    from theanompi.data import ValLoader

    return train_loader(cfg, rank, size), ValLoader(cfg, rank, size)


def _setup(cfg: Any, comm: Any, model: Any, works: bool) -> tuple[Any, Any, Any] | None:
    """A worker's loaders and its built model (a node's ranks compile each module once:
    :mod:`theanompi.models.ops._parallel`), checked against
    the other workers' (the same parameters and optimiser state), and ``--verify-data``'s
    check of every batch file, shared over the workers ``comm``; None on a serving rank
    (``works`` false)."""
    from mpi4py import MPI

    from theanompi.models.params import check_same_layout

    if not works:
        return None
    rank, size = comm.Get_rank(), comm.Get_size()
    train, val = _loaders(cfg, rank, size)
    built = build_model(
        cfg.model, train.input_shape, cfg.model.batch_size, model, cfg.training.backend
    )
    check_accumulate(built, cfg.training.accumulate_steps)
    check_same_layout(built.params, comm, "param")  # every worker built the same model
    check_same_layout(built.opt_state, comm, "optimizer state")
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


def _fit(
    plan: FitPlan,
    rule: Any,
    comm: Any,
    train: Any,
    val: Any,
    model: Any,
    timeline: Any,
    watchdog: Any = None,
    commit: Commit | None = None,
    resume: Resume | None = None,
) -> dict[str, Any]:
    """A worker's training: checkpoints, start values (rank 0's or the checkpoint's),
    the lr schedule and the record, then the Trainer's loop. Elastic: ``commit`` keeps the
    state a shrink goes back to, and ``resume`` is where the ranks left go on from (its
    values already in ``model``)."""
    from theanompi.io.recorder import Recorder
    from theanompi.train.rng import seed_rngs
    from theanompi.train.snapshot import Snapshotter
    from theanompi.train.start_point import StartPoint, start_state
    from theanompi.train.trainer import Trainer

    tag = f"[{rule.name.lower()}]"
    log = (lambda t: print(f"{tag} {t}", flush=True)) if comm.Get_rank() == 0 else (lambda t: None)
    loop, size = plan.loop, comm.Get_size()
    k, n_epochs = loop.accumulate_steps, loop.n_epochs
    seed_rngs(model, plan.seed, rule.world.Get_rank())
    sp = plan.snapshot
    snap = Snapshotter(
        sp.directory,
        sp.freq,
        comm,
        model,
        local_opt=rule.local_opt_state,
        meta=sp.meta(plan.config, rule.name),
        keep_last=sp.keep_last,
    )
    global_batch = train.batch_size * k * size  # images per optimiser step: what lr scaling counts
    spe = train.steps_per_epoch // k  # optimiser steps per epoch: what warm-up counts
    schedule, scale, warmup = plan.schedule.schedule(global_batch, spe, n_epochs)
    if resume is None:
        start = start_state(
            snap, model, rule, comm, resume=plan.resume, k=k, n_epochs=n_epochs, log=log
        )
    else:  # after a shrink: the commit's values are in the model on every rank left
        rule.setup(model, comm)
        p = resume.point
        start = StartPoint(p.epoch, p.step, p.checkpoint, dealt=p.dealt)
    rp = plan.record
    recorder = Recorder.open(
        comm,
        rp.record_dir,
        loggers=rp.loggers,
        run_dir=rp.run_dir,
        start_epoch=start.epoch,
        resumed=plan.resume,
        shrunk=resume is not None,
        resumed_step=start.step,
        epoch_entry=start.epoch_entry,
        start=dict(
            rule=rule.name,
            world_size=rule.world_size,
            n_workers=size,
            resume=plan.resume,
            start_epoch=start.epoch,
            steps_per_epoch=spe,
            dropped_sub_batches=train.dropped,
            batch_size=train.batch_size,
            accumulate_steps=k,
            lr_scale=scale,
            warmup_steps=warmup,
            config=plan.config,
            **rule.settings(),
            **({"elastic": resume.change} if resume is not None else {}),
        ),
    )
    trainer = Trainer(
        model=model,
        rule=rule,
        comm=comm,
        train=train,
        val=val,
        snap=snap,
        record=recorder.record,
        timeline=timeline,
        schedule=schedule,
        settings=loop,
        watchdog=watchdog,
        loggers=recorder.loggers,
        commit=commit,
    )
    if resume is None:  # a shrink's own line said what changed
        lost = recorder.lost_steps
        _log_start(log, rule, plan.model_name, train, size, n_epochs, k, scale, warmup, lost)
    try:
        return trainer.fit(
            start.epoch, start.step, start.checkpoint, start.step_in_epoch, start.dealt
        )
    finally:
        recorder.close()


def _log_start(
    log: Any,
    rule: Any,
    model_name: str,
    train: Any,
    size: int,
    n_epochs: int,
    k: int,
    scale: float,
    warmup: int,
    lost_steps: int,
) -> None:
    """Rank 0's lines about the run about to train: ranks, model, rule, batches, lr, and the
    ``lost_steps`` after the checkpoint resumed from that it trains again."""
    b, spe = train.batch_size, train.steps_per_epoch // k
    log(
        f"{rule.world_size} rank(s), model {model_name}, {rule.describe()}, batch {b}/worker"
        + (f" x {k} accumulated" if k > 1 else "")
        + f" ({b * k * size} global on {size} worker(s)), {n_epochs} epochs"
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
    if lost_steps:
        log(
            f"{lost_steps} step(s) after that checkpoint were lost (stopped before the next "
            "one): training them again"
        )
