"""Batch normalisation's training pass as one C Op, with one gradient Op, optionally fused
with the ReLU that follows it.

Written as PyTensor elementwise graphs, each BN layer's forward and backward pass is some
twenty nodes, and PyTensor's in-place and fusion rewrites grow quadratically with the graph:
ResNet-50's train function took ~100 s to rewrite. As two Ops per layer it is two nodes.
With ``xhat = (x - mean) * invstd`` over the ``N = b*H*W`` values of a channel::

    y  = gamma * xhat + beta
    dx = gamma * invstd / N * (N * dy - sum(dy) - xhat * sum(dy * xhat))

The running statistics are inputs and their new values outputs (the train function's
updates), without a gradient: the loss reaches ``x`` through ``y`` only. Evaluation is one
more Op, :class:`BatchNormInfer`.

With ``relu`` the Ops give ``z = y * (y > 0)`` (the ReLU layer's rectifier, NaN kept) and
the gradient Op takes ``z`` and ``dz`` and uses ``dy = dz * (z > 0)``: one pass over the
activation each way instead of two. It saves little memory (~90 MB on ResNet-50 at b=32):
PyTensor already ran a separate ReLU in place and kept only its bool mask; the BN outputs
proper are the next conv's inputs, which its weight gradient needs.

The C kernels (:data:`BN_SUPPORT`) run over channels in parallel (OpenMP), without the GIL.
Training forward: one pass for the statistics, shifted by the channel's first value and
summed in double (``sum(x - k)``, ``sum((x - k)^2)``: exact for a constant channel, no
cancellation for a large mean), one pass for ``y``. Backward: one pass for ``sum(dy)`` and
``sum(dy * (x - mean))`` in double, one for ``dx``. A channel's rows are read twice while
they are in cache. The numpy ``perform`` is the fallback (no compiler, other dtypes).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytensor.tensor as pt
from pytensor.gradient import DisconnectedType, grad_not_implemented
from pytensor.graph.basic import Apply

from theanompi.models.ops._c import C_TYPES, KernelOp, float_params, int_params

__all__ = [
    "BatchNormTrain",
    "BatchNormTrainGrad",
    "BatchNormInfer",
    "BatchNormRecompute",
    "batch_norm_train",
    "batch_norm_infer",
]

# Bump when BN_SUPPORT or the glue below changes (PyTensor keys its compile cache on it).
_BN_VERSION = 2

BN_SUPPORT = r"""
namespace tmpi {

/* x is viewed as (B, C, P): P = the product of the axes after the channel axis (1 for 2-d) */
template <typename T> static inline T bn_rect(T v) { return v * (T)(v > (T)0); }  /* as ReLU */

/* channel c of y = (x - mt) * sc + bt, rectified with RELU: the one place both the training
   pass and its recompute (bn_apply) compute it */
template <typename T, bool RELU>
static inline void bn_normalise(npy_intp B, npy_intp C, npy_intp P, npy_intp c, const T* x,
                                const T mt, const T sc, const T bt, T* y) {
    for (npy_intp b = 0; b < B; ++b) {
        const T* r = x + (b * C + c) * P;
        T* o = y + (b * C + c) * P;
        #pragma omp simd
        for (npy_intp p = 0; p < P; ++p) {
            const T v = (r[p] - mt) * sc + bt;
            o[p] = RELU ? bn_rect(v) : v;
        }
    }
}

template <typename T, bool RELU>
static void bn_train_forward(npy_intp B, npy_intp C, npy_intp P, double eps, double mom,
                             const T* x, const T* gamma, const T* beta, const T* rmean,
                             const T* rvar, T* y, T* new_mean, T* new_var, T* mean, T* invstd) {
    const double n = (double)B * (double)P;
    #pragma omp parallel for schedule(static)
    for (npy_intp c = 0; c < C; ++c) {
        const double k = n > 0 ? (double)x[c * P] : 0.0;  /* shift: the channel's first value */
        double s1 = 0, s2 = 0;
        for (npy_intp b = 0; b < B; ++b) {
            const T* r = x + (b * C + c) * P;
            #pragma omp simd reduction(+: s1, s2)
            for (npy_intp p = 0; p < P; ++p) {
                const double d = (double)r[p] - k;
                s1 += d;
                s2 += d * d;
            }
        }
        const double m1 = s1 / n, v0 = s2 / n - m1 * m1;
        const double var = v0 < 0 ? 0.0 : v0;  /* NaN stays NaN */
        const double mu = k + m1, is = 1.0 / sqrt(var + eps);
        mean[c] = (T)mu;
        invstd[c] = (T)is;
        new_mean[c] = (T)((1 - mom) * (double)rmean[c] + mom * mu);
        new_var[c] = (T)((1 - mom) * (double)rvar[c] + mom * var);
        bn_normalise<T, RELU>(B, C, P, c, x, (T)mu, gamma[c] * (T)is, beta[c], y);
    }
}

/* y again from the statistics bn_train_forward returned (mean, invstd): the same expression
   on the same values, so the same bits */
template <typename T, bool RELU>
static void bn_apply(npy_intp B, npy_intp C, npy_intp P, const T* x, const T* gamma,
                     const T* beta, const T* mean, const T* invstd, T* y) {
    #pragma omp parallel for schedule(static)
    for (npy_intp c = 0; c < C; ++c)
        bn_normalise<T, RELU>(B, C, P, c, x, mean[c], gamma[c] * invstd[c], beta[c], y);
}

/* dx, dgamma, dbeta from x, gamma, mean, invstd and gy (dy), or with RELU z and gy (dz):
   dy = dz * (z > 0), the ReLU layer's gradient */
template <typename T, bool RELU>
static void bn_train_backward(npy_intp B, npy_intp C, npy_intp P, const T* x, const T* gamma,
                              const T* mean, const T* invstd, const T* gy, const T* z, T* dx,
                              T* dgamma, T* dbeta) {
    const double n = (double)B * (double)P;
    #pragma omp parallel for schedule(static)
    for (npy_intp c = 0; c < C; ++c) {
        const double mu = (double)mean[c];
        double s1 = 0, s2 = 0;
        for (npy_intp b = 0; b < B; ++b) {
            const npy_intp off = (b * C + c) * P;
            const T *r = x + off, *g = gy + off, *zr = RELU ? z + off : NULL;
            #pragma omp simd reduction(+: s1, s2)
            for (npy_intp p = 0; p < P; ++p) {
                const T d = RELU ? g[p] * (T)(zr[p] > (T)0) : g[p];
                s1 += (double)d;
                s2 += (double)d * ((double)r[p] - mu);
            }
        }
        const double is = (double)invstd[c], a = (double)gamma[c] * is, dg = s2 * is;
        dbeta[c] = (T)s1;
        dgamma[c] = (T)dg;
        /* dx = a * (dy - sum(dy)/N - xhat * dgamma/N) = A dy + K (x - mean) + L */
        const T A = (T)a, K = (T)(-a * is * dg / n), L = (T)(-a * s1 / n), mt = (T)mu;
        for (npy_intp b = 0; b < B; ++b) {
            const npy_intp off = (b * C + c) * P;
            const T *r = x + off, *g = gy + off, *zr = RELU ? z + off : NULL;
            T* o = dx + off;
            #pragma omp simd
            for (npy_intp p = 0; p < P; ++p) {
                const T d = RELU ? g[p] * (T)(zr[p] > (T)0) : g[p];
                o[p] = A * d + K * (r[p] - mt) + L;
            }
        }
    }
}

/* evaluation: y = x * scale + shift, scale = gamma / sqrt(var + eps), shift = beta - mean * scale */
template <typename T, bool RELU>
static void bn_infer(npy_intp B, npy_intp C, npy_intp P, double eps, const T* x, const T* gamma,
                     const T* beta, const T* rmean, const T* rvar, T* y) {
    #pragma omp parallel for schedule(static)
    for (npy_intp q = 0; q < B * C; ++q) {
        const npy_intp c = q % C;
        const T sc = (T)((double)gamma[c] / sqrt((double)rvar[c] + eps));
        const T sh = beta[c] - rmean[c] * sc;
        const T* r = x + q * P;
        T* o = y + q * P;
        #pragma omp simd
        for (npy_intp p = 0; p < P; ++p) {
            const T v = r[p] * sc + sh;
            o[p] = RELU ? bn_rect(v) : v;
        }
    }
}

}  // namespace tmpi
"""


def _axes(ndim: int) -> tuple[int, ...]:
    return (0, *range(2, ndim))


def _bc(v: np.ndarray, ndim: int) -> np.ndarray:
    return v.reshape((1, -1) + (1,) * (ndim - 2))


def _rectify(y: np.ndarray) -> np.ndarray:
    """``y * (y > 0)`` in place, as the ReLU layer (NaN stays NaN)."""
    y *= y > 0
    return y


class _BNOp(KernelOp):
    """The C glue shared by the batch-norm Ops: a kernel over ``(B, C, P)`` views."""

    def c_support_code(self, **kwargs: Any) -> list[str]:  # type: ignore[override]
        # a list: the shared SUPPORT string stays one entry that a whole-graph module dedups
        return [super().c_support_code(**kwargs), BN_SUPPORT]

    def c_code_cache_version(self) -> tuple[int, ...]:
        return (_BN_VERSION, *super().c_code_cache_version())

    def _c_glue(
        self, node: Any, inp: Any, out: Any, sub: Any, kernel: str, scalars: str, nulls: int = 0
    ) -> str:
        """Contiguous inputs (those of ``x``'s rank: ``x``'s shape; 1-d: ``C`` long), outputs
        shaped like ``x`` or ``(C,)``, one ``tmpi::kernel<T, relu>(B, C, P, scalars, inputs,
        nulls x NULL, outputs)``; ``inp`` may be the node's first inputs only."""
        given = node.inputs[: len(inp)]
        dtype = node.inputs[0].dtype
        if dtype not in C_TYPES or any(v.dtype != dtype for v in (*given, *node.outputs)):
            raise NotImplementedError("batch norm C code: float32 or float64, one dtype")
        ctype, typenum = self.c_types(dtype)
        nd, who, fail = node.inputs[0].ndim, type(self).__name__, sub["fail"]
        ranks = [v.ndim for v in given]
        grab = "\n".join(
            f'PyArrayObject* a{i} = tmpi::contiguous({v}, {typenum}, {r}, "{who} input {i}");'
            for i, (v, r) in enumerate(zip(inp, ranks, strict=True))
        )
        ok = " && ".join(f"a{i}" for i in range(len(inp)))
        same = " && ".join(
            f"PyArray_SAMESHAPE(a{i}, a0)"
            if r == nd
            else f"PyArray_DIMS(a{i})[0] == PyArray_DIMS(a0)[1]"
            for i, r in enumerate(ranks)
        )
        alloc = "\n".join(
            f"if (!err) err = tmpi::prepare_output(&{z}, {v.ndim}, "
            f"{'PyArray_DIMS(a0)' if v.ndim == nd else '&cdim'}, {typenum});"
            for z, v in zip(out, node.outputs, strict=True)
        )
        data = ", ".join(
            [f"(const {ctype}*)PyArray_DATA(a{i})" for i in range(len(inp))]
            + ["NULL"] * nulls
            + [f"({ctype}*)PyArray_DATA({z})" for z in out]
        )
        release = " ".join(f"Py_XDECREF(a{i});" for i in range(len(inp)))
        relu = "true" if self.relu else "false"
        return f"""
        {{
            {grab}
            int err = !({ok});
            if (!err && !({same})) {{
                PyErr_SetString(PyExc_ValueError,
                                "{who}: inputs must be x's shape and channel-long vectors");
                err = 1;
            }}
            npy_intp cdim = err ? 0 : PyArray_DIMS(a0)[1];
            {alloc}
            if (!err) {{
                npy_intp* d = PyArray_DIMS(a0);
                npy_intp P = 1;
                for (int i = 2; i < {nd}; ++i) P *= d[i];
                TMPI_NOGIL(err, (tmpi::{kernel}<{ctype}, {relu}>(d[0], d[1], P, {scalars}{data}), 0));
            }}
            {release}
            if (err) {{ {fail} }}
        }}
        """


