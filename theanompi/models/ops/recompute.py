"""The fused BatchNorm + ReLU output recomputed for the backward pass instead of kept.

A ``BatchNorm(relu=True)`` layer's output ``z`` is the next conv's input: its weight gradient
and the BN's own gradient (the ReLU mask ``z > 0``) read it in the backward pass, so every
such ``z`` of a train step stays alive from the forward pass to the backward one (ResNet-50
at b=32: 33 of them, about 520 MB). The BN's input ``x`` and its batch ``mean`` and
``invstd`` are kept anyway (its gradient reads them), and ``z`` follows from them in one pass
over memory (:class:`~theanompi.models.ops.batchnorm.BatchNormRecompute`, the training
kernel's own expression: the same bits). So ``recompute_batch_norm`` gives those backward
readers a recomputed ``z`` and leaves the forward pass's ``z`` to its forward readers, which
free it once the next layer has run, as PyTorch's and MXNet's memory-efficient BatchNorm do.

A reader of ``z`` belongs to the backward pass when it also reads something computed from
``z`` (a gradient: the loss depends on ``z``); the recompute takes those values as extra
inputs that it does not read, so PyTensor cannot run it before the backward pass reaches it.
One recompute serves every backward reader of a ``z``: it waits for what the readers read
after ``z``, but for what one of them computes (the BN's gradient reads the gradient that the
next layer's reader of ``z`` returns). Only for the C backend (``cxx_only``):
XLA plans its own memory.

What it saves depends on when the weight gradients run. PyTensor's C VM computes the updates
on demand in the order the forward graph meets the parameters, so most weight gradients, and
the recomputes they read, wait for the end of the backward pass: ResNet-50 b=32's peak RSS
3400 -> 3299 MB; 3083 -> 2582 MB where they run as the backward pass reaches them (the Python
``Stack`` VM; docs/performance.md).
"""

from __future__ import annotations

from typing import Any

from pytensor.compile import optdb
from pytensor.graph.fg import Output
from pytensor.graph.rewriting.basic import GraphRewriter

from theanompi.models.ops.batchnorm import BatchNormRecompute, BatchNormTrain

__all__ = ["RecomputeBatchNorm", "recompute_batch_norm"]


def _descendants(fgraph: Any, var: Any) -> set[Any]:
    """Every variable of ``fgraph`` computed from ``var``."""
    seen: set[Any] = set()
    todo = [var]
    while todo:
        for client, _ in fgraph.clients[todo.pop()]:
            for out in client.outputs:
                if out not in seen:
                    seen.add(out)
                    todo.append(out)
    return seen


class RecomputeBatchNorm(GraphRewriter):
    """Each fused BN + ReLU output's backward readers read a recompute of it instead."""

    def add_requirements(self, fgraph: Any) -> None:
        pass

    def apply(self, fgraph: Any) -> None:
        bns = [
            node
            for node in fgraph.apply_nodes
            if isinstance(node.op, BatchNormTrain) and node.op.relu
        ]
        for node in bns:
            z = node.outputs[0]
            later = _descendants(fgraph, z)
            readers = []  # (reader, its input position of z, the values it reads after z)
            for client, i in fgraph.clients[z]:
                if isinstance(client.op, Output):  # the function returns z: it stays
                    continue
                after = [v for j, v in enumerate(client.inputs) if j != i and v in later]
                if after:
                    readers.append((client, i, after))
            if not readers:
                continue
            # never what a reader computes: a reader would then wait for itself
            made = [o for r, _, _ in readers for o in r.outputs]
            theirs = set(made).union(*(_descendants(fgraph, o) for o in made))
            waits = list(dict.fromkeys(v for _, _, a in readers for v in a if v not in theirs))
            x, gamma, beta = node.inputs[:3]
            again = BatchNormRecompute(relu=True)(x, gamma, beta, *node.outputs[3:5], *waits)
            for client, i, _ in readers:
                fgraph.change_node_input(client, i, again, reason="recompute_batch_norm")


#: the rewrite, registered after the elementwise fusion (49) and before in-place Ops (49.5)
recompute_batch_norm = RecomputeBatchNorm()
optdb.register(
    "recompute_batch_norm", recompute_batch_norm, "fast_run", "cxx_only", "theanompi",
    position=49.2,
)  # fmt: skip
