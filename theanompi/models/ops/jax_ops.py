"""JAX implementations of our Ops (``jax_funcify`` registrations), so ``mode="JAX"`` compiles them.

Imported by :func:`theanompi.models.ops.compile_mode` only (``jax`` is an optional extra).
Each function follows the C Op's maths: conv is a zero-padded cross-correlation
(``lax.conv_general_dilated``, one per group) and its gradients are the transposes of that
linear map; pooling uses Caffe's ceil mode, never counts padding, and sends a max window's
gradient to its first maximum in row-major order through the int32 argmax output; LRN uses
Caffe's ``alpha/n``; batch norm is :mod:`~theanompi.models.ops.batchnorm`'s maths in ``jnp``. Shapes a gradient Op receives as an input (the filter or input (h, w))
must be static. It also widens PyTensor's ``ARange`` conversion, which refuses a shape
wrapped in a broadcast ``Assert`` (the metrics' ``arange(n_classes)``) although JAX sees a
concrete int there.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from pytensor.graph.basic import Constant
from pytensor.link.jax.dispatch import jax_funcify
from pytensor.tensor.basic import ARange

from theanompi.models.ops.batchnorm import BatchNormInfer, BatchNormTrain, BatchNormTrainGrad, _axes
from theanompi.models.ops.concat import ChannelConcat
from theanompi.models.ops.conv import Conv2d, Conv2dGradInputs, Conv2dGradWeights
from theanompi.models.ops.lrn import LRNGrad, LRNOp
from theanompi.models.ops.pool import Pool2d, Pool2dGrad

__all__ = ["conv_forward", "pool_forward", "lrn_forward", "lrn_backward"]


# -- convolution ------------------------------------------------------------------------------
def conv_forward(x: Any, w: Any, stride: tuple[int, int], pad: tuple[int, int], groups: int) -> Any:
    """Cross-correlation of ``x`` (b, C, H, W) with ``w`` (F, C/G, kh, kw), zero padded.

    Groups run as ``groups`` separate convolutions, concatenated: XLA's CPU gradients of a
    grouped convolution (``feature_group_count``) are ~5x slower than of the split ones
    (AlexNet conv2, b=32: 9.3 s vs 1.8 s per forward + backward).
    """

    def one(xg: Any, wg: Any) -> Any:
        return lax.conv_general_dilated(
            xg,
            wg,
            window_strides=stride,
            padding=[(pad[0], pad[0]), (pad[1], pad[1])],
            dimension_numbers=("NCHW", "OIHW", "NCHW"),
            precision=lax.Precision.HIGHEST,
        )

    if groups == 1:
        return one(x, w)
    xs, ws = jnp.split(x, groups, axis=1), jnp.split(w, groups, axis=0)
    return jnp.concatenate([one(a, b) for a, b in zip(xs, ws, strict=True)], axis=1)


def _static_hw(node: Any, out_hw: tuple[Any, Any], what: str) -> tuple[int, int]:
    """The (h, w) a gradient Op produces: from its output type, else from its constant input."""
    if None not in out_hw:
        return int(out_hw[0]), int(out_hw[1])
    data = getattr(node.inputs[2], "data", None)
    if data is None:
        raise NotImplementedError(
            f"{type(node.op).__name__} under JAX needs a static {what} (h, w); give the model "
            "input a static (C, H, W)"
        )
    return int(data[0]), int(data[1])


def _geom(op: Any) -> tuple[tuple[int, int], tuple[int, int], int]:
    return (op.sh, op.sw), (op.ph, op.pw), op.groups


@jax_funcify.register(Conv2d)
def _jax_conv2d(op: Conv2d, node: Any = None, **kwargs: Any) -> Any:
    stride, pad, groups = _geom(op)
    relu = bool(op.relu)

    def conv2d(x: Any, w: Any, b: Any = None) -> Any:
        out = conv_forward(x, w, stride, pad, groups)
        out = out if b is None else out + b[None, :, None, None]
        return out * (out > 0) if relu else out

    return conv2d


@jax_funcify.register(Conv2dGradWeights)
def _jax_conv2d_grad_weights(op: Conv2dGradWeights, node: Any = None, **kwargs: Any) -> Any:
    stride, pad, groups = _geom(op)
    kh, kw = _static_hw(node, node.outputs[0].type.shape[2:], "filter")

    def conv2d_grad_weights(x: Any, gz: Any, kshape: Any = None) -> Any:
        w0 = jnp.zeros((gz.shape[1], x.shape[1] // groups, kh, kw), dtype=x.dtype)
        _, vjp = jax.vjp(lambda w: conv_forward(x, w, stride, pad, groups), w0)
        return vjp(gz)[0], gz.sum(axis=(0, 2, 3))

    return conv2d_grad_weights


@jax_funcify.register(Conv2dGradInputs)
def _jax_conv2d_grad_inputs(op: Conv2dGradInputs, node: Any = None, **kwargs: Any) -> Any:
    stride, pad, groups = _geom(op)
    h, w = _static_hw(node, node.outputs[0].type.shape[2:], "input")

    def conv2d_grad_inputs(wt: Any, gz: Any, ishape: Any = None) -> Any:
        x0 = jnp.zeros((gz.shape[0], wt.shape[1] * groups, h, w), dtype=wt.dtype)
        _, vjp = jax.vjp(lambda x: conv_forward(x, wt, stride, pad, groups), x0)
        return vjp(gz)[0]

    return conv2d_grad_inputs


# -- pooling ----------------------------------------------------------------------------------
def _pool_windows(op: Any, x: Any, fill: float) -> tuple[list[Any], int, int]:
    """The ``kh*kw`` (b, C, Ho, Wo) slices of ``x`` padded with ``fill``, one per window
    offset in row-major order (XLA fuses the loops over them; no patch tensor is stored)."""
    h, w = x.shape[2], x.shape[3]
    ho, wo = op.out_hw(h, w)
    hi_h = (ho - 1) * op.sh + op.kh - op.ph - h  # may be < 0: rows no window reaches
    hi_w = (wo - 1) * op.sw + op.kw - op.pw - w
    cfg = [(0, 0, 0), (0, 0, 0), (op.ph, hi_h, 0), (op.pw, hi_w, 0)]
    xp = lax.pad(x, jnp.asarray(fill, dtype=x.dtype), cfg)
    cols = [
        xp[:, :, i : i + op.sh * (ho - 1) + 1 : op.sh, j : j + op.sw * (wo - 1) + 1 : op.sw]
        for i in range(op.kh)
        for j in range(op.kw)
    ]
    return cols, ho, wo


def _counts(n: int, k: int, s: int, p: int, m: int) -> np.ndarray:
    """Input elements each of ``m`` windows covers along one axis (padding excluded)."""
    start = np.arange(m) * s - p
    return np.minimum(start + k, n) - np.maximum(start, 0)


def pool_forward(op: Any, x: Any) -> tuple[Any, Any]:
    """(pooled, argmax) of ``x`` for a :class:`Pool2d`-like ``op`` (argmax ``None`` for avg)."""
    h, w = x.shape[2], x.shape[3]
    if op.is_max:
        cols, ho, wo = _pool_windows(op, x, -np.inf)
        out, k = cols[0], jnp.zeros(cols[0].shape, dtype=jnp.int32)
        for i, v in enumerate(cols[1:], 1):
            later = v > out  # strictly greater: ties keep the first maximum
            out, k = jnp.where(later, v, out), jnp.where(later, i, k)
        rows = (jnp.arange(ho, dtype=jnp.int32) * op.sh - op.ph)[:, None] + k // op.kw
        cols_ = (jnp.arange(wo, dtype=jnp.int32) * op.sw - op.pw)[None, :] + k % op.kw
        return out, rows * w + cols_
    cols, ho, wo = _pool_windows(op, x, 0.0)
    count = np.outer(_counts(h, op.kh, op.sh, op.ph, ho), _counts(w, op.kw, op.sw, op.pw, wo))
    return sum(cols[1:], cols[0]) / jnp.asarray(count, dtype=x.dtype), None


@jax_funcify.register(Pool2d)
def _jax_pool2d(op: Pool2d, node: Any = None, **kwargs: Any) -> Any:
    def pool2d(x: Any) -> Any:
        out, idx = pool_forward(op, x)
        return (out, idx) if op.is_max else out

    return pool2d


@jax_funcify.register(Pool2dGrad)
def _jax_pool2d_grad(op: Pool2dGrad, node: Any = None, **kwargs: Any) -> Any:
    def pool2d_grad(x: Any, gz: Any, argmax: Any = None) -> Any:
        b, c, h, w = x.shape
        if op.is_max:
            planes = jnp.arange(b * c)[:, None]
            dx = jnp.zeros((b * c, h * w), dtype=x.dtype)
            idx = argmax.reshape(b * c, -1)
            return dx.at[planes, idx].add(gz.reshape(b * c, -1)).reshape(x.shape)
        _, vjp = jax.vjp(lambda v: pool_forward(op, v)[0], x)
        return vjp(gz)[0]

    return pool2d_grad


# -- PyTensor's own Ops ----------------------------------------------------------------------
@jax_funcify.register(ARange)
def _jax_arange(op: ARange, node: Any = None, **kwargs: Any) -> Any:
    consts = [v.data if isinstance(v, Constant) else None for v in node.inputs]

    def arange(start: Any, stop: Any, step: Any) -> Any:
        # shapes are concrete while tracing; jnp.arange raises if a value truly is traced
        args = [a if c is None else c[()] for a, c in zip((start, stop, step), consts, strict=True)]
        return jnp.arange(*args, dtype=op.dtype)

    return arange


# -- LRN and concatenation --------------------------------------------------------------------
def _window_sum(op: Any, v: Any) -> Any:
    half, c = op.n // 2, v.shape[1]
    vp = jnp.pad(v, ((0, 0), (half, half), (0, 0), (0, 0)))
    return sum(vp[:, i : i + c] for i in range(op.n))


def lrn_forward(op: Any, x: Any) -> Any:
    """``x / (k + alpha/n * window sum of x^2) ** beta`` over channels."""
    s = op.k + op.alpha / op.n * _window_sum(op, jnp.square(x))
    return (x * s ** (-op.beta)).astype(x.dtype)


def lrn_backward(op: Any, x: Any, gy: Any) -> Any:
    """The gradient of ``sum(lrn(x) * gy)`` with respect to ``x`` (as :class:`LRNGrad`)."""
    s = op.k + op.alpha / op.n * _window_sum(op, jnp.square(x))
    window = _window_sum(op, gy * x * s ** (-op.beta - 1))
    dx = gy * s ** (-op.beta) - 2 * op.alpha * op.beta / op.n * x * window
    return dx.astype(x.dtype)


@jax_funcify.register(LRNOp)
def _jax_lrn(op: LRNOp, node: Any = None, **kwargs: Any) -> Any:
    return lambda x: lrn_forward(op, x)


@jax_funcify.register(LRNGrad)
def _jax_lrn_grad(op: LRNGrad, node: Any = None, **kwargs: Any) -> Any:
    return lambda x, gy: lrn_backward(op, x, gy)


@jax_funcify.register(ChannelConcat)
def _jax_concat(op: ChannelConcat, node: Any = None, **kwargs: Any) -> Any:
    return lambda *xs: jnp.concatenate(xs, axis=1)


# -- batch norm ---------------------------------------------------------------------------------
def _bc(v: Any, nd: int) -> Any:
    return v.reshape((1, -1) + (1,) * (nd - 2))


@jax_funcify.register(BatchNormTrain)
def _jax_bn_train(op: BatchNormTrain, node: Any = None, **kwargs: Any) -> Any:
    def batch_norm_train(x: Any, gamma: Any, beta: Any, rmean: Any, rvar: Any) -> Any:
        axes, nd = _axes(x.ndim), x.ndim
        mean = x.mean(axis=axes)
        var = jnp.square(x - _bc(mean, nd)).mean(axis=axes)
        invstd = 1.0 / jnp.sqrt(var + op.eps)
        y = (x - _bc(mean, nd)) * _bc(gamma * invstd, nd) + _bc(beta, nd)
        if op.relu:
            y = y * (y > 0)
        m = op.momentum
        return y, (1 - m) * rmean + m * mean, (1 - m) * rvar + m * var, mean, invstd

    return batch_norm_train


@jax_funcify.register(BatchNormTrainGrad)
def _jax_bn_train_grad(op: BatchNormTrainGrad, node: Any = None, **kwargs: Any) -> Any:
    def batch_norm_train_grad(
        x: Any, gamma: Any, mean: Any, invstd: Any, gy: Any, z: Any = None
    ) -> Any:
        if op.relu:  # dy = dz * (z > 0), the ReLU layer's gradient
            gy = gy * (z > 0)
        axes, nd = _axes(x.ndim), x.ndim
        n = x.size // x.shape[1]
        xhat = (x - _bc(mean, nd)) * _bc(invstd, nd)
        dbeta = gy.sum(axis=axes)
        dgamma = (gy * xhat).sum(axis=axes)
        dx = _bc(gamma * invstd / n, nd) * (n * gy - _bc(dbeta, nd) - xhat * _bc(dgamma, nd))
        return dx, dgamma, dbeta

    return batch_norm_train_grad


@jax_funcify.register(BatchNormInfer)
def _jax_bn_infer(op: BatchNormInfer, node: Any = None, **kwargs: Any) -> Any:
    def batch_norm_infer(x: Any, gamma: Any, beta: Any, rmean: Any, rvar: Any) -> Any:
        scale = gamma / jnp.sqrt(rvar + op.eps)
        y = x * _bc(scale, x.ndim) + _bc(beta - rmean * scale, x.ndim)
        return y * (y > 0) if op.relu else y

    return batch_norm_infer