class BatchNormTrain(_BNOp):
    """``x (b, C, ...), gamma, beta, running_mean, running_var (C,) -> y, new running_mean,
    new running_var, mean, invstd``: the batch's mean and biased variance normalise ``x``;
    the running statistics move by ``momentum`` towards the batch's mean and biased
    variance (Lasagne's convention; PyTorch's running variance is the unbiased one, larger by
    ``N / (N - 1)``, 0.06 % for ResNet-50's smallest maps at batch 32). With ``relu``, ``y``
    is rectified (``y * (y > 0)``) and the gradient recomputes the mask from it.

    >>> x, g, b, m, v = pt.tensor4("x"), *(pt.vector(n) for n in "gbmv")
    >>> y, new_m, new_v, mean, invstd = BatchNormTrain(1e-5, 0.1)(x, g, b, m, v)
    >>> y.ndim, new_m.ndim
    (4, 1)
    """

    __props__ = ("eps", "momentum", "relu")
    params_type = float_params(eps="float", momentum="float", relu="int")

    def __init__(self, eps: float = 1e-5, momentum: float = 0.1, relu: bool = False) -> None:
        if not eps > 0 or not 0 < momentum <= 1:
            raise ValueError(
                f"batch norm: need eps > 0 and momentum in (0, 1]; got eps={eps!r}, "
                f"momentum={momentum!r}"
            )
        self.eps, self.momentum, self.relu = float(eps), float(momentum), int(bool(relu))

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
        if self.relu:
            _rectify(xc)
        m = self.momentum
        new_mean = (1 - m) * rmean + m * mean
        new_var = (1 - m) * rvar + m * var
        for slot, val in zip(outputs, (xc, new_mean, new_var, mean, invstd), strict=True):
            slot[0] = np.asarray(val, dtype=x.dtype)

    def c_code(self, node: Any, name: str, inp: Any, out: Any, sub: Any) -> str:
        p = sub["params"]
        return self._c_glue(node, inp, out, sub, "bn_train_forward", f"{p}->eps, {p}->momentum, ")

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
        extra = [outputs[0]] if self.relu else []  # z: the mask z > 0 is the ReLU's
        grad = BatchNormTrainGrad(relu=bool(self.relu))
        dx, dgamma, dbeta = grad(x, gamma, outputs[3], outputs[4], gy, *extra)
        return [dx, dgamma, dbeta, DisconnectedType()(), DisconnectedType()()]


