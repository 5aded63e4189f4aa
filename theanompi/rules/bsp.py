"""BSP: every rank trains on its own sub-batch, then all ranks exchange (``avg`` params or
``cdd`` gradients) with the configured strategy and stay bit-identical.

One step of rank r (of N):

* ``avg``: ``model.train_step(x, y)`` (local SGD update), then the exchanger
  replaces every parameter by its mean over ranks;
* ``cdd``: ``model.compute_grads(x, y)``, the exchanger averages the gradients,
  then ``model.apply_grads()`` (the same update on every rank).

Around it: the start-up broadcast of rank 0's (or the checkpoint's) params and
a layout check, data prefetching with the wait time measured, progress lines,
the lr schedule, per-epoch validation summed over ranks, checkpoints every
``snapshot_freq`` epochs and a JSON-lines record.
"""

from __future__ import annotations

from typing import Any

from theanompi.data import TrainLoader, ValLoader
from theanompi.data._fault import fault_point
from theanompi.record import RecordWriter
from theanompi.rules._common import (
    Progress,
    Snapshotter,
    StepStats,
    StopFlag,
    assert_identical,
    bcast_values,
    build_model,
    check_same_layout,
    get_values,
    seed_rngs,
    set_values,
    validate,
    wtime,
)

__all__ = ["run_bsp"]


def _exchanger(cfg: Any, comm: Any, arrays: list[Any]) -> Any:
    from theanompi.exchange import create_exchanger

    ex = create_exchanger(cfg.weight_exchange.exch_strategy, comm=comm, op="mean")
    ex.prepare(arrays)
    return ex


def _exchange(ex: Any, shared: list[Any]) -> None:
    """Average the values of ``shared`` over ranks in place (no-op on one rank: ``ex`` is None)."""
    if ex is not None:
        arrays = get_values(shared)
        ex.exchange(arrays)
        set_values(shared, arrays)


