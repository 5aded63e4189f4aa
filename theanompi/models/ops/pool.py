"""2-D max and average pooling as C Ops, with their gradients (overlapping windows, padding,
Caffe's ceil mode).

Window ``(y, x)`` covers input rows ``[y*sh - ph, y*sh - ph + kh)`` and columns likewise,
clipped to the input: padding never wins a max and is not counted in a mean
(``count_include_pad=False``). A max window sends its whole gradient to its first maximum in
row-major order, as Caffe and PyTorch do: max pooling has a second, int32 output with that
maximum's offset in its plane, and the gradient scatters to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytensor.tensor as pt
from pytensor.gradient import grad_not_implemented
from pytensor.graph.basic import Apply

from theanompi.models.ops._c import KernelOp, int_params

__all__ = ["Pool2d", "Pool2dGrad", "pool2d", "pool_output_size"]

_PROPS = ("is_max", "kh", "kw", "sh", "sw", "ph", "pw", "ceil_mode")


def pool_output_size(n: Any, k: int, s: int, pad: int = 0, ceil_mode: bool = False) -> Any:
    """Output side of a ``k``-window, stride-``s`` pooling over a side of ``n`` (ints or symbols).

    >>> pool_output_size(55, 3, 2), pool_output_size(112, 3, 2, ceil_mode=True)
    (27, 56)
    """
    span = n + 2 * pad - k
    out = (-(-span // s) if ceil_mode else span // s) + 1
    if ceil_mode:  # the last window must start inside the input (Caffe)
        if isinstance(out, int | np.integer):
            return out - 1 if (out - 1) * s >= n + pad else out
        return pt.switch(pt.ge((out - 1) * s, n + pad), out - 1, out)
    return out


class _PoolOp(KernelOp):
    __props__ = _PROPS
    params_type = int_params(*_PROPS)

    def __init__(
        self,
        mode: str,
        window: Sequence[int],
        stride: Sequence[int],
        pad: Sequence[int] = (0, 0),
        ceil_mode: bool = False,
    ) -> None:
        if mode not in ("max", "avg"):
            raise ValueError(f"pool2d: mode={mode!r} must be 'max' or 'avg'")
        self.is_max = int(mode == "max")
        self.kh, self.kw = (int(v) for v in window)
        self.sh, self.sw = (int(v) for v in stride)
        self.ph, self.pw = (int(v) for v in pad)
        self.ceil_mode = int(bool(ceil_mode))
        if min(self.kh, self.kw, self.sh, self.sw) < 1 or not (
            0 <= self.ph < self.kh and 0 <= self.pw < self.kw
        ):
            raise ValueError(
                f"pool2d: window={tuple(window)!r} and stride={tuple(stride)!r} must be >= 1 and "
                f"0 <= pad={tuple(pad)!r} < window"
            )

    @property
    def mode(self) -> str:
        return "max" if self.is_max else "avg"

    @property
    def geometry(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "window": (self.kh, self.kw),
            "stride": (self.sh, self.sw),
            "pad": (self.ph, self.pw),
            "ceil_mode": bool(self.ceil_mode),
        }

    def out_hw(self, h: Any, w: Any) -> tuple[Any, Any]:
        """Output (height, width) for an input of (h, w)."""
        ceil = bool(self.ceil_mode)
        return (
            pool_output_size(h, self.kh, self.sh, self.ph, ceil),
            pool_output_size(w, self.kw, self.sw, self.pw, ceil),
        )

    def _windows(self, h: int, w: int) -> list[tuple[int, int, slice, slice]]:
        """``(y, x, rows, cols)`` of every output position (numpy ``perform``)."""
        ho, wo = self.out_hw(h, w)
        out = []
        for y in range(ho):
            r0 = y * self.sh - self.ph
            rows = slice(max(r0, 0), min(r0 + self.kh, h))
            for x in range(wo):
                c0 = x * self.sw - self.pw
                out.append((y, x, rows, slice(max(c0, 0), min(c0 + self.kw, w))))
        return out

    def _c_glue(self, node: Any, inp: Any, z: str, sub: Any, call: str) -> str:
        """Contiguous inputs, a ``tmpi::PoolGeom g`` from input 0 and the params, an output
        shaped like ``oshape`` (set by ``call``'s caller) and one kernel call."""
        ctype, typenum = self.c_types(node.outputs[0].dtype)
        p, fail = sub["params"], sub["fail"]
        who = type(self).__name__
        types = [typenum if v.dtype != "int32" else "NPY_INT32" for v in node.inputs]
        grab = "\n".join(
            f'PyArrayObject* a{i} = tmpi::contiguous({v}, {t}, 4, "{who} input {i}");'
            for i, (v, t) in enumerate(zip(inp, types, strict=True))
        )
        ok = " && ".join(f"a{i}" for i in range(len(inp)))
        release = " ".join(f"Py_XDECREF(a{i});" for i in range(len(inp)))
        return f"""
        {{
            {grab}
            int err = !({ok});
            tmpi::PoolGeom g;
            npy_intp oshape[4] = {{0, 0, 0, 0}};
            if (!err) {{
                npy_intp* d = PyArray_DIMS(a0);
                g.planes = d[0] * d[1]; g.H = d[2]; g.W = d[3];
                g.kh = {p}->kh; g.kw = {p}->kw; g.sh = {p}->sh; g.sw = {p}->sw;
                g.ph = {p}->ph; g.pw = {p}->pw;
                g.Ho = tmpi::pool_out(g.H, g.kh, g.sh, g.ph, {p}->ceil_mode);
                g.Wo = tmpi::pool_out(g.W, g.kw, g.sw, g.pw, {p}->ceil_mode);
                err = tmpi::check_pool(g);
                oshape[0] = d[0]; oshape[1] = d[1];
            }}
            {call.format(ctype=ctype, typenum=typenum, z=z, p=p)}
            {release}
            if (err) {{ {fail} }}
        }}
        """


class Pool2d(_PoolOp):
    """``x (b, C, H, W) -> (b, C, Ho, Wo)``, the max or mean of each window; max pooling also
    gives the int32 offset of each window's first maximum in its plane.

    >>> out, argmax = Pool2d("max", (3, 3), (2, 2))(pt.tensor4("x"))
    >>> out.dtype, argmax.dtype
    ('float64', 'int32')
    """

    def make_node(self, x: Any) -> Apply:
        x = pt.as_tensor_variable(x)
        if x.ndim != 4:
            raise TypeError(f"pool2d: input must be a 4-d tensor, got {x.type}")
        self.c_types(x.dtype)
        b, c, h, w = x.type.shape
        ho, wo = self.out_hw(h, w) if h is not None and w is not None else (None, None)
        outs = [pt.tensor(dtype=x.dtype, shape=(b, c, ho, wo))]
        if self.is_max:
            outs.append(pt.tensor(dtype="int32", shape=(b, c, ho, wo)))
        return Apply(self, [x], outs)

    def infer_shape(self, fgraph: Any, node: Any, shapes: Any) -> list[tuple[Any, ...]]:
        b, c, h, w = shapes[0]
        known = node.outputs[0].type.shape[2:]  # constants keep the ceil-mode switch out
        shape = (b, c, *(self.out_hw(h, w) if None in known else known))
        return [shape] * len(node.outputs)

    def perform(self, node: Any, inputs: Any, outputs: Any) -> None:
        (x,) = inputs
        b, c, h, w = x.shape
        ho, wo = self.out_hw(h, w)
        out = np.empty((b, c, ho, wo), dtype=x.dtype)
        idx = np.empty((b, c, ho, wo), dtype=np.int32)
        for y, xx, rows, cols in self._windows(h, w):
            win = x[:, :, rows, cols]
            if self.is_max:
                k = win.reshape(b, c, -1).argmax(axis=2)  # first maximum, row-major
                width = cols.stop - cols.start
                idx[:, :, y, xx] = (rows.start + k // width) * w + cols.start + k % width
                out[:, :, y, xx] = win.max(axis=(2, 3))
            else:
                out[:, :, y, xx] = win.mean(axis=(2, 3))
        outputs[0][0] = out
        if self.is_max:
            outputs[1][0] = idx

    def c_code(self, node: Any, name: str, inp: Any, out: Any, sub: Any) -> str:
        idx = out[1] if self.is_max else ""
        alloc_idx = (
            f"if (!err) err = tmpi::prepare_output(&{idx}, 4, oshape, NPY_INT32);" if idx else ""
        )
        call = (
            """
            oshape[2] = g.Ho; oshape[3] = g.Wo;
            if (!err) err = tmpi::prepare_output(&{z}, 4, oshape, {typenum});"""
            + alloc_idx.replace("{", "{{").replace("}", "}}")
            + """
            if (!err) TMPI_NOGIL(err, (tmpi::pool_forward<{ctype}>(g, {p}->is_max,
                                  ({ctype}*)PyArray_DATA(a0), ({ctype}*)PyArray_DATA({z}), IDX), 0));""".replace(
                "IDX", f"(npy_int32*)PyArray_DATA({idx})" if idx else "NULL"
            )
        )
        return self._c_glue(node, inp, out[0], sub, call)

    def connection_pattern(self, node: Any) -> list[list[bool]]:
        return [[True] * len(node.outputs)] if not self.is_max else [[True, False]]

    def pullback(self, inputs: Any, outputs: Any, cotangents: Any) -> list[Any]:
        (x,) = inputs
        grad = Pool2dGrad(**self.geometry)
        return [grad(x, cotangents[0], outputs[1]) if self.is_max else grad(x, cotangents[0])]


class Pool2dGrad(_PoolOp):
    """``x (b, C, H, W), gz (b, C, Ho, Wo)[, argmax] -> dx (b, C, H, W)``: the gradient of
    ``sum(pool2d(x) * gz)`` with respect to ``x``; max pooling passes its argmax output
    (``x`` only gives the shape then)."""

    def make_node(self, x: Any, gz: Any, argmax: Any = None) -> Apply:
        x, gz = pt.as_tensor_variable(x), pt.as_tensor_variable(gz)
        if x.ndim != 4 or gz.ndim != 4 or x.dtype != gz.dtype:
            raise TypeError(
                f"pool2d grad: want two 4-d tensors of one dtype, got {x.type}, {gz.type}"
            )
        self.c_types(x.dtype)
        inputs = [x, gz]
        if self.is_max:
            if argmax is None:
                raise TypeError("pool2d grad: max pooling needs the forward's argmax output")
            inputs.append(pt.as_tensor_variable(argmax).astype("int32"))
        return Apply(self, inputs, [x.type()])

    def infer_shape(self, fgraph: Any, node: Any, shapes: Any) -> list[tuple[Any, ...]]:
        return [shapes[0]]

    def perform(self, node: Any, inputs: Any, outputs: Any) -> None:
        x, gz = inputs[:2]
        b, c, h, w = x.shape
        dx = np.zeros_like(x)
        if self.is_max:
            planes = np.arange(b * c).repeat(gz.shape[2] * gz.shape[3])
            np.add.at(dx.reshape(b * c, h * w), (planes, inputs[2].ravel()), gz.ravel())
        else:
            for y, xx, rows, cols in self._windows(h, w):
                count = (rows.stop - rows.start) * (cols.stop - cols.start)
                dx[:, :, rows, cols] += (gz[:, :, y, xx] / count)[:, :, None, None]
        outputs[0][0] = dx

    def c_code(self, node: Any, name: str, inp: Any, out: Any, sub: Any) -> str:
        call = """
            if (!err && (PyArray_DIMS(a1)[0] * PyArray_DIMS(a1)[1] != g.planes ||
                         PyArray_DIMS(a1)[2] != g.Ho || PyArray_DIMS(a1)[3] != g.Wo)) {{
                PyErr_SetString(PyExc_ValueError, "pool2d grad: gz does not match the pooled shape");
                err = 1;
            }}
            CHECK_ARGMAX
            if (!err) err = tmpi::prepare_output(&{z}, 4, PyArray_DIMS(a0), {typenum});
            if (!err) TMPI_NOGIL(err, tmpi::pool_backward<{ctype}>(g, {p}->is_max, IDX,
                                                                  ({ctype}*)PyArray_DATA(a1),
                                                                  ({ctype}*)PyArray_DATA({z})));"""
        check = """if (!err && !PyArray_SAMESHAPE(a1, a2)) {{
                PyErr_SetString(PyExc_ValueError, "pool2d grad: argmax does not match gz");
                err = 1;
            }}"""
        call = call.replace("CHECK_ARGMAX", check if self.is_max else "")
        call = call.replace("IDX", "(npy_int32*)PyArray_DATA(a2)" if self.is_max else "NULL")
        return self._c_glue(node, inp, out[0], sub, call)

    def pullback(self, inputs: Any, outputs: Any, cotangents: Any) -> list[Any]:
        return [grad_not_implemented(self, i, v) for i, v in enumerate(inputs)]


def pool2d(
    x: Any,
    window: Sequence[int],
    stride: Sequence[int] | None = None,
    pad: Sequence[int] = (0, 0),
    mode: str = "max",
    ceil_mode: bool = False,
) -> Any:
    """Symbolic max (``mode="max"``) or mean (``"avg"``) pooling of ``x`` (b, C, H, W).

    >>> import numpy as np, pytensor
    >>> x = pt.tensor4("x")
    >>> f = pytensor.function([x], pool2d(x, (2, 2)))
    >>> f(np.arange(16, dtype="float32").reshape(1, 1, 4, 4))[0, 0]
    array([[ 5.,  7.],
           [13., 15.]], dtype=float32)
    """
    outs = Pool2d(mode, window, window if stride is None else stride, pad, ceil_mode)(x)
    return outs[0] if mode == "max" else outs