class BatchNormRecompute(_BNOp):
    """``x, gamma, beta, mean, invstd, *after -> y``: a :class:`BatchNormTrain`'s ``y`` again,
    bit for bit, from the ``mean`` and ``invstd`` it returned; ``after`` are read by no one,
    they only make the node wait for them (see :mod:`theanompi.models.ops.recompute`)."""

    __props__ = ("relu",)
    params_type = int_params("relu")

    def __init__(self, relu: bool = False) -> None:
        self.relu = int(bool(relu))

    def make_node(
        self, x: Any, gamma: Any, beta: Any, mean: Any, invstd: Any, *after: Any
    ) -> Apply:
        ins = [pt.as_tensor_variable(v) for v in (x, gamma, beta, mean, invstd, *after)]
        return Apply(self, ins, [ins[0].type()])

    def perform(self, node: Any, inputs: Any, outputs: Any) -> None:
        x, gamma, beta, mean, invstd = inputs[:5]
        nd = x.ndim
        y = x - _bc(mean, nd)  # BatchNormTrain.perform's steps, on the same values
        y *= _bc(gamma * invstd, nd)
        y += _bc(beta, nd)
        outputs[0][0] = np.asarray(_rectify(y) if self.relu else y, dtype=x.dtype)

    def c_code(self, node: Any, name: str, inp: Any, out: Any, sub: Any) -> str:
        return self._c_glue(node, inp[:5], out, sub, "bn_apply", "")

    def infer_shape(self, fgraph: Any, node: Any, shapes: Any) -> list[tuple[Any, ...]]:
        return [shapes[0]]

    def pullback(self, inputs: Any, outputs: Any, cotangents: Any) -> list[Any]:
        return [grad_not_implemented(self, i, v) for i, v in enumerate(inputs)]


