"""GOSGD: gossip SGD (Blot, Picard, Cord & Thome 2016, arXiv:1611.09726), as Theano-MPI shipped it.

Every worker trains its own replica on its own shard and holds a gossip weight ``a``
(``1/N`` at the start, the weights summing to 1). After each local step a worker, with
probability ``p``, halves its weight and pushes its values and that half to one peer
chosen uniformly at random; a receiver mixes what it receives by the weights::

    sender:    a_i <- a_i / 2;  send (x_i, a_i)
    receiver:  x_j <- x_j + a_i / (a_j + a_i) * (x_i - x_j);  a_j <- a_j + a_i

so the weighted mean ``sum_i a_i x_i`` of the workers is kept by every exchange; it is the
model that is validated and checkpointed at each epoch end (the workers go on with their
own values). No rank ever waits for another inside a step: pushes are ``Isend`` (a push
is skipped while this worker's previous push is still being delivered, so at most one is
in flight per worker), and a worker mixes whatever has arrived (``Iprobe``) after each
step. At each epoch end the workers agree on how many pushes each of them was sent and
receive all that are still in flight (:meth:`Gossip.drain`).

Gradient accumulation (``training.accumulate_steps`` K > 1) is supported: a worker's local
step takes the mean gradient of K sub-batches (a K times larger local batch), and the push
is drawn once per such step.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from theanompi.rules.base import SyncRule, own_values, set_own_values

__all__ = ["GOSGD", "Gossip", "TAG_HEAD", "TAG_DATA"]

TAG_HEAD = 711  # float64 (weight, message id)
TAG_DATA = 712  # the fused float32 values


class Gossip:
    """The push/mix protocol over one fused float32 buffer per worker.

    Parameters
    ----------
    comm
        The workers' communicator.
    p
        Probability of a push after each step.
    seed
        With the rank, fixes the push draws and the peers (the arrival order does not).
    n
        Elements of the fused buffer.
    record
        Keep every push and mix in :attr:`events` (for the float64 replay test).
    """

    def __init__(self, comm: Any, p: float, seed: int, n: int, record: bool = False) -> None:
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.p = float(p)
        self.rng = np.random.default_rng([int(seed), self.rank, 0x6055])
        self.weight = 1.0 / self.size
        self.sent = np.zeros(self.size, dtype=np.int64)  # pushes sent to each rank
        self.received = 0
        self.pushes = self.skipped = 0
        self._send = np.empty(n, dtype=np.float32)
        self._recv = np.empty(n, dtype=np.float32)
        self._head = np.zeros(2, dtype=np.float64)
        self._rhead = np.zeros(2, dtype=np.float64)
        self._reqs: list[Any] = []
        self.events: list[tuple[Any, ...]] | None = [] if record else None

    def draw(self) -> int | None:
        """This step's push target, or ``None`` (one draw of the push and one of the peer)."""
        push = self.rng.random() < self.p
        peer = int(self.rng.integers(self.size - 1)) if self.size > 1 else 0
        if not push or self.size < 2:
            return None
        return peer + (peer >= self.rank)

    def incoming(self) -> bool:
        """Whether a push has arrived."""
        return bool(self.comm.Iprobe(tag=TAG_HEAD))

    def push(self, x: np.ndarray, peer: int) -> bool:
        """Send half of this worker's weight with a copy of ``x`` to ``peer``; ``False`` when
        the previous push is still in flight (then nothing is sent)."""
        from mpi4py import MPI

        if self._reqs and not MPI.Request.Testall(self._reqs):
            self.skipped += 1
            return False
        self.weight /= 2
        self._send[:] = x
        self._head[:] = (self.weight, self.pushes)
        self._reqs = [
            self.comm.Isend([self._head, MPI.DOUBLE], dest=peer, tag=TAG_HEAD),
            self.comm.Isend([self._send, MPI.FLOAT], dest=peer, tag=TAG_DATA),
        ]
        if self.events is not None:
            self.events.append(("send", peer, self.pushes, self.weight))
        self.sent[peer] += 1
        self.pushes += 1
        return True

    def _take(self, src: int, x: np.ndarray) -> None:
        from mpi4py import MPI

        self.comm.Recv([self._rhead, MPI.DOUBLE], source=src, tag=TAG_HEAD)
        self.comm.Recv([self._recv, MPI.FLOAT], source=src, tag=TAG_DATA)
        a = float(self._rhead[0])
        share = np.float32(a / (self.weight + a))
        self._recv -= x
        self._recv *= share
        x += self._recv
        self.weight += a
        self.received += 1
        if self.events is not None:
            self.events.append(("recv", src, int(self._rhead[1])))

    def receive(self, x: np.ndarray) -> int:
        """Mix every push that has arrived into ``x`` (in place); returns how many."""
        from mpi4py import MPI

        status, n = MPI.Status(), 0
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_HEAD, status=status):
            self._take(status.Get_source(), x)
            n += 1
        return n

    def drain(self, x: np.ndarray) -> None:
        """Collective: mix every push still in flight into ``x``; afterwards nothing is."""
        from mpi4py import MPI

        total = np.empty_like(self.sent)
        self.comm.Allreduce(self.sent, total, op=MPI.SUM)
        status = MPI.Status()
        while self.received < total[self.rank]:
            self.comm.Probe(source=MPI.ANY_SOURCE, tag=TAG_HEAD, status=status)
            self._take(status.Get_source(), x)
        MPI.Request.Waitall(self._reqs)
        self._reqs = []

    def state(self) -> dict[str, Any]:
        """What a resume needs (JSON-able; call with nothing in flight, after :meth:`drain`):
        the weight, the draws' generator state and the counts :meth:`drain` agrees on."""
        return {
            "weight": self.weight,
            "rng": self.rng.bit_generator.state,
            "sent": [int(c) for c in self.sent],
            "received": self.received,
            "pushes": self.pushes,
            "skipped": self.skipped,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Take back :meth:`state` (same number of workers)."""
        if len(state["sent"]) != self.size:
            raise ValueError(f"gossip state of {len(state['sent'])} workers, now {self.size}")
        self.weight = float(state["weight"])
        self.rng.bit_generator.state = state["rng"]
        self.sent[:] = state["sent"]
        self.received = int(state["received"])
        self.pushes, self.skipped = int(state["pushes"]), int(state["skipped"])

    def weighted_mean(self, x: np.ndarray) -> np.ndarray:
        """Collective: ``sum_i a_i x_i / sum_i a_i`` over the workers, in float64 on rank 0,
        then the same float32 bits on every rank."""
        from mpi4py import MPI

        part = x.astype(np.float64) * self.weight
        total = np.empty_like(part) if self.rank == 0 else None
        self.comm.Reduce(part, total, op=MPI.SUM, root=0)
        w = np.array([self.weight], dtype=np.float64)  # a buffer Allreduce: it lets the
        self.comm.Allreduce(MPI.IN_PLACE, w, op=MPI.SUM)  # watchdog's thread run (metrics.py)
        weights = float(w[0])
        out = np.empty_like(x)
        if self.rank == 0:
            out[:] = total / weights
        self.comm.Bcast([out, MPI.FLOAT], root=0)
        return out


class GOSGD(SyncRule):
    """Gossip SGD over the workers (every rank trains).

    Parameters
    ----------
    p
        Probability that a worker pushes to a random peer after a step, in (0, 1].
    seed
        Seeds each rank's push draws (with the rank).
    """

    name = "GOSGD"
    min_ranks: ClassVar[int] = 2
    synchronous: ClassVar[bool] = False
    bit_exact_resume: ClassVar[bool] = False
    mid_epoch_checkpoints: ClassVar[bool] = True

    def __init__(self, p: float = 0.5, seed: int = 0) -> None:
        if not 0.0 < p <= 1.0:
            raise ValueError(f"gossip p must be in (0, 1], got {p!r}")
        self.p, self.seed = float(p), int(seed)
        self.gossip: Gossip | None = None
        self.buf: Any = None

    @classmethod
    def from_config(cls, weight_exchange: Any, seed: int) -> GOSGD:
        return cls(p=weight_exchange.gossip_p, seed=seed)

    def describe(self) -> str:
        return f"gossip p {self.p}"

    def settings(self) -> dict[str, Any]:
        return {"gossip_p": self.p}

    def setup(self, model: Any, comm: Any) -> None:
        from theanompi.models.params import ParamBuffer

        self.buf = ParamBuffer(model.params)
        self.gossip = Gossip(comm, self.p, self.seed, self.buf.size)

    def after_step(self, model: Any, step: int) -> float:
        from mpi4py import MPI

        t0 = MPI.Wtime()
        g = self.gossip
        peer = g.draw()
        if peer is None and not g.incoming():
            return MPI.Wtime() - t0
        x = self.buf.gather()
        mixed = g.receive(x)
        if peer is not None:
            g.push(x, peer)
        if mixed:
            self.buf.scatter()
        return MPI.Wtime() - t0

    def epoch_end(self, model: Any) -> None:
        x = self.buf.gather()
        self.gossip.drain(x)
        self.buf.scatter()

    def eval_values(self, model: Any) -> list[np.ndarray]:
        return self.buf.split(self.gossip.weighted_mean(self.buf.gather()))

    def checkpoint_state(self, model: Any) -> tuple[list[np.ndarray], dict[str, Any]]:
        """Collective: receive every push in flight (as at an epoch end), then this worker's
        own values and momentum, its gossip weight, its draws' generator and its counts."""
        self.epoch_end(model)
        return own_values(model), self.gossip.state()

    def load_checkpoint_state(self, model: Any, arrays: list[np.ndarray], meta: Any) -> None:
        set_own_values(model, arrays)
        self.gossip.load_state(meta)

    def finish(self, model: Any) -> dict[str, Any]:
        g = self.gossip
        self.epoch_end(model)  # nothing may stay in flight after the last step
        counts = g.comm.allgather((g.pushes, g.skipped, g.received))
        return {
            "pushes": {str(r): c[0] for r, c in enumerate(counts)},
            "skipped_pushes": {str(r): c[1] for r, c in enumerate(counts)},
            "received": {str(r): c[2] for r, c in enumerate(counts)},
        }
