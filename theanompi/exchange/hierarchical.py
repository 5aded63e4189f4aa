"""Reduce inside each node through shared memory, exchange between node leaders, copy back."""

from __future__ import annotations

import mmap
import os
import tempfile
from typing import Any

import numpy as np

from theanompi.comm import is_power_of_two, made
from theanompi.errors import ConfigError
from theanompi.exchange.base import Exchanger
from theanompi.exchange.compression import _F32_TINY, _U32, _gamma, get_compressor
from theanompi.exchange.polling import POLL_US, PollingComm, wait

__all__ = ["HierarchicalExchanger", "hierarchical_wanted", "POLL_S"]

#: a waiting rank's sleep between two progress calls (seconds)
POLL_S = POLL_US / 1e6
_ALIGN = 16  # float32 elements (64 bytes): no two ranks write one cache line


def hierarchical_wanted(mode: str, comm: Any = None, strategy: str | None = None) -> bool:
    """Whether ``weight_exchange.hierarchical: mode`` asks for a hierarchical exchange on
    ``comm``: ``auto`` when some node holds more than one rank, there is more than one node,
    and ``strategy`` (a name in ``STRATEGIES``) is not ``node_aware`` already (collective over
    ``comm`` for ``auto``). ``mode`` is one of :data:`~theanompi.exchange.WHEN`, checked
    when the config loads.

    >>> hierarchical_wanted("never"), hierarchical_wanted("always")
    (False, True)
    >>> hierarchical_wanted("auto", strategy="ar")  # Open MPI's Allreduce: node-aware
    False
    """
    if mode != "auto":
        return mode == "always"
    if strategy is not None:
        from theanompi.exchange import STRATEGIES

        if STRATEGIES.get(strategy).node_aware:
            return False
    from mpi4py import MPI

    from theanompi.comm import node_comm, world

    comm = world() if comm is None else comm
    node = node_comm(comm)
    most = comm.allreduce(node.Get_size(), op=MPI.MAX)
    nodes = comm.allreduce(1 if node.Get_rank() == 0 else 0)
    return most > 1 and nodes > 1