class BatchNormInfer(_BNOp):
    """``x, gamma, beta, running_mean, running_var -> y``: evaluation with the running
    statistics, ``y = gamma * (x - running_mean) / sqrt(running_var + eps) + beta``,
    rectified with ``relu``."""

    __props__ = ("eps", "relu")
    params_type = float_params(eps="float", relu="int")

    def __init__(self, eps: float = 1e-5, relu: bool = False) -> None:
        self.eps, self.relu = float(eps), int(bool(relu))

    def make_node(self, x: Any, gamma: Any, beta: Any, rmean: Any, rvar: Any) -> Apply:
        ins = [pt.as_tensor_variable(v) for v in (x, gamma, beta, rmean, rvar)]
        return Apply(self, ins, [ins[0].type()])

    def perform(self, node: Any, inputs: Any, outputs: Any) -> None:
        x, gamma, beta, rmean, rvar = inputs
        scale = gamma / np.sqrt(rvar + np.asarray(self.eps, rvar.dtype))
        y = x * _bc(scale.astype(x.dtype), x.ndim)
        y += _bc((beta - rmean * scale).astype(x.dtype), x.ndim)
        outputs[0][0] = _rectify(y) if self.relu else y

    def c_code(self, node: Any, name: str, inp: Any, out: Any, sub: Any) -> str:
        return self._c_glue(node, inp, out, sub, "bn_infer", f"{sub['params']}->eps, ")

    def infer_shape(self, fgraph: Any, node: Any, shapes: Any) -> list[tuple[Any, ...]]:
        return [shapes[0]]

    def pullback(self, inputs: Any, outputs: Any, cotangents: Any) -> list[Any]:
        x, gamma, _, rmean, rvar = inputs
        (gy,) = cotangents
        if self.relu:  # the rectifier's gradient: (y > 0) == (relu(y) > 0), NaN included
            gy = gy * pt.gt(outputs[0], np.asarray(0, dtype=outputs[0].dtype))
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


