"""Batch normalisation's training pass as one Op (numpy), with one gradient Op.

Written as PyTensor elementwise graphs, each BN layer's forward and backward pass is some
twenty nodes, and PyTensor's in-place and fusion rewrites grow quadratically with the graph:
ResNet-50's train function took ~100 s to rewrite. As two Ops per layer it is two nodes.
With ``xhat = (x - mean) * invstd`` over the ``N = b*H*W`` values of a channel::

    y  = gamma * xhat + beta
    dx = gamma * invstd / N * (N * dy - sum(dy) - xhat * sum(dy * xhat))

The running statistics are inputs and their new values outputs (the train function's
updates), without a gradient: the loss reaches ``x`` through ``y`` only. Evaluation is one
more Op, :class:`BatchNormInfer`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytensor.tensor as pt
from pytensor.gradient import DisconnectedType, grad_not_implemented
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

__all__ = [
    "BatchNormTrain",
    "BatchNormTrainGrad",
    "BatchNormInfer",
    "batch_norm_train",
    "batch_norm_infer",
]


def _axes(ndim: int) -> tuple[int, ...]:
    return (0, *range(2, ndim))


def _bc(v: np.ndarray, ndim: int) -> np.ndarray:
    return v.reshape((1, -1) + (1,) * (ndim - 2))


class BatchNormTrain(Op):
    """``x (b, C, ...), gamma, beta, running_mean, running_var (C,) -> y, new running_mean,
    new running_var, mean, invstd``: the batch's mean and biased variance normalise ``x``;
    the running statistics move by ``momentum`` towards the batch's mean and biased
    variance (Lasagne's convention; PyTorch's running variance is the unbiased one, larger by
    ``N / (N - 1)``, 0.06 % for ResNet-50's smallest maps at batch 32).

    >>> x, g, b, m, v = pt.tensor4("x"), *(pt.vector(n) for n in "gbmv")
    >>> y, new_m, new_v, mean, invstd = BatchNormTrain(1e-5, 0.1)(x, g, b, m, v)
    >>> y.ndim, new_m.ndim
    (4, 1)
    """

    __props__ = ("eps", "momentum")

    def __init__(self, eps: float = 1e-5, momentum: float = 0.1) -> None:
        if not eps > 0 or not 0 < momentum <= 1:
            raise ValueError(
                f"batch norm: need eps > 0 and momentum in (0, 1]; got eps={eps!r}, "
                f"momentum={momentum!r}"
            )
        self.eps, self.momentum = float(eps), float(momentum)

    def make_node(self, x: Any, gamma: Any, beta: Any, rmean: Any, rvar: Any) -> Apply:
        x, *vecs = (pt.as_tensor_variable(v) for v in (x, gamma, beta, rmean, rvar))
        if x.ndim < 2 or any(v.ndim != 1 for v in vecs):
            raise TypeError(
                f"batch norm: want x (b, C, ...) and 1-d gamma, beta, running mean and var; "
                f"got {x.type}, {[str(v.type) for v in vecs]}"
            )
        vec = pt.tensor(dtype=x.dtype, shape=(x.type.shape[1],)).type
        return Apply(self, [x, *vecs], [x.type(), vec(), vec(), vec(), vec()])

    def perform(self, node: Any, inputs: Any, outputs: Any) -> None:
        x, gamma, beta, rmean, rvar = inputs
        axes, nd = _axes(x.ndim), x.ndim
        mean = x.mean(axis=axes)
        xc = x - _bc(mean, nd)
        var = np.square(xc).mean(axis=axes)
        invstd = 1.0 / np.sqrt(var + np.asarray(self.eps, var.dtype))
        xc *= _bc(gamma * invstd, nd)
        xc += _bc(beta, nd)
        m = self.momentum
        new_mean = (1 - m) * rmean + m * mean
        new_var = (1 - m) * rvar + m * var
        for slot, val in zip(outputs, (xc, new_mean, new_var, mean, invstd), strict=True):
            slot[0] = np.asarray(val, dtype=x.dtype)

    def infer_shape(self, fgraph: Any, node: Any, shapes: Any) -> list[tuple[Any, ...]]:
        c = (shapes[0][1],)
        return [shapes[0], c, c, c, c]

    def connection_pattern(self, node: Any) -> list[list[bool]]:
        # the statistics feed the running averages, not the loss: no gradient through them
        return [[True, False, False, False, False]] * 3 + [[False] * 5] * 2

    def pullback(self, inputs: Any, outputs: Any, cotangents: Any) -> list[Any]:
        x, gamma, _, rmean, rvar = inputs
        gy = cotangents[0]
        if isinstance(gy.type, DisconnectedType):
            gy = pt.zeros_like(outputs[0])
        dx, dgamma, dbeta = BatchNormTrainGrad()(x, gamma, outputs[3], outputs[4], gy)
        return [dx, dgamma, dbeta, DisconnectedType()(), DisconnectedType()()]


class BatchNormInfer(Op):
    """``x, gamma, beta, running_mean, running_var -> y``: evaluation with the running
    statistics, ``y = gamma * (x - running_mean) / sqrt(running_var + eps) + beta``."""

    __props__ = ("eps",)

    def __init__(self, eps: float = 1e-5) -> None:
        self.eps = float(eps)

    def make_node(self, x: Any, gamma: Any, beta: Any, rmean: Any, rvar: Any) -> Apply:
        ins = [pt.as_tensor_variable(v) for v in (x, gamma, beta, rmean, rvar)]
        return Apply(self, ins, [ins[0].type()])

    def perform(self, node: Any, inputs: Any, outputs: Any) -> None:
        x, gamma, beta, rmean, rvar = inputs
        scale = gamma / np.sqrt(rvar + np.asarray(self.eps, rvar.dtype))
        y = x * _bc(scale.astype(x.dtype), x.ndim)
        y += _bc((beta - rmean * scale).astype(x.dtype), x.ndim)
        outputs[0][0] = y

    def infer_shape(self, fgraph: Any, node: Any, shapes: Any) -> list[tuple[Any, ...]]:
        return [shapes[0]]

    def pullback(self, inputs: Any, outputs: Any, cotangents: Any) -> list[Any]:
        x, gamma, _, rmean, rvar = inputs
        (gy,) = cotangents
        pattern = ["x", 0, *(["x"] * (x.ndim - 2))]
        axes = _axes(x.ndim)
        inv = 1.0 / pt.sqrt(rvar + np.asarray(self.eps, rvar.dtype))
        sum_gy = gy.sum(axis=axes)
        sum_gyxc = (gy * (x - rmean.dimshuffle(*pattern))).sum(axis=axes)
        return [
            gy * (gamma * inv).dimshuffle(*pattern),
            sum_gyxc * inv,
            sum_gy,
            -gamma * inv * sum_gy,
            -0.5 * gamma * inv**3 * sum_gyxc,
        ]


class BatchNormTrainGrad(Op):
    """``x, gamma, mean, invstd, dy -> dx, dgamma, dbeta`` of :class:`BatchNormTrain`."""

    __props__ = ()

    def make_node(self, x: Any, gamma: Any, mean: Any, invstd: Any, gy: Any) -> Apply:
        ins = [pt.as_tensor_variable(v) for v in (x, gamma, mean, invstd, gy)]
        return Apply(self, ins, [ins[0].type(), ins[1].type(), ins[1].type()])

    def perform(self, node: Any, inputs: Any, outputs: Any) -> None:
        x, gamma, mean, invstd, gy = inputs
        axes, nd = _axes(x.ndim), x.ndim
        n = x.size // x.shape[1]
        xhat = x - _bc(mean, nd)
        xhat *= _bc(invstd, nd)
        dbeta = gy.sum(axis=axes)
        dgamma = (gy * xhat).sum(axis=axes)
        xhat *= _bc(dgamma, nd)
        dx = gy * np.asarray(n, x.dtype)
        dx -= _bc(dbeta, nd)
        dx -= xhat
        dx *= _bc(gamma * invstd / np.asarray(n, x.dtype), nd)
        for slot, val in zip(outputs, (dx, dgamma, dbeta), strict=True):
            slot[0] = np.asarray(val, dtype=x.dtype)

    def infer_shape(self, fgraph: Any, node: Any, shapes: Any) -> list[tuple[Any, ...]]:
        return [shapes[0], shapes[1], shapes[1]]

    def pullback(self, inputs: Any, outputs: Any, cotangents: Any) -> list[Any]:
        return [grad_not_implemented(self, i, v) for i, v in enumerate(inputs)]


def batch_norm_train(
    x: Any, gamma: Any, beta: Any, rmean: Any, rvar: Any, eps: float = 1e-5, momentum: float = 0.1
) -> list[Any]:
    """Symbolic ``[y, new_running_mean, new_running_var, mean, invstd]`` of a training pass."""
    return BatchNormTrain(eps, momentum)(x, gamma, beta, rmean, rvar)


def batch_norm_infer(
    x: Any, gamma: Any, beta: Any, rmean: Any, rvar: Any, eps: float = 1e-5
) -> Any:
    """Symbolic ``y`` of an evaluation pass with the running statistics."""
    return BatchNormInfer(eps)(x, gamma, beta, rmean, rvar)