def run_bsp(
    cfg: Any, comm: Any = None, *, resume: bool = False, model: Any = None
) -> dict[str, Any]:
    """Train ``cfg.model`` with BSP on the ranks of ``comm`` (default ``COMM_WORLD``).

    Parameters
    ----------
    cfg : theanompi.config.Config
    comm : mpi4py communicator
    resume : continue from the latest checkpoint in ``cfg.output.checkpoint_dir``.
    model : an already created model (default: ``create_model(cfg.model)``); tests pass one.

    Returns
    -------
    dict
        ``epochs``, ``steps``, ``val_top1_err``, ``val_top5_err``, ``val_loss``,
        ``images_per_s`` (mean over the run), ``t_compute`` / ``t_exchange`` /
        ``t_wait`` (mean s per step), ``median_wall_s`` / ``median_compute_s`` /
        ``median_exchange_s`` / ``median_wait_s`` (medians per step), ``seconds``, ``checkpoint`` (last written or
        restored), ``interrupted``.
    """
    if comm is None:
        from theanompi.comm import world

        comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    we = cfg.weight_exchange
    cdd = we.sync_type == "cdd"
    n_epochs = int(cfg.model.n_epochs)
    t_start = wtime()

    train = TrainLoader(cfg, rank, size)
    val = ValLoader(cfg, rank, size)
    model = build_model(cfg, train.input_shape, model)
    check_same_layout(model.params, comm, "param")
    check_same_layout(model.opt_state, comm, "optimizer state")
    seed_rngs(model, cfg.randomness.seed, rank)
    snap = Snapshotter(cfg, comm, model, local_opt=not cdd)
    prog = Progress(comm, train.batch_size * size, tag="bsp")

    start_epoch, step, last_ckpt = 0, 0, None
    if resume:
        ck = snap.restore()
        start_epoch, step, last_ckpt = ck.epoch, ck.step, str(ck.path)
        prog.log(f"[bsp] resumed from {ck.path} (epoch {start_epoch}, step {step})")
        if start_epoch >= n_epochs:
            prog.log(
                f"[bsp] {start_epoch} epoch(s) already done of model.n_epochs={n_epochs}; "
                "nothing to train (raise --epochs to continue)"
            )
    else:
        bcast_values(model.params, comm)
        bcast_values(model.opt_state, comm)

    rec = RecordWriter(
        cfg.output.record_dir, enabled=rank == 0, keep_before_epoch=start_epoch if resume else None
    )
    ex_vars = model.grads if cdd else model.params
    ex = _exchanger(cfg, comm, get_values(ex_vars)) if size > 1 else None
    prog.log(
        f"[bsp] {size} rank(s), model {cfg.model.name}, exchange {we.exch_strategy}/{we.sync_type}, "
        f"batch {train.batch_size}/rank ({train.batch_size * size} global), {n_epochs} epochs"
    )
    prog.log(f"[bsp] {train.summary}")
    rec.write(
        "start",
        rule="BSP",
        world_size=size,
        resume=resume,
        start_epoch=start_epoch,
        steps_per_epoch=train.steps_per_epoch,
        dropped_sub_batches=train.dropped,
        batch_size=train.batch_size,
        config=cfg.to_dict(),
    )

    check_every = int(we.check_every)
    print_freq = max(1, int(cfg.training.print_freq))
    stop_every = min(print_freq, 10)  # steps between the ranks' Ctrl-C agreement
    stats = StepStats()
    summary: dict[str, Any] = {
        "interrupted": False,
        "val_top1_err": None,
        "val_top5_err": None,
        "val_loss": None,
    }
    interrupted = False
    epoch = epochs_done = start_epoch
    with StopFlag() as stop:
        for epoch in range(start_epoch, n_epochs):
            model.adjust_hyperparams(epoch)
            lr = float(model.lr.get_value())
            ep_start, ep_first = wtime(), len(stats)
            win_start = len(stats)
            with train.epoch(epoch) as batches:
                for k in range(train.steps_per_epoch):
                    t0 = wtime()
                    x, y = next(batches)
                    t1 = wtime()
                    fault_point("step", rank, step)
                    if cdd:
                        loss, err = model.compute_grads(x, y)
                        t2 = wtime()
                        _exchange(ex, model.grads)
                        t3 = wtime()
                        model.apply_grads()
                        t4 = wtime()
                        compute, exch = (t2 - t1) + (t4 - t3), t3 - t2
                    else:
                        loss, err = model.train_step(x, y)
                        t2 = wtime()
                        _exchange(ex, model.params)
                        t4 = wtime()
                        compute, exch = t2 - t1, t4 - t2
                    step += 1
                    t5 = wtime()
                    last = k + 1 == train.steps_per_epoch
                    if (k + 1) % stop_every == 0 or last:  # one sync point less on most steps
                        interrupted = stop.any(comm)
                    t6 = wtime()
                    exch += t6 - t5
                    stats.add(loss, err, compute, exch, t1 - t0, t6 - t0)
                    if check_every and step % check_every == 0:
                        assert_identical(model.params, comm, step)
                    if (k + 1) % print_freq == 0 or last:
                        entry = prog.window(
                            stats.since(win_start),
                            epoch=epoch,
                            n_epochs=n_epochs,
                            step_in_epoch=k + 1,
                            steps_per_epoch=train.steps_per_epoch,
                            step=step,
                            lr=lr,
                        )
                        rec.write("step", **entry)
                        win_start = len(stats)
                    if interrupted:
                        break
            if interrupted:
                break
            ep = stats.since(ep_first)
            tr_loss, tr_err = prog.reduce_mean([ep.mean("loss"), ep.mean("err")])
            v = validate(model, val, comm)
            ep_secs = wtime() - ep_start
            ips = train.batch_size * size * len(ep) / max(float(sum(ep.wall)), 1e-12)
            summary.update(v)
            saved = None
            if snap.due(epoch + 1, n_epochs):
                saved = last_ckpt = str(snap.save(epoch + 1, step, {"val": v}))
            epochs_done = epoch + 1
            rec.write(
                "epoch",
                epoch=epoch,
                step=step,
                train_loss=tr_loss,
                train_error=tr_err,
                lr=lr,
                images_per_s=ips,
                seconds=ep_secs,
                checkpoint=saved,
                **ep.split(),
                **v,
            )
            prog.log(
                f"[bsp] epoch {epoch + 1}/{n_epochs} done in {ep_secs:.1f} s: train loss "
                f"{tr_loss:.4f} err {tr_err * 100:.2f}% | val loss {v['val_loss']:.4f} top-1 err "
                f"{v['val_top1_err'] * 100:.2f}% top-5 err {v['val_top5_err'] * 100:.2f}% "
                f"(n={v['val_n']}) | {ips:,.0f} img/s" + (f" | saved {saved}" if saved else "")
            )

    total = wtime() - t_start
    summary.update(
        epochs=epochs_done,
        steps=step,
        world_size=size,
        seconds=total,
        checkpoint=last_ckpt,
        interrupted=interrupted,
        images_per_s=(train.batch_size * size * len(stats) / max(float(sum(stats.wall)), 1e-12))
        if len(stats)
        else None,
        **stats.split(),
        **{f"median_{k}_s": stats.median(k) for k in ("wall", "compute", "exchange", "wait")},
    )
    if interrupted:
        prog.log(
            f"[bsp] interrupted at epoch {epoch + 1} step {step}; last checkpoint: "
            f"{last_ckpt or 'none'} (continue with --resume)"
        )
    rec.write("end", **{k: v for k, v in summary.items() if k != "config"})
    rec.close()
    return summary
