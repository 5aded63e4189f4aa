"""2-D convolution as C Ops: per-chunk im2col + one BLAS GEMM per group, and both gradients.

``conv2d(x, w, b)`` is a cross-correlation plus bias (as in Caffe and Theano's ``CorrMM``):
``out[n, f, y, x] = b[f] + sum_{c, i, j} w[f, c, i, j] * xpad[n, g*C/G + c, y*sh + i, x*sw + j]``
for filter ``f`` of group ``g``. Samples are processed in chunks whose patch matrix holds about
``chunk`` elements, so the GEMMs are wide without materialising the whole batch's patches; a
1x1 stride-1 conv uses the input as its patch matrix. The gradients are Ops of their own
(:class:`Conv2dGradWeights` gives the filter and bias gradients, :class:`Conv2dGradInputs`
the input gradient), again one GEMM per group and chunk, and differentiable in turn.
``perform`` is a numpy version of the same maths (PyTensor's Python linker uses it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytensor.tensor as pt
from numpy.lib.stride_tricks import sliding_window_view
from pytensor.gradient import DisconnectedType, disconnected_type
from pytensor.graph.basic import Apply

from theanompi.models.ops._c import KernelOp, int_params

__all__ = [
    "CHUNK",
    "Conv2d",
    "Conv2dGradWeights",
    "Conv2dGradInputs",
    "conv2d",
    "conv_output_size",
]

_PROPS = ("sh", "sw", "ph", "pw", "groups", "chunk")
#: default patch-matrix elements per GEMM chunk (128 KiB of float32, L2-resident; at least one
#: sample). `tmpi bench model`, ours/PyTorch at 1 << 15 vs 1 << 20, two runs each:
#: small_cnn:32 0.89-0.98 vs 0.75-0.77, alexnet:32 1.57-1.70 vs 1.23-1.24, resnet50:32
#: 1.23-1.26 vs 1.26-1.36
CHUNK = 1 << 15


def conv_output_size(n: Any, k: Any, s: int, p: int) -> Any:
    """Output side of a stride-``s`` conv with kernel side ``k`` over ``n`` padded ``p`` each side.

    >>> conv_output_size(227, 11, 4, 0)
    55
    """
    return (n + 2 * p - k) // s + 1


def _static(n: int | None, k: int | None, s: int, p: int) -> int | None:
    return None if n is None or k is None else conv_output_size(n, k, s, p)


def _hw(v: Any) -> Any:
    """The (h, w) of a 4-d variable: constants when its type knows them (so that the gradient
    Ops' outputs get static shapes and PyTensor's rewrites need no shape graphs), else symbolic."""
    hw = v.type.shape[2:]
    return np.asarray(hw, dtype="int64") if None not in hw else v.shape[2:]


def _const_hw(v: Any) -> tuple[int | None, int | None]:
    """The values of an (h, w) input when it is a constant, else (None, None)."""
    data = getattr(v, "data", None)
    return (int(data[0]), int(data[1])) if data is not None else (None, None)


def _connected(v: Any) -> bool:
    return not isinstance(v.type, DisconnectedType)


class _ConvOp(KernelOp):
    """Geometry (stride, pad, groups, chunk) shared by the three conv Ops, and their C glue."""

    __props__ = _PROPS
    params_type = int_params(*_PROPS)

    def __init__(
        self,
        stride: Sequence[int] = (1, 1),
        pad: Sequence[int] = (0, 0),
        groups: int = 1,
        chunk: int = CHUNK,
    ) -> None:
        self.sh, self.sw = (int(v) for v in stride)
        self.ph, self.pw = (int(v) for v in pad)
        self.groups = int(groups)
        self.chunk = int(chunk)
        if min(self.sh, self.sw, self.groups, self.chunk) < 1 or min(self.ph, self.pw) < 0:
            raise ValueError(
                f"conv2d: stride={tuple(stride)!r}, groups={groups!r} and chunk={chunk!r} must "
                f"be >= 1 and pad={tuple(pad)!r} >= 0"
            )

    @property
    def geometry(self) -> dict[str, Any]:
        return {
            "stride": (self.sh, self.sw),
            "pad": (self.ph, self.pw),
            "groups": self.groups,
            "chunk": self.chunk,
        }

    def _inputs(self, *tensors: Any, vector: Any = None, shape: Any = None) -> list[Any]:
        """4-d inputs of one float dtype, then an optional 1-d one of that dtype (the bias)
        and an optional int64 (h, w) vector (the shape a gradient Op must produce)."""
        out = [pt.as_tensor_variable(v) for v in tensors]
        if vector is not None:
            out.append(pt.as_tensor_variable(vector))
        dtypes = {v.dtype for v in out}
        ndims = [v.ndim for v in out] == [4] * len(tensors) + [1] * (vector is not None)
        if not ndims or len(dtypes) != 1:
            raise TypeError(
                f"{type(self).__name__}: inputs must be 4-d tensors (and a 1-d bias) of one "
                "float dtype, got " + ", ".join(str(v.type) for v in out)
            )
        self.c_types(dtypes.pop())
        if shape is not None:
            out.append(pt.as_tensor_variable(shape).astype("int64"))
        return out

    def _windows(self, x: np.ndarray, kh: int, kw: int) -> np.ndarray:
        """(b, C, Ho, Wo, kh, kw) strided view of the zero-padded ``x`` (numpy ``perform``)."""
        xp = np.pad(x, ((0, 0), (0, 0), (self.ph, self.ph), (self.pw, self.pw)))
        return sliding_window_view(xp, (kh, kw), axis=(2, 3))[:, :, :: self.sh, :: self.sw]

    def _c_glue(
        self,
        node: Any,
        arrays: list[tuple[str, int]],
        outs: list[tuple[str, str]],
        sub: Any,
        geom: str,
        call: str,
        hw: str | None = None,
    ) -> str:
        """C for one kernel call.

        ``arrays``: (input, ndim) made contiguous as ``a0, a1, ...``; an empty input name
        gives a NULL ``aK``. ``geom``: statements filling ``tmpi::ConvGeom g`` (may set ``err``).
        ``outs``: (output, "d0, d1, ...") allocated as 4-d (or 1-d for one size). ``call``:
        the kernel call, formatted with ``ctype``. ``hw``: an int64 (h, w) input read into
        ``hw0``/``hw1``.
        """
        ctype, typenum = self.c_types(node.outputs[0].dtype)
        p, fail = sub["params"], sub["fail"]
        who = type(self).__name__
        lines = []
        for i, (name, ndim) in enumerate(arrays):
            get = f'tmpi::contiguous({name}, {typenum}, {ndim}, "{who} input {i}")'
            lines.append(f"PyArrayObject* a{i} = {get if name else 'NULL'};")
            if name:
                lines.append(f"if (!a{i}) err = 1;")
        read_hw = ""
        if hw is not None:
            read_hw = f"""
            if (PyArray_NDIM({hw}) != 1 || PyArray_DIMS({hw})[0] != 2) {{
                PyErr_SetString(PyExc_ValueError, "{who}: the shape input must hold 2 values");
                err = 1;
            }} else {{
                hw0 = *(npy_int64*)PyArray_GETPTR1({hw}, 0);
                hw1 = *(npy_int64*)PyArray_GETPTR1({hw}, 1);
            }}"""
        alloc = "\n".join(
            f"""{{
                npy_intp shape[] = {{{dims}}};
                if (!err) err = tmpi::prepare_output(&{z}, {dims.count(",") + 1}, shape, {typenum});
            }}"""
            for z, dims in outs
        )
        release = " ".join(f"Py_XDECREF(a{i});" for i in range(len(arrays)))
        return f"""
        {{
            int err = 0;
            npy_int64 hw0 = 0, hw1 = 0;
            {" ".join(lines)}
            {read_hw}
            tmpi::ConvGeom g;
            if (!err) {{
                g.sh = {p}->sh; g.sw = {p}->sw; g.ph = {p}->ph; g.pw = {p}->pw;
                g.G = {p}->groups; g.budget = {p}->chunk;
                {geom}
            }}
            if (!err) err = tmpi::check_geom(g);
            {alloc}
            if (!err) TMPI_NOGIL(err, {call.format(ctype=ctype)});
            {release}
            if (err) {{ {fail} }}
        }}
        """


def _data(ctype: str, array: str) -> str:
    return f"({ctype}*)PyArray_DATA({array})"


_GZ_CHECK = """
                if (!err && (PyArray_DIMS(a1)[0] != g.B || PyArray_DIMS(a1)[1] != g.F ||
                             PyArray_DIMS(a1)[2] != (g.H + 2 * g.ph - g.kh) / g.sh + 1 ||
                             PyArray_DIMS(a1)[3] != (g.W + 2 * g.pw - g.kw) / g.sw + 1) &&
                    g.H + 2 * g.ph >= g.kh && g.W + 2 * g.pw >= g.kw) {
                    PyErr_SetString(PyExc_ValueError, "WHO: gz does not match the conv output shape");
                    err = 1;
                }"""


class Conv2d(_ConvOp):
    """``x (b, C, H, W), w (F, C/G, kh, kw)[, bias (F,)] -> (b, F, Ho, Wo)``, rectified
    (``v * (v > 0)``, as the ReLU layer) when ``relu``: the rewrite ``fuse_conv_relu`` folds
    a ReLU into its conv so that the rectifier runs on each chunk's rows while they are in
    cache instead of as a pass of its own over the whole output.

    >>> x, w = pt.tensor4("x"), pt.tensor4("w")
    >>> Conv2d(stride=(2, 2), pad=(1, 1))(x, w).ndim
    4
    """

    __props__ = (*_PROPS, "relu")
    params_type = int_params(*_PROPS, "relu")

    def __init__(
        self,
        stride: Sequence[int] = (1, 1),
        pad: Sequence[int] = (0, 0),
        groups: int = 1,
        chunk: int = CHUNK,
        relu: bool = False,
    ) -> None:
        super().__init__(stride, pad, groups, chunk)
        self.relu = int(bool(relu))

    def make_node(self, x: Any, w: Any, b: Any = None) -> Apply:
        inputs = self._inputs(x, w, vector=b)
        (n, _, h, wd), (f, _, kh, kw) = inputs[0].type.shape, inputs[1].type.shape
        shape = (n, f, _static(h, kh, self.sh, self.ph), _static(wd, kw, self.sw, self.pw))
        return Apply(self, inputs, [pt.tensor(dtype=inputs[0].dtype, shape=shape)])

    def infer_shape(self, fgraph: Any, node: Any, shapes: Any) -> list[tuple[Any, ...]]:
        (n, _, h, wd), (f, _, kh, kw) = shapes[:2]
        ho, wo = node.outputs[0].type.shape[2:]
        ho = conv_output_size(h, kh, self.sh, self.ph) if ho is None else ho
        wo = conv_output_size(wd, kw, self.sw, self.pw) if wo is None else wo
        return [(n, f, ho, wo)]

    def perform(self, node: Any, inputs: Any, outputs: Any) -> None:
        x, w = inputs[:2]
        f, cg, kh, kw = w.shape
        v, fg = self._windows(x, kh, kw), f // self.groups
        out = np.empty((x.shape[0], f, *v.shape[2:4]), dtype=x.dtype)
        for k in range(self.groups):
            out[:, k * fg : (k + 1) * fg] = np.einsum(
                "bchwij,fcij->bfhw", v[:, k * cg : (k + 1) * cg], w[k * fg : (k + 1) * fg]
            )
        if len(inputs) == 3:
            out += inputs[2][None, :, None, None]
        if self.relu:
            out *= out > 0
        outputs[0][0] = out

    def c_code(self, node: Any, name: str, inp: Any, out: Any, sub: Any) -> str:
        bias = inp[2] if len(inp) == 3 else ""
        geom = """
                g.B = PyArray_DIMS(a0)[0]; g.C = PyArray_DIMS(a0)[1]; g.H = PyArray_DIMS(a0)[2];
                g.W = PyArray_DIMS(a0)[3]; g.F = PyArray_DIMS(a1)[0]; g.kh = PyArray_DIMS(a1)[2];
                g.kw = PyArray_DIMS(a1)[3];
                if (g.C % g.G == 0 && g.C / g.G != PyArray_DIMS(a1)[1]) {
                    PyErr_Format(PyExc_ValueError, "conv2d: input has %d channels, the filters "
                                 "take %d per group x %d groups", g.C, (int)PyArray_DIMS(a1)[1], g.G);
                    err = 1;
                }
                if (!err && a2 && PyArray_DIMS(a2)[0] != g.F) {
                    PyErr_SetString(PyExc_ValueError, "conv2d: bias length != number of filters");
                    err = 1;
                }"""
        call = (
            "tmpi::conv_forward<{ctype}>(g, (const {ctype}*)PyArray_DATA(a0), "
            "(const {ctype}*)PyArray_DATA(a1), a2 ? (const {ctype}*)PyArray_DATA(a2) : NULL, "
            f"({{ctype}}*)PyArray_DATA({out[0]}), {sub['params']}->relu != 0)"
        )
        return self._c_glue(
            node, [(inp[0], 4), (inp[1], 4), (bias, 1)], [(out[0], "g.B, g.F, g.Ho, g.Wo")],
            sub, geom, call,
        )  # fmt: skip

    def pullback(self, inputs: Any, outputs: Any, cotangents: Any) -> list[Any]:
        x, w = inputs[:2]
        (gz,) = cotangents
        if self.relu:  # the rectifier's gradient: (v > 0) == (relu(v) > 0), NaN included
            gz = gz * pt.gt(outputs[0], np.asarray(0, dtype=gz.dtype))
        dw, db = Conv2dGradWeights(**self.geometry)(x, gz, _hw(w))
        dx = Conv2dGradInputs(**self.geometry)(w, gz, _hw(x))
        return [dx, dw, db][: len(inputs)]


class Conv2dGradWeights(_ConvOp):
    """``x (b, C, H, W), gz (b, F, Ho, Wo), (kh, kw) -> dw (F, C/G, kh, kw), db (F,)``: the
    gradients of ``sum(conv2d(x, w, b) * gz)`` with respect to ``w`` and ``b``."""

    def make_node(self, x: Any, gz: Any, kshape: Any) -> Apply:
        x, gz, kshape = self._inputs(x, gz, shape=kshape)
        c, f = x.type.shape[1], gz.type.shape[1]
        shape = (f, None if c is None else c // self.groups, *_const_hw(kshape))
        outs = [pt.tensor(dtype=x.dtype, shape=shape), pt.tensor(dtype=x.dtype, shape=(f,))]
        return Apply(self, [x, gz, kshape], outs)

    def infer_shape(self, fgraph: Any, node: Any, shapes: Any) -> list[tuple[Any, ...]]:
        kshape = node.inputs[2]
        f = shapes[1][1]
        return [(f, shapes[0][1] // self.groups, kshape[0], kshape[1]), (f,)]

    def perform(self, node: Any, inputs: Any, outputs: Any) -> None:
        x, gz, (kh, kw) = inputs
        c, f, g = x.shape[1], gz.shape[1], self.groups
        cg, fg = c // g, f // g
        v = self._windows(x, int(kh), int(kw))
        dw = np.empty((f, cg, int(kh), int(kw)), dtype=x.dtype)
        for k in range(g):
            dw[k * fg : (k + 1) * fg] = np.einsum(
                "bchwij,bfhw->fcij", v[:, k * cg : (k + 1) * cg], gz[:, k * fg : (k + 1) * fg]
            )
        outputs[0][0] = dw
        outputs[1][0] = gz.sum(axis=(0, 2, 3)).astype(x.dtype)

    def c_code(self, node: Any, name: str, inp: Any, out: Any, sub: Any) -> str:
        geom = """
                g.B = PyArray_DIMS(a0)[0]; g.C = PyArray_DIMS(a0)[1]; g.H = PyArray_DIMS(a0)[2];
                g.W = PyArray_DIMS(a0)[3]; g.F = PyArray_DIMS(a1)[1]; g.kh = hw0; g.kw = hw1;
                if (g.kh < 1 || g.kw < 1) {
                    PyErr_SetString(PyExc_ValueError, "conv2d grad weights: bad kernel size");
                    err = 1;
                }""" + _GZ_CHECK.replace("WHO", "conv2d grad weights")
        call = (
            "tmpi::conv_grad_weights<{ctype}>(g, (const {ctype}*)PyArray_DATA(a0), "
            "(const {ctype}*)PyArray_DATA(a1), "
            f"({{ctype}}*)PyArray_DATA({out[0]}), ({{ctype}}*)PyArray_DATA({out[1]}))"
        )
        return self._c_glue(
            node, [(inp[0], 4), (inp[1], 4)],
            [(out[0], "g.F, g.C / g.G, g.kh, g.kw"), (out[1], "g.F")],
            sub, geom, call, hw=inp[2],
        )  # fmt: skip

    def pullback(self, inputs: Any, outputs: Any, cotangents: Any) -> list[Any]:
        x, gz, kshape = inputs
        gdw, gdb = cotangents
        geom = self.geometry
        gx = pt.zeros_like(x)
        ggz = pt.zeros_like(gz)
        if _connected(gdw):
            gx = Conv2dGradInputs(**geom)(gdw, gz, _hw(x))
            ggz = Conv2d(**geom)(x, gdw)
        if _connected(gdb):
            ggz = ggz + gdb.dimshuffle("x", 0, "x", "x")
        return [gx, ggz, disconnected_type()]

    def connection_pattern(self, node: Any) -> list[list[bool]]:
        return [[True, False], [True, True], [False, False]]


class Conv2dGradInputs(_ConvOp):
    """``w (F, C/G, kh, kw), gz (b, F, Ho, Wo), (H, W) -> dx (b, C, H, W)``: the gradient of
    ``sum(conv2d(x, w) * gz)`` with respect to ``x``."""

    def make_node(self, w: Any, gz: Any, ishape: Any) -> Apply:
        w, gz, ishape = self._inputs(w, gz, shape=ishape)
        cg = w.type.shape[1]
        shape = (gz.type.shape[0], None if cg is None else cg * self.groups, *_const_hw(ishape))
        return Apply(self, [w, gz, ishape], [pt.tensor(dtype=w.dtype, shape=shape)])

    def infer_shape(self, fgraph: Any, node: Any, shapes: Any) -> list[tuple[Any, ...]]:
        ishape = node.inputs[2]
        return [(shapes[1][0], shapes[0][1] * self.groups, ishape[0], ishape[1])]

    def perform(self, node: Any, inputs: Any, outputs: Any) -> None:
        w, gz, (h, wd) = inputs
        f, cg, kh, kw = w.shape
        b, _, ho, wo = gz.shape
        g, fg = self.groups, f // self.groups
        dxp = np.zeros((b, cg * g, int(h) + 2 * self.ph, int(wd) + 2 * self.pw), dtype=w.dtype)
        for k in range(g):
            gk, wk = gz[:, k * fg : (k + 1) * fg], w[k * fg : (k + 1) * fg]
            for i in range(kh):
                for j in range(kw):
                    rows = slice(i, i + self.sh * (ho - 1) + 1, self.sh)
                    cols = slice(j, j + self.sw * (wo - 1) + 1, self.sw)
                    dxp[:, k * cg : (k + 1) * cg, rows, cols] += np.einsum(
                        "bfhw,fc->bchw", gk, wk[:, :, i, j]
                    )
        outputs[0][0] = dxp[:, :, self.ph : self.ph + int(h), self.pw : self.pw + int(wd)].copy()

    def c_code(self, node: Any, name: str, inp: Any, out: Any, sub: Any) -> str:
        geom = """
                g.F = PyArray_DIMS(a0)[0]; g.kh = PyArray_DIMS(a0)[2]; g.kw = PyArray_DIMS(a0)[3];
                g.B = PyArray_DIMS(a1)[0]; g.C = PyArray_DIMS(a0)[1] * g.G; g.H = hw0; g.W = hw1;
                if (g.H < 1 || g.W < 1) {
                    PyErr_SetString(PyExc_ValueError, "conv2d grad inputs: bad input size");
                    err = 1;
                }""" + _GZ_CHECK.replace("WHO", "conv2d grad inputs")
        call = (
            "tmpi::conv_grad_inputs<{ctype}>(g, (const {ctype}*)PyArray_DATA(a0), "
            f"(const {{ctype}}*)PyArray_DATA(a1), ({{ctype}}*)PyArray_DATA({out[0]}))"
        )
        return self._c_glue(
            node, [(inp[0], 4), (inp[1], 4)], [(out[0], "g.B, g.C, g.H, g.W")],
            sub, geom, call, hw=inp[2],
        )  # fmt: skip

    def pullback(self, inputs: Any, outputs: Any, cotangents: Any) -> list[Any]:
        w, gz, ishape = inputs
        (gdx,) = cotangents
        gw, _ = Conv2dGradWeights(**self.geometry)(gdx, gz, _hw(w))
        return [gw, Conv2d(**self.geometry)(gdx, w), disconnected_type()]

    def connection_pattern(self, node: Any) -> list[list[bool]]:
        return [[True], [True], [False]]


def conv2d(
    x: Any,
    w: Any,
    b: Any = None,
    stride: Sequence[int] = (1, 1),
    pad: Sequence[int] = (0, 0),
    groups: int = 1,
    chunk: int = CHUNK,
) -> Any:
    """Symbolic cross-correlation of ``x`` (b, C, H, W) with filters ``w`` (F, C/G, kh, kw),
    plus the bias ``b`` (F,) when given.

    >>> import numpy as np, pytensor
    >>> x, w = pt.tensor4("x"), pt.tensor4("w")
    >>> f = pytensor.function([x, w], conv2d(x, w, pad=(1, 1)))
    >>> f(np.ones((1, 1, 3, 3), "float32"), np.ones((1, 1, 3, 3), "float32"))[0, 0]
    array([[4., 6., 4.],
           [6., 9., 6.],
           [4., 6., 4.]], dtype=float32)
    """
    op = Conv2d(stride, pad, groups, chunk)
    return op(x, w) if b is None else op(x, w, b)
