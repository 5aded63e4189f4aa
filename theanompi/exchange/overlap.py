"""Gradient buckets exchanged by a communication thread while the backward pass still runs.

The compiled step calls :meth:`OverlappedExchange.start` for bucket ``k`` as soon as that
bucket's gradients exist (an Op in the graph, see :mod:`theanompi.models.overlap`); the
thread exchanges it with the chosen strategy while the step computes the next ones, and
:meth:`~OverlappedExchange.wait` after the step waits only for what is still on the wire.

Why a thread and why it works: the compiled step holds the GIL, but an MPI call made through
mpi4py releases it, and with ``MPI_THREAD_MULTIPLE`` the thread progresses its exchange while
the step computes. It waits in :class:`~theanompi.exchange.polling.PollingComm`'s calls,
which sleep between progress calls instead of spinning a core the step needs. What the thread
needs the GIL for is *starting* each call; :meth:`start` hands the GIL over when the thread is
idle, until it is inside its first MPI call, and the step runs in PyTensor's Python VM loop,
which lets the thread in again between Ops for a strategy's later calls and later buckets (a
C loop would hold the GIL until the step ends). Horovod keeps its thread in C++ for the same
reason.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from theanompi.exchange.polling import PollingComm

__all__ = ["OverlappedExchange", "plan_buckets"]

#: GIL switch interval while buckets are in flight: how long the thread may wait for the GIL
#: between its MPI calls (Python's default is 5 ms)
SWITCH_INTERVAL_S = 0.0005
#: the first bucket's MB (DDP's 1 MiB): the last layers' gradients leave without waiting
FIRST_BUCKET_MB = 1.0


def plan_buckets(
    nbytes: Sequence[int], bucket_mb: float, first_mb: float = FIRST_BUCKET_MB
) -> list[list[int]]:
    """Group array indices into buckets, last array first (the order a backward pass produces
    gradients in): the first bucket closes at ``first_mb`` MB, so that the exchange starts
    early, the others at ``bucket_mb`` (DDP's rule); an array never spans two buckets.

    >>> plan_buckets([4, 4, 4, 4], bucket_mb=8 / 2**20, first_mb=4 / 2**20)
    [[3], [2, 1], [0]]
    >>> plan_buckets([100, 1, 1], bucket_mb=8 / 2**20)
    [[2, 1, 0]]
    """
    buckets: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i in reversed(range(len(nbytes))):
        cur.append(i)
        size += nbytes[i]
        if size >= (bucket_mb if buckets else min(first_mb, bucket_mb)) * 2**20:
            buckets.append(cur)
            cur, size = [], 0
    if cur:
        buckets.append(cur)
    return buckets


def _views(flat: np.ndarray, shapes: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
    """``flat`` cut into consecutive arrays of these shapes (views, no copy)."""
    sizes = [int(np.prod(s)) for s in shapes]
    ends = np.cumsum(sizes).tolist()
    return [flat[e - n : e].reshape(s) for s, n, e in zip(shapes, sizes, ends, strict=True)]


class OverlappedExchange:
    """Exchange ``arrays``-shaped float32 values in buckets, each on a thread as it is ready.

    Every bucket has its own exchanger (``strategy``, ``compression``) on a duplicate of
    ``comm``, so the result of each array is what that exchanger's contract promises
    (bit-identical on all ranks; the same values as one exchange of all arrays, up to the
    order MPI adds them in). ``start(k, values)`` copies bucket ``k``'s values (the step may
    reuse their memory) and queues it; buckets are started in the same order on every rank.
    ``wait()`` returns the seconds the caller waited; ``busy_s`` the thread's seconds
    exchanging, of which ``busy_s - waited`` were hidden under compute; ``take_spans()`` each
    bucket's ``(k, start, end)`` in ``MPI.Wtime`` seconds. ``result(i)`` is array ``i``'s
    exchanged value. ``close()`` ends the thread (also at exit: daemon).
    """

    def __init__(
        self,
        shapes: Sequence[tuple[int, ...]],
        bucket_mb: float,
        make_exchanger: Any,
        comm: Any,
    ) -> None:
        self.buckets = plan_buckets([4 * int(np.prod(s)) for s in shapes], bucket_mb)
        # a bucket is one flat buffer (its arrays are views of it), exchanged as one array: one
        # MPI call a bucket, so the thread needs no GIL between its arrays (measured on two
        # simulated nodes: exchange waited after the step 87 -> 61-71 ms)
        self._flat = [
            np.zeros(sum(int(np.prod(shapes[i])) for i in b), np.float32) for b in self.buckets
        ]
        self._bufs = [
            _views(f, [shapes[i] for i in b]) for f, b in zip(self._flat, self.buckets, strict=True)
        ]
        self._where = {i: (k, j) for k, b in enumerate(self.buckets) for j, i in enumerate(b)}
        self.comm = PollingComm(comm.Dup())
        self._exchangers = [make_exchanger(self.comm) for _ in self.buckets]
        for ex, flat in zip(self._exchangers, self._flat, strict=True):
            ex.prepare([flat])
        self._queue: queue.SimpleQueue[tuple[int, bool]] = queue.SimpleQueue()
        self._idle = False
        self._entered = threading.Semaphore(0)
        self._done = threading.Semaphore(0)
        self._pending = 0
        self._error: BaseException | None = None
        self.busy_s = 0.0
        self._spans: list[tuple[int, float, float]] = []
        self._old_interval = sys.getswitchinterval()
        self._thread = threading.Thread(target=self._run, name="theanompi-exchange", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        mb = [float(f"{sum(a.nbytes for a in bufs) / 2**20:.3g}") for bufs in self._bufs]
        return f"OverlappedExchange({len(mb)} buckets of {mb} MB)"

    def start(self, k: int, values: Sequence[np.ndarray]) -> None:
        """Queue bucket ``k`` with these values (in the bucket's array order)."""
        for dst, src in zip(self._bufs[k], values, strict=True):
            np.copyto(dst, src)
        if not self._pending:  # the thread's turns at the GIL come this often while it works
            sys.setswitchinterval(min(self._old_interval, SWITCH_INTERVAL_S))
        self._pending += 1
        # an idle thread gets the GIL until it is inside MPI; a busy one takes this bucket
        # when it is done with its own, at one of the VM's switches between Ops: waiting for
        # it here would stall the backward pass for a whole bucket's exchange (126 of 390 ms)
        handover = self._idle
        self._queue.put((k, handover))
        if handover:
            self._entered.acquire()

    def wait(self) -> float:
        """Wait for every started bucket; returns the seconds waited here."""
        t0 = MPI.Wtime()
        while self._pending:
            self._done.acquire()
            self._pending -= 1
        sys.setswitchinterval(self._old_interval)
        waited = MPI.Wtime() - t0
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        return waited

    def result(self, i: int) -> np.ndarray:
        """Array ``i``'s exchanged value (valid after :meth:`wait`, until the next start)."""
        k, j = self._where[i]
        return self._bufs[k][j]

    def take_busy(self) -> float:
        """The thread's exchanging seconds since the last call."""
        busy, self.busy_s = self.busy_s, 0.0
        return busy

    def take_spans(self) -> list[tuple[int, float, float]]:
        """``(bucket, start, end)`` of each exchange since the last call (``MPI.Wtime``)."""
        spans, self._spans = self._spans, []
        return spans

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put((-1, False))
            self._thread.join()
            sys.setswitchinterval(self._old_interval)  # a step that raised left it short
            self.comm.Free()

    def _run(self) -> None:
        while True:
            self._idle = True
            k, handover = self._queue.get()
            self._idle = False
            if k < 0:
                return
            t0 = MPI.Wtime()
            if handover:  # the exchange releases the GIL inside its first MPI call
                self._entered.release()
            try:
                self._exchangers[k].exchange([self._flat[k]])
            except BaseException as err:  # raised again by wait(), on the caller's thread
                self._error = err
            t1 = MPI.Wtime()
            self.busy_s += t1 - t0
            self._spans.append((k, t0, t1))
            self._done.release()
