"""ZeRO-1 for BSP ``cdd``: each rank keeps the optimiser state of its 1/N of the parameters.

One step on rank r of N (DeepSpeed's ZeRO stage 1, PyTorch's ``ZeroRedundancyOptimizer``):
the gradients, packed into one fusion buffer, go through ``asa``'s first half (``Alltoall``
and the float32 sum of the N chunks, float16 on the wire under ``asa16``/``fp16``: a
reduce-scatter), so that rank r holds the mean gradient of chunk r alone; rank r applies the
optimiser's update to chunk r of the parameters with its chunk of the state; the new
parameters, float32, are all-gathered. The wire carries what ``asa32`` carries (an
``Alltoall`` and an ``Allgather`` of the fused buffer; ``asa16``'s ``Allgather`` becomes
float32: parameters are never rounded); the optimiser's state and update work are divided by N.

The update is the optimiser's own compiled graph (:meth:`~theanompi.models.optim.Optimizer.over`
the chunk's pieces of parameters, tagged as their parameters), so each element gets the bits an
unsharded step gives it. LARS's layer norms sum the float32 squares in float64 (its own graph
does too), piece by piece and then over the ranks, and round once: the same float32 norms.

The model's state variables hold the whole state only where it is read whole: they are emptied
once this rank has taken its chunk, and :meth:`ShardedUpdate.whole_state` gathers it on rank 0
while a checkpoint is written, so that checkpoints are an unsharded run's (a sharded run
resumes unsharded, on another N, and the other way).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from theanompi.errors import ConfigError
from theanompi.exchange._fusion import FusionBuffer
from theanompi.exchange.compression import COMPRESSORS
from theanompi.models.ops import c_mode
from theanompi.models.optim import OPTIMIZERS, param_tags
from theanompi.models.params import get_values

__all__ = ["ShardedUpdate", "sharding_strategies"]


def sharding_strategies() -> list[str]:
    """The strategies a sharded step can stand in for (their ``reduces_by_chunks``)."""
    from theanompi.exchange import STRATEGIES

    return [s for s in STRATEGIES if STRATEGIES.get(s).reduces_by_chunks]


def _emptied(var: Any) -> None:
    """Free a state variable's values (a zero-size array of its rank)."""
    old = var.get_value(borrow=True)
    var.set_value(np.zeros((0,) * old.ndim, old.dtype), borrow=True)