class HierarchicalExchanger(Exchanger):
    """Any strategy of :data:`~theanompi.exchange.STRATEGIES`, run between one leader per node.

    Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE`` in three steps, every one bit-deterministic:

    1. Every rank of a node copies its arrays into its own slot of one shared-memory window
       (``MPI.Win.Allocate_shared`` on the node's communicator); after a node barrier, local
       rank ``j`` sums chunk ``j`` of all the slots (in slot order, float32) into the
       node's result buffer, so the node reduce runs on all its cores at once.
    2. Where all nodes hold the same number of ranks (``striped``, the default), local rank
       ``j`` of every node exchanges chunk ``j`` with its peers (one communicator per local
       rank, as NCCL's and Open MPI ``han``'s node-aware allreduce do: several flows and
       cores at once; measured 158-171 ms against 208-211 ms for one leader per node, below).
       Otherwise, or for a buffer too small to give every rank a chunk, the node's leader
       (local rank 0) exchanges the whole result buffer with the other leaders. Either way
       through the chosen strategy and compression, ``op="sum"``; for the mean and for
       float16 the node sums are divided by N first, so that float16 does not overflow.
    3. After a node barrier every rank copies the result out of the shared buffer.

    Ranks that wait (for their node, or for the leaders' network exchange) poll a
    nonblocking barrier and sleep in between (:func:`wait_idle`): they do not busy-poll a
    core that the leader may need. All communicators are private (split at construction),
    so exchangers can be used from a communication thread, one per bucket.

    Parameters
    ----------
    strategy : str
        The strategy the leaders run (a key of :data:`~theanompi.exchange.STRATEGIES`);
        one that needs a power of 2 needs a power-of-2 number of nodes.
    comm, op, compression
        See :class:`~theanompi.exchange.base.Exchanger`.
    node : int, optional
        This rank's node number (ranks with equal numbers form a node): tests simulate
        several nodes on one machine with it. Default: the ranks that share memory
        (``Split_type(COMM_TYPE_SHARED)``).
    poll_s : float
        A waiting rank's sleep between two progress calls
        (:func:`theanompi.exchange.polling.wait`: no core, no GIL).
    striped : bool
        Let every local rank exchange its chunk where nodes are equal (False: one leader).
    **kw
        The strategy's options.
    """

    name = "hierarchical"

    def __init__(
        self,
        strategy: str,
        comm: Any = None,
        op: str = "mean",
        compression: str = "none",
        node: int | None = None,
        poll_s: float = POLL_S,
        striped: bool = True,
        **kw: Any,
    ) -> None:
        from theanompi.exchange import STRATEGIES

        cls = STRATEGIES.get(strategy)  # one-line ConfigError before any collective
        from mpi4py import MPI

        super().__init__(comm, op, compression)
        self.strategy, self.poll_s = strategy, float(poll_s)
        wire = cls.wire_compression(compression)
        if self.size == 1:
            self.node_size, self.nodes, self._leaders = 1, 1, None
            self._inner: Exchanger | None = None
            return
        rank = self.rank
        if node is None:
            self._node = made(self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank))
        else:
            self._node = made(self.comm.Split(int(node), rank))
        self.local_rank, self.node_size = self._node.Get_rank(), self._node.Get_size()
        leader = self.local_rank == 0
        self.nodes = self.comm.allreduce(1 if leader else 0)
        self._max_node = self.comm.allreduce(self.node_size, op=MPI.MAX)
        if cls.requires_power_of_two and not is_power_of_two(self.nodes):
            self._node.Free()
            lower = 1 << (self.nodes.bit_length() - 1)
            raise ConfigError(
                f"exchanger {strategy!r} needs a power-of-2 number of ranks, got N={self.nodes} "
                f"node leaders ({self.size} ranks); use {lower} or {lower * 2} nodes, "
                f"weight_exchange.hierarchical: never, or strategy 'ar' (any N)"
            )
        equal = self.comm.allreduce(self.node_size, op=MPI.MIN) == self._max_node
        self.striped = bool(striped and equal and self._max_node > 1)
        color = self.local_rank if self.striped else (0 if leader else MPI.UNDEFINED)
        self._leaders = made(self.comm.Split(color, rank))  # striped: local rank j of every node
        self._inner = None
        if self.striped or leader:
            # the leaders wait asleep too: the node's other ranks share their cores
            inner_comm = PollingComm(self._leaders, round(self.poll_s * 1e6))
            self._inner = cls(comm=inner_comm, op="sum", compression=compression, **kw)
        # float16 carries values / N (no overflow); the mean divides there too
        self._pre = self.size if (op == "mean" or wire != "none") else 1
        self._post = np.float32(self.size if (op == "sum" and wire != "none") else 1)
        self._inner_bound = get_compressor(wire, self.nodes, "sum").error_bound(
            cls.wire_roundings(self.nodes)
        )
        self._shm: mmap.mmap | None = None

    def __repr__(self) -> str:
        return (
            f"HierarchicalExchanger(strategy={self.strategy!r}, op={self.op!r}, "
            f"size={self.size}, nodes={getattr(self, 'nodes', 1)}, "
            f"compression={self.compressor.name!r})"
        )

    def error_bound(self) -> tuple[float, float]:
        """The leaders' strategy's bound on the node sums (each ``sum |x_r|`` of the node,
        scaled), widened by the node reduce and the scaling: at most ``m + 2`` float32
        roundings for ``m`` ranks on the largest node."""
        if self.size == 1:
            return super().error_bound()
        rtol_i, atol_i = self._inner_bound
        m = self._max_node
        return (1 + rtol_i) * (1 + _gamma(m + 3, _U32)) - 1, atol_i * self.nodes + (
            m + 3
        ) * _F32_TINY

    def _prepare(self, arrays: list[np.ndarray]) -> None:
        if self.size == 1:
            return

        m, a = self.node_size, _ALIGN
        count = sum(x.size for x in arrays)
        # the same length on every node (the leaders exchange it), whatever the node's size
        self._slot = -(-count // a) * a
        self._chunk = -(-self._slot // (m * a)) * a  # elements each local rank sums
        self._offsets = np.cumsum([0] + [x.size for x in arrays]).tolist()
        self._free_shm()
        self._shm = _node_shared((m + 1) * self._slot * 4, self._node)
        shm = np.frombuffer(self._shm, np.float32)
        self._slots = shm[: m * self._slot].reshape(m, self._slot)
        self._result = shm[m * self._slot :]
        lo = min(self.local_rank * self._chunk, self._slot)
        self._mine = slice(lo, min(lo + self._chunk, self._slot))
        # stripes only where every local rank has one (tiny buffers: the leader does it all)
        self._stripes = self.striped and (m - 1) * self._chunk < self._slot
        if self._stripes:
            self._inner.prepare([self._result[self._mine]])
        elif self._inner is not None and self.local_rank == 0:
            self._inner.prepare([self._result])

    def _node_barrier(self) -> None:
        """Everything written to the shared buffer before is visible to the node after (the
        barrier's messages order the memory accesses on one machine)."""
        wait(self._node.Ibarrier(), round(self.poll_s * 1e6))

    def _exchange(self, arrays: list[np.ndarray]) -> None:
        mine, off = self._slots[self.local_rank], self._offsets
        for x, o0, o1 in zip(arrays, off[:-1], off[1:], strict=True):
            np.copyto(mine[o0:o1].reshape(x.shape), x)
        self._node_barrier()
        out = self._result[self._mine]
        np.add.reduce(self._slots[:, self._mine], axis=0, out=out)
        if self._pre != 1:
            np.divide(out, np.float32(self._pre), out=out)
        if self._stripes:  # each rank exchanges the chunk it summed, with its peers
            self._inner.exchange([out])
        else:
            self._node_barrier()
            if self.local_rank == 0:
                self._inner.exchange([self._result])
        self._node_barrier()  # ranks that wait for the network sleep here
        for x, o0, o1 in zip(arrays, off[:-1], off[1:], strict=True):
            src = self._result[o0:o1].reshape(x.shape)
            if self._post != 1:
                np.multiply(src, self._post, out=x)
            else:
                np.copyto(x, src)
        # no barrier here: the next step's first barrier keeps its reduce after every unpack

    def _free_shm(self) -> None:
        if self._shm is not None:
            self._slots = self._result = None  # type: ignore[assignment]
            self._shm.close()
            self._shm = None

    def close(self) -> None:
        """Unmap the shared buffer and free the private communicators (collective)."""
        if self.size == 1:
            return
        self._free_shm()
        for c in (getattr(self, "_leaders", None), getattr(self, "_node", None)):
            if c is not None and c != _comm_null():
                c.Free()
        self._leaders = self._node = None


def _node_shared(nbytes: int, node: Any) -> mmap.mmap:
    """``nbytes`` of memory shared by the ranks of ``node`` (collective): the node's first
    rank creates a file in ``/dev/shm``, every rank maps it, and it is unlinked once all have,
    so nothing is left behind whatever happens later. (An ``MPI.Win.Allocate_shared`` window
    would do the same, but the wheel's Open MPI prints an osc/ucx error for each one.)"""
    path = None
    if node.Get_rank() == 0:
        where = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        fd, path = tempfile.mkstemp(prefix="theanompi-hier-", dir=where)
        os.ftruncate(fd, nbytes)
        os.close(fd)
    path = node.bcast(path, root=0)
    fd = os.open(path, os.O_RDWR)
    try:
        buf = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    node.Barrier()
    if node.Get_rank() == 0:
        os.unlink(path)
    return buf


def _comm_null() -> Any:
    from mpi4py import MPI

    return MPI.COMM_NULL
