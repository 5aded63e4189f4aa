"""Graph rewrites registered in PyTensor's own database, so every function compiled after
``import theanompi.models`` gets them: ours, and the user's models too.

``fuse_conv_relu``: a ReLU layer after a conv (``v * (v > 0)``, and in the backward pass the
gradient times the same mask ``v > 0``) becomes the conv with its ``relu`` flag, which
rectifies each chunk while it is in cache, and the mask reads the rectified output; the
separate rectifier pass over the conv's output and its bool mask are gone.

``mask_before_unpool``: the ReLU's gradient mask after a max pool's gradient,
``unpool(gz) * (x > 0)``, is applied to the pooled gradient instead, ``unpool(gz * (pooled >
0))``: a window's gradient goes to its maximum, which is the pooled value, so the mask there is
the same bool, and it is computed on the pooled size (a quarter for 2x2 windows).

``inline_softmax``: PyTensor 3 builds ``softmax`` and ``log_softmax`` as ``SymbolicOp`` s that
are not inlined, so each runs as a Python ``perform`` calling a compiled inner function: about
1-2 ms a call whatever the batch, 6 % of a small CNN's step at b=32 (``profile=True``). In the
``specialize`` phase (after ``stabilize`` has used them to recognise ``log(softmax(x))``) they
are replaced by their inner graphs, which the C ``Elemwise`` fusion then compiles.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytensor.scalar as ps
import pytensor.tensor as pt
from pytensor.graph import node_rewriter
from pytensor.tensor.basic import get_underlying_scalar_constant_value
from pytensor.tensor.elemwise import Elemwise
from pytensor.tensor.exceptions import NotScalarConstantError
from pytensor.tensor.rewriting.basic import register_specialize
from pytensor.tensor.rewriting.ofg import inline_ofg_node
from pytensor.tensor.special import LogSoftmax, Softmax

from theanompi.models.ops.conv import Conv2d
from theanompi.models.ops.pool import Pool2d, Pool2dGrad

__all__ = ["fuse_conv_relu", "inline_softmax", "mask_before_unpool"]


@register_specialize("theanompi")
@node_rewriter([Softmax, LogSoftmax])
def inline_softmax(fgraph: Any, node: Any) -> Any:
    """Replace a ``Softmax``/``LogSoftmax`` node by its inner graph."""
    return inline_ofg_node(node)


def _is_positive_mask(node: Any, v: Any) -> bool:
    """Whether ``node`` is ``v > 0`` (an Elemwise GT of ``v`` and a zero constant)."""
    if not (isinstance(node.op, Elemwise) and isinstance(node.op.scalar_op, ps.GT)):
        return False
    if node.inputs[0] is not v:
        return False
    try:
        return get_underlying_scalar_constant_value(node.inputs[1]) == 0
    except NotScalarConstantError:
        return False


def _is_product_of_two(node: Any) -> bool:
    """Whether ``node`` is an Elemwise multiplication of exactly two inputs."""
    return (
        isinstance(node.op, Elemwise)
        and isinstance(node.op.scalar_op, ps.Mul)
        and len(node.inputs) == 2
    )


def _relu_input(node: Any) -> Any:
    """``v`` when ``node`` is the ReLU ``v * (v > 0)`` (in either order), else None."""
    if not _is_product_of_two(node):
        return None
    for v, mask in (node.inputs, node.inputs[::-1]):
        if mask.owner is not None and _is_positive_mask(mask.owner, v):
            return v
    return None


@register_specialize("theanompi")
@node_rewriter([Conv2d])
def fuse_conv_relu(fgraph: Any, node: Any) -> Any:
    """``v * (v > 0)`` of a conv's output ``v`` -> the conv with ``relu``; every other use of
    ``v`` must be that mask ``v > 0`` (the ReLU's gradient), which then reads the rectified
    output (the same bools, NaN included)."""
    if node.op.relu:
        return None
    (v,) = node.outputs
    masks, relus = [], []
    for client, _ in fgraph.clients[v]:
        if _is_positive_mask(client, v):
            masks.append(client.outputs[0])
        elif _relu_input(client) is v:
            relus.append(client.outputs[0])
        else:
            return None
    if not relus:
        return None
    y = Conv2d(**node.op.geometry, relu=True)(*node.inputs)
    zero = np.asarray(0, dtype=y.dtype)
    return {**{r: y for r in relus}, **{m: pt.gt(y, zero) for m in masks}}


def _masks_positive(node: Any, x: Any) -> bool:
    """Whether ``node`` is ``x > 0``, or ``v > 0`` where ``x`` is the ReLU ``v * (v > 0)``
    built on that very mask."""
    if _is_positive_mask(node, x):
        return True
    relu = x.owner
    return (
        relu is not None and node.outputs[0] in relu.inputs and _relu_input(relu) is node.inputs[0]
    )


@register_specialize("theanompi")
@node_rewriter([Elemwise])
def mask_before_unpool(fgraph: Any, node: Any) -> Any:
    """``Pool2dGrad_max(x, gz, argmax) * (x > 0)`` -> ``Pool2dGrad_max(x, gz * (pooled > 0),
    argmax)``; every window that scatters to a position has that position's value as its
    pooled maximum, so both masks agree wherever a gradient lands."""
    if not _is_product_of_two(node):
        return None
    for grad, mask in (node.inputs, node.inputs[::-1]):
        unpool = grad.owner
        if unpool is None or not isinstance(unpool.op, Pool2dGrad) or not unpool.op.is_max:
            continue
        x, gz, argmax = unpool.inputs
        pool = argmax.owner
        if mask.owner is None or not _masks_positive(mask.owner, x):
            continue
        if pool is None or not isinstance(pool.op, Pool2d) or pool.outputs[1] is not argmax:
            continue
        zero = np.asarray(0, dtype=gz.dtype)
        new = unpool.op(x, gz * pt.gt(pool.outputs[0], zero), argmax)
        return [new] if new.type == node.outputs[0].type else None
    return None
