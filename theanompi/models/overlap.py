"""The gradient step compiled so that each bucket of gradients leaves as soon as it exists.

:class:`BucketReady` is an Op whose inputs are one bucket's gradients; running it hands them
to a callback (the exchange's ``start``). :func:`bucket_schedule` orders the graph so that
each bucket's Op runs right after the last of its gradients is computed, bucket 0 (the last
layers) first, and everything the later buckets do not need comes after; PyTensor's default
order can leave a bucket's Op to the end of the step. The function runs in the Python VM loop
(``use_cloop=False``), between whose Ops the communication thread can take the GIL.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import pytensor.tensor as pt
from pytensor.compile.mode import Mode, get_default_mode
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

__all__ = ["BucketReady", "bucket_schedule", "demand_order", "overlap_mode"]


class BucketReady(Op):
    """``BucketReady(k, sink)(*grads)``: calls ``sink(k, values)``; outputs a dummy int8
    (make it an output of the function so the Op is kept)."""

    __props__ = ("k", "sink_id")

    def __init__(self, k: int, sink: Callable[[int, Sequence[np.ndarray]], None]) -> None:
        self.k, self.sink, self.sink_id = k, sink, id(sink)

    def make_node(self, *grads: Any) -> Apply:
        return Apply(self, [pt.as_tensor_variable(g) for g in grads], [pt.bscalar()])

    def perform(self, node: Apply, inputs: Sequence[np.ndarray], output_storage: Any) -> None:
        self.sink(self.k, inputs)
        output_storage[0][0] = np.int8(self.k % 128)


def demand_order(
    roots: Iterable[Apply], before: Callable[[Apply], Iterable[Apply | None]]
) -> list[Apply]:
    """Every node that ``roots`` need, in the order a run computing the roots on demand takes:
    depth first, each node once, after the nodes ``before(node)`` names (in that order; None
    skipped). Iterative: graphs can be deep."""
    seen: set[Apply] = set()
    order: list[Apply] = []
    for root in roots:
        stack = [(root, False)]
        while stack:
            node, ready = stack.pop()
            if node in seen:
                continue
            if ready:
                seen.add(node)
                order.append(node)
                continue
            stack.append((node, True))
            stack.extend(
                (p, False) for p in reversed(list(before(node))) if p is not None and p not in seen
            )
    return order


def bucket_schedule(fgraph: Any) -> list[Apply]:
    """A topological order of ``fgraph`` (its destroy orderings respected) in which bucket
    ``k``'s :class:`BucketReady` runs as early as possible, in bucket order."""
    orderings = fgraph.orderings()
    marks = [n for n in fgraph.apply_nodes if isinstance(n.op, BucketReady)]
    return demand_order(
        [*sorted(marks, key=lambda n: n.op.k), *fgraph.toposort()],
        lambda node: [*(i.owner for i in node.inputs), *orderings.get(node, ())],
    )


def overlap_mode(mode: Mode | None) -> Mode:
    """``mode``'s rewrites (default: the configured mode's) with the Python VM loop and
    :func:`bucket_schedule`."""
    from theanompi.models.ops._parallel import ParallelCVMLinker

    mode = get_default_mode() if mode is None else mode
    linker = ParallelCVMLinker(use_cloop=False, schedule=bucket_schedule)
    return Mode(linker=linker, optimizer=mode.provided_optimizer)