class BatchNormTrainGrad(_BNOp):
    """``x, gamma, mean, invstd, dy -> dx, dgamma, dbeta`` of :class:`BatchNormTrain`; with
    ``relu`` the inputs are ``x, gamma, mean, invstd, dz, z`` and ``dy = dz * (z > 0)``."""

    __props__ = ("relu",)
    params_type = int_params("relu")

    def __init__(self, relu: bool = False) -> None:
        self.relu = int(bool(relu))

    def make_node(
        self, x: Any, gamma: Any, mean: Any, invstd: Any, gy: Any, z: Any = None
    ) -> Apply:
        if (z is not None) != bool(self.relu):
            raise TypeError("batch norm grad: pass the rectified output z exactly when relu")
        ins = [pt.as_tensor_variable(v) for v in (x, gamma, mean, invstd, gy)]
        if z is not None:
            ins.append(pt.as_tensor_variable(z))
        return Apply(self, ins, [ins[0].type(), ins[1].type(), ins[1].type()])

    def perform(self, node: Any, inputs: Any, outputs: Any) -> None:
        x, gamma, mean, invstd, gy = inputs[:5]
        if self.relu:
            gy = gy * (inputs[5] > 0)
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

    def c_code(self, node: Any, name: str, inp: Any, out: Any, sub: Any) -> str:
        # without relu, the kernel's z argument is NULL
        return self._c_glue(node, inp, out, sub, "bn_train_backward", "", nulls=1 - self.relu)

    def infer_shape(self, fgraph: Any, node: Any, shapes: Any) -> list[tuple[Any, ...]]:
        return [shapes[0], shapes[1], shapes[1]]

    def pullback(self, inputs: Any, outputs: Any, cotangents: Any) -> list[Any]:
        return [grad_not_implemented(self, i, v) for i, v in enumerate(inputs)]


def batch_norm_train(
    x: Any,
    gamma: Any,
    beta: Any,
    rmean: Any,
    rvar: Any,
    eps: float = 1e-5,
    momentum: float = 0.1,
    relu: bool = False,
) -> list[Any]:
    """Symbolic ``[y, new_running_mean, new_running_var, mean, invstd]`` of a training pass
    (``y`` rectified with ``relu``)."""
    return BatchNormTrain(eps, momentum, relu)(x, gamma, beta, rmean, rvar)


def batch_norm_infer(
    x: Any, gamma: Any, beta: Any, rmean: Any, rvar: Any, eps: float = 1e-5, relu: bool = False
) -> Any:
    """Symbolic ``y`` of an evaluation pass with the running statistics."""
    return BatchNormInfer(eps, relu)(x, gamma, beta, rmean, rvar)
