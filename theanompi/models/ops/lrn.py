"""AlexNet's cross-channel local response normalisation as a C Op, with its gradient.

``y_c = x_c / (k + alpha/n * sum_{|c'-c| <= n//2} x_c'^2) ** beta`` (Caffe's ``alpha/n``
convention). One pass computes every channel's window sum of squares; the gradient
recomputes it rather than storing it:
``dx_c = gy_c s_c^-b - (2 a b / n) x_c sum_{|c'-c| <= n//2} gy_c' x_c' s_c'^(-b-1)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytensor.tensor as pt
from pytensor.gradient import grad_not_implemented
from pytensor.graph.basic import Apply

from theanompi.models.ops._c import KernelOp, float_params

__all__ = ["LRNOp", "LRNGrad", "lrn"]


class _LRNBase(KernelOp):
    __props__ = ("n", "k", "alpha", "beta")
    params_type = float_params(n="int", k="float", alpha="float", beta="float")

    def __init__(self, n: int = 5, k: float = 2.0, alpha: float = 1e-4, beta: float = 0.75) -> None:
        if int(n) < 1 or int(n) % 2 == 0 or k <= 0 or alpha < 0 or beta < 0:
            raise ValueError(
                f"lrn: need an odd n >= 1, k > 0, alpha >= 0, beta >= 0; got n={n!r}, "
                f"k={k!r}, alpha={alpha!r}, beta={beta!r}"
            )
        self.n, self.k, self.alpha, self.beta = int(n), float(k), float(alpha), float(beta)

    @property
    def settings(self) -> dict[str, Any]:
        return {"n": self.n, "k": self.k, "alpha": self.alpha, "beta": self.beta}

    def _scale(self, x: np.ndarray) -> np.ndarray:
        """``k + alpha/n * window sum of x^2`` over channels (numpy ``perform``)."""
        half, c = self.n // 2, x.shape[1]
        sq = np.pad(np.square(x), ((0, 0), (half, half), (0, 0), (0, 0)))
        total = sum(sq[:, i : i + c] for i in range(self.n))
        return self.k + self.alpha / self.n * total

    def _c_glue(self, node: Any, inp: Any, z: str, sub: Any, kernel: str) -> str:
        ctype, typenum = self.c_types(node.outputs[0].dtype)
        p, fail = sub["params"], sub["fail"]
        who = type(self).__name__
        grab = "\n".join(
            f'PyArrayObject* a{i} = tmpi::contiguous({v}, {typenum}, 4, "{who} input {i}");'
            for i, v in enumerate(inp)
        )
        ok = " && ".join(f"a{i}" for i in range(len(inp)))
        same = (
            " && ".join(
                f"PyArray_DIMS(a{i})[{d}] == PyArray_DIMS(a0)[{d}]"
                for i in range(1, len(inp))
                for d in range(4)
            )
            or "1"
        )
        data = ", ".join(f"({ctype}*)PyArray_DATA(a{i})" for i in range(len(inp)))
        release = " ".join(f"Py_XDECREF(a{i});" for i in range(len(inp)))
        return f"""
        {{
            {grab}
            int err = !({ok});
            if (!err && !({same})) {{
                PyErr_SetString(PyExc_ValueError, "{who}: inputs differ in shape");
                err = 1;
            }}
            if (!err) err = tmpi::prepare_output(&{z}, 4, PyArray_DIMS(a0), {typenum});
            if (!err) {{
                npy_intp* d = PyArray_DIMS(a0);
                TMPI_NOGIL(err, tmpi::{kernel}<{ctype}>((int)d[0], (int)d[1], d[2] * d[3], (int){p}->n,
                                              ({ctype}){p}->k, ({ctype}){p}->alpha, ({ctype}){p}->beta,
                                              {data}, ({ctype}*)PyArray_DATA({z})));
            }}
            {release}
            if (err) {{ {fail} }}
        }}
        """

    def infer_shape(self, fgraph: Any, node: Any, shapes: Any) -> list[tuple[Any, ...]]:
        return [shapes[0]]


class LRNOp(_LRNBase):
    """``x (b, C, H, W) -> y``, same shape.

    >>> LRNOp(n=5)(pt.tensor4("x")).ndim
    4
    """

    def make_node(self, x: Any) -> Apply:
        x = pt.as_tensor_variable(x)
        if x.ndim != 4:
            raise TypeError(f"lrn: input must be a 4-d tensor, got {x.type}")
        self.c_types(x.dtype)
        return Apply(self, [x], [x.type()])

    def perform(self, node: Any, inputs: Any, outputs: Any) -> None:
        (x,) = inputs
        outputs[0][0] = (x * self._scale(x) ** -self.beta).astype(x.dtype)

    def c_code(self, node: Any, name: str, inp: Any, out: Any, sub: Any) -> str:
        return self._c_glue(node, inp, out[0], sub, "lrn_forward")

    def pullback(self, inputs: Any, outputs: Any, cotangents: Any) -> list[Any]:
        return [LRNGrad(**self.settings)(inputs[0], cotangents[0])]


class LRNGrad(_LRNBase):
    """``x, gy -> dx``: the gradient of ``sum(lrn(x) * gy)`` with respect to ``x``."""

    def make_node(self, x: Any, gy: Any) -> Apply:
        x, gy = pt.as_tensor_variable(x), pt.as_tensor_variable(gy)
        if x.ndim != 4 or gy.ndim != 4 or x.dtype != gy.dtype:
            raise TypeError(f"lrn grad: want two 4-d tensors of one dtype, got {x.type}, {gy.type}")
        self.c_types(x.dtype)
        return Apply(self, [x, gy], [x.type()])

    def perform(self, node: Any, inputs: Any, outputs: Any) -> None:
        x, gy = inputs
        s = self._scale(x)
        t = gy * x * s ** (-self.beta - 1)
        half, c = self.n // 2, x.shape[1]
        tp = np.pad(t, ((0, 0), (half, half), (0, 0), (0, 0)))
        window = sum(tp[:, i : i + c] for i in range(self.n))
        dx = gy * s**-self.beta - 2 * self.alpha * self.beta / self.n * x * window
        outputs[0][0] = dx.astype(x.dtype)

    def c_code(self, node: Any, name: str, inp: Any, out: Any, sub: Any) -> str:
        return self._c_glue(node, inp, out[0], sub, "lrn_backward")

    def pullback(self, inputs: Any, outputs: Any, cotangents: Any) -> list[Any]:
        x, gy = inputs
        return [grad_not_implemented(self, 0, x), grad_not_implemented(self, 1, gy)]


def lrn(x: Any, n: int = 5, k: float = 2.0, alpha: float = 1e-4, beta: float = 0.75) -> Any:
    """Symbolic cross-channel LRN of ``x`` (b, C, H, W).

    >>> import numpy as np, pytensor
    >>> x = pt.tensor4("x")
    >>> f = pytensor.function([x], lrn(x, n=1, k=1.0, alpha=1.0, beta=1.0))
    >>> f(np.full((1, 1, 1, 1), 2.0, "float32")).ravel()  # 2 / (1 + 4)
    array([0.4], dtype=float32)
    """
    return LRNOp(n, k, alpha, beta)(x)