class ShardedUpdate:
    """The reduce-scatter, the update of this rank's chunk and the all-gather of one step.

    Built once every rank holds the start values (a checkpoint's whole state included): it
    takes this rank's chunk of the optimiser's state and empties its whole variables.

    Parameters
    ----------
    optimizer
        A built-in optimiser (:data:`~theanompi.models.optim.OPTIMIZERS`): its ``params``,
        ``lr`` and state variables.
    grads
        The gradient variables, one per parameter (what the backward pass wrote).
    comm
        The workers' communicator.
    strategy, compression
        The exchange the sharded step stands in for (one that reduces by chunks:
        :func:`sharding_strategies`), and what goes on the wire (asa16 implies ``fp16``).
    """

    def __init__(
        self, optimizer: Any, grads: list[Any], comm: Any, strategy: str, compression: str
    ) -> None:
        import pytensor

        from theanompi.exchange import STRATEGIES

        if strategy not in sharding_strategies():
            raise ConfigError(
                f"shard_optimizer needs a strategy that reduces by chunks "
                f"({', '.join(sharding_strategies())}), not {strategy!r}"
            )
        wire = STRATEGIES.get(strategy).wire_compression(compression)

        if type(optimizer) not in [OPTIMIZERS.get(name) for name in OPTIMIZERS]:
            raise ConfigError(
                f"shard_optimizer: {type(optimizer).__name__} is not one of the optimizers "
                f"that shard ({', '.join(OPTIMIZERS)}); set shard_optimizer: false"
            )
        self.opt, self.grads, self.comm = optimizer, list(grads), comm
        self.n, self.rank = comm.Get_size(), comm.Get_rank()
        values = get_values(optimizer.params)
        self.shapes = [v.shape for v in values]
        self.wire = COMPRESSORS.get(wire)(size=self.n, op="mean")
        self.fusion = FusionBuffer([v.size for v in values], self.n, self.wire.wire_dtype)
        self._recv = np.empty_like(self.fusion.buffer)
        self.chunk = self.fusion.padded_count // self.n
        # float32 on the wire: after the sum, the receive buffer holds this chunk's mean
        # gradient and the fusion buffer the parameters (no more memory than asa32's own)
        float_wire = self.fusion.buffer.dtype == np.float32
        self._params = self.fusion if float_wire else FusionBuffer([v.size for v in values], self.n)
        self.grad = self._recv[: self.chunk] if float_wire else np.zeros(self.chunk, np.float32)
        lo = self.rank * self.chunk
        # (param i, its elements [a, b), which are this chunk's [a + at, b + at))
        self.spans = [
            (i, max(lo, off) - off, min(lo + self.chunk, off + size) - off, off - lo)
            for i, (off, size) in enumerate(
                zip(self.fusion.offsets, self.fusion.sizes, strict=True)
            )
            if off < lo + self.chunk and off + size > lo
        ]
        self.pieces, self.piece_grads = [], []
        for i, a, b, _ in self.spans:
            p = optimizer.params[i]
            piece = pytensor.shared(np.zeros(b - a, np.float32), name=f"{p.name}[{a}:{b}]")
            piece.tag.regularizable, piece.tag.lr_mult = param_tags(p)
            self.pieces.append(piece)
            self.piece_grads.append(pytensor.shared(np.zeros(b - a, np.float32)))
        self.shard = optimizer.over(self.pieces)  # its state: this rank's chunk of the state
        self._norms = self._lars_norms()
        self._update = pytensor.function(
            [],
            [],
            updates=self.shard.updates(self.piece_grads),
            name="ShardedUpdate",
            mode=c_mode(),
        )
        self._take(optimizer)

    def _lars_norms(self) -> list[tuple[Any, Any]]:
        """LARS: the norms of each piece's whole parameter, filled in before each update."""
        if not hasattr(self.shard, "norms"):
            return []
        import pytensor

        out = []
        for piece in self.pieces:
            pair = tuple(pytensor.shared(np.float32(0)) for _ in range(2))
            self.shard.norms[piece] = pair
            out.append(pair)
        return out

    def _scalars(self, opt: Any) -> list[Any]:
        """The state variables no parameter shapes (Adam's step count): every rank keeps them."""
        shaped = {id(v) for i in range(len(opt.params)) for v in opt.slots(i)}
        return [v for v in opt.state if id(v) not in shaped]

    def _take(self, opt: Any) -> None:
        """This rank's chunk of ``opt``'s whole state into the shard's; ``opt``'s emptied."""
        for k, (i, a, b, _) in enumerate(self.spans):
            for mine, whole in zip(self.shard.slots(k), opt.slots(i), strict=True):
                mine.set_value(np.array(whole.get_value(borrow=True).reshape(-1)[a:b]))
        for mine, whole in zip(self._scalars(self.shard), self._scalars(opt), strict=True):
            mine.set_value(np.array(whole.get_value()))
        self._empty_whole()

    def _empty_whole(self) -> None:
        for i in range(len(self.shapes)):
            for var in self.opt.slots(i):
                _emptied(var)

    def step(self) -> None:
        """Collective: the mean gradient of this chunk, its update, the new parameters everywhere."""
        from mpi4py import MPI

        fb, wire, n = self.fusion, self.wire, self.n
        fb.pack(get_values(self.grads), wire)
        self.comm.Alltoall(fb.buffer, self._recv)
        mine = fb.chunk(self.rank, n)
        wire.sum_rows(self._recv.reshape(n, -1), mine)
        wire.decompress(mine, self.grad)
        params = get_values(self.opt.params)
        out = self._params.chunk(self.rank, n)  # this chunk's parameters, updated in place
        for (i, a, b, at), piece, g in zip(self.spans, self.pieces, self.piece_grads, strict=True):
            np.copyto(out[a + at : b + at], params[i].reshape(-1)[a:b])
            piece.set_value(out[a + at : b + at], borrow=True)
            g.set_value(self.grad[a + at : b + at], borrow=True)
        if self._norms:
            self._set_norms()
        self._update()
        for (_, a, b, at), piece in zip(self.spans, self.pieces, strict=True):
            new = piece.get_value(borrow=True)  # the update may have written a new array
            if not np.shares_memory(new, out):
                out[a + at : b + at] = new
        self.comm.Allgather(MPI.IN_PLACE, self._params.buffer)
        self._params.unpack(params)

    def _set_norms(self) -> None:
        """Each LARS piece's ``||w||`` and ``||g||`` of its whole parameter: squares summed
        piece by piece, then over the ranks (one ``Allreduce`` of two per parameter)."""
        from mpi4py import MPI

        m = len(self.shapes)
        sums = np.zeros(2 * m)
        for (i, *_), piece, g in zip(self.spans, self.pieces, self.piece_grads, strict=True):
            for at, x in ((i, piece.get_value(borrow=True)), (m + i, g.get_value(borrow=True))):
                sums[at] += np.sum(np.square(x), dtype=np.float64)  # as LARS's own: float32
        self.comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)  # squares, float64 sums
        for (i, *_), (w_norm, g_norm) in zip(self.spans, self._norms, strict=True):
            w_norm.set_value(np.float32(np.sqrt(sums[i])))
            g_norm.set_value(np.float32(np.sqrt(sums[m + i])))

    @contextlib.contextmanager
    def whole_state(self) -> Iterator[None]:
        """Collective context: the optimiser's state variables hold the whole state on rank 0
        (gathered from every rank's chunk), emptied again after it.

        Between steps the exchange's buffers are free: rank 0 gathers into them (asa32's two
        hold Adam's two slots), so writing a checkpoint costs it no memory the step did not."""
        layout = FusionBuffer([int(np.prod(s)) for s in self.shapes], self.n)
        spare = (
            [self.fusion.buffer, self._recv]
            if self._params is self.fusion
            else [self._params.buffer]
        )
        chunk = np.zeros(self.chunk, np.float32)
        for j in range(len(self.opt.slots(0))):
            for k, (_, a, b, at) in enumerate(self.spans):
                chunk[a + at : b + at] = self.shard.slots(k)[j].get_value(borrow=True)
            into = spare[j] if j < len(spare) else np.empty(layout.padded_count, np.float32)
            self.comm.Gather(chunk, into if self.rank == 0 else None, root=0)
            if self.rank == 0:
                for i, shape in enumerate(self.shapes):
                    off, size = layout.offsets[i], layout.sizes[i]
                    self.opt.slots(i)[j].set_value(
                        into[off : off + size].reshape(shape), borrow=True
                    )
        for mine, whole in zip(self._scalars(self.shard), self._scalars(self.opt), strict=True):
            whole.set_value(np.array(mine.get_value()))
        try:
            yield
        finally:
            if self.rank == 0:
                self._empty_whole()
