"""Concatenation along the channel axis (GoogLeNet's inception output) with static shapes.

PyTensor's ``Join`` takes its axis as a symbolic input, so its shape inference builds a
``switch(axis == d, sum of sizes, size)`` per dimension; chained inception modules nest these
switches, and graph rewriting of a GoogLeNet then takes many minutes. This Op fixes the axis
to 1: the output's batch size is the first input's, every other size is static arithmetic,
and the gradient is one slice per input.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

__all__ = ["ChannelConcat", "concat_channels"]


class ChannelConcat(Op):
    """``(b, C_i, H, W)... -> (b, sum C_i, H, W)``; every input needs a static channel count.

    >>> concat_channels([pt.tensor4(shape=(None, 2, 3, 3)), pt.tensor4(shape=(None, 5, 3, 3))]).type.shape
    (None, 7, 3, 3)
    """

    __props__ = ()

    def make_node(self, *xs: Any) -> Apply:
        xs = [pt.as_tensor_variable(x) for x in xs]
        if not xs or any(x.ndim != 4 or x.dtype != xs[0].dtype for x in xs):
            raise TypeError("concat_channels: want 4-d tensors of one dtype")
        if any(x.type.shape[1] is None for x in xs):
            raise TypeError("concat_channels: every input needs a static channel count")
        rest = [
            next((x.type.shape[d] for x in xs if x.type.shape[d] is not None), None)
            for d in (0, 2, 3)
        ]
        c = sum(x.type.shape[1] for x in xs)
        out = pt.tensor(dtype=xs[0].dtype, shape=(rest[0], c, rest[1], rest[2]))
        return Apply(self, xs, [out])

    def perform(self, node: Any, inputs: Any, outputs: Any) -> None:
        outputs[0][0] = np.concatenate(inputs, axis=1)

    def infer_shape(self, fgraph: Any, node: Any, shapes: Any) -> list[tuple[Any, ...]]:
        b, _, h, w = shapes[0]
        return [(b, node.outputs[0].type.shape[1], h, w)]

    def pullback(self, inputs: Any, outputs: Any, cotangents: Any) -> list[Any]:
        (gz,) = cotangents
        grads, start = [], 0
        for x in inputs:
            c = x.type.shape[1]
            grads.append(gz[:, start : start + c])
            start += c
        return grads


def concat_channels(xs: list[Any]) -> Any:
    """Symbolic concatenation of 4-d tensors along the channel axis."""
    return xs[0] if len(xs) == 1 else ChannelConcat()(*xs)
