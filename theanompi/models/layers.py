"""Lasagne-like layers in plain PyTensor: conv (im2col + GEMM), pooling, LRN, dropout, dense, ...

Every layer works on channel-first float32 tensors ``(b, C, H, W)`` (or ``(b, n)`` for dense
layers), knows the per-example shape it takes (``in_shape``) and gives (``out_shape``), owns
its trainable shared variables in ``params`` (named ``<layer>.W``, ``<layer>.b``), and builds
its symbolic output with ``layer(x, train=...)``. PyTensor 3.x ships no ``nnet`` module, so
convolution, pooling and LRN are the C Ops of :mod:`theanompi.models.ops` (im2col + BLAS GEMM
for convolutions), each with a gradient Op; the rest is plain PyTensor and its autodiff.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from theanompi.pytensor_env import configure

configure()

import pytensor  # noqa: E402
import pytensor.tensor as pt  # noqa: E402
from pytensor.tensor.special import softmax  # noqa: E402

from theanompi.models.ops import (  # noqa: E402
    concat_channels,
    conv2d,
    conv_output_size,
    lrn,
    pool2d,
    pool_output_size,
)
from theanompi.models.ops.batchnorm import batch_norm_infer, batch_norm_train  # noqa: E402

__all__ = [
    "Layer",
    "Sequential",
    "Conv2D",
    "MaxPool2D",
    "AvgPool2D",
    "GlobalAvgPool",
    "LRN",
    "ReLU",
    "Dropout",
    "Dense",
    "Softmax",
    "Flatten",
    "Concat",
    "BatchNorm",
    "Residual",
    "pool_output_size",
]

Shape = tuple[int, ...]


def _floatx() -> str:
    return pytensor.config.floatX


def _pair(v: int | Sequence[int], what: str, layer: str, minimum: int = 1) -> tuple[int, int]:
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        t = (int(v), int(v))
    elif (
        isinstance(v, Sequence) and len(v) == 2 and all(isinstance(i, (int, np.integer)) for i in v)
    ):
        t = (int(v[0]), int(v[1]))
    else:
        raise ValueError(f"{layer}: {what}={v!r} must be an int or a pair of ints, e.g. {what}=3")
    if min(t) < minimum:
        raise ValueError(f"{layer}: {what}={v!r} must be >= {minimum}")
    return t


def _check_shape(in_shape: Any, ndim: int, layer: str) -> Shape:
    try:
        shape = tuple(int(s) for s in in_shape)
    except TypeError:
        raise ValueError(f"{layer}: in_shape={in_shape!r} must be a tuple of ints") from None
    if len(shape) != ndim or min(shape) < 1:
        want = "(C, H, W)" if ndim == 3 else "(n,)" if ndim == 1 else f"{ndim} positive ints"
        raise ValueError(
            f"{layer}: in_shape={in_shape!r} must be {want} per example (no batch axis)"
        )
    return shape


class Layer:
    """Base class: a differentiable map from one (b, *in_shape) tensor to (b, *out_shape).

    Subclasses set ``in_shape``/``out_shape`` (per example, no batch axis) and ``params``
    (trainable shared variables with unique ``.name``) in ``__init__`` and implement
    :meth:`forward`. ``updates`` holds non-gradient state updates (e.g. batch-norm running
    statistics) applied by a training function; ``state`` holds such non-trainable variables.

    Parameters
    ----------
    in_shape : tuple of int
        Shape of one example, e.g. ``(3, 32, 32)``.
    name : str
        Prefix of the parameter names.
    """

    def __init__(self, in_shape: Shape, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"layer name={name!r} must be a non-empty string, e.g. 'conv1'")
        self.name = name
        self.in_shape: Shape = tuple(in_shape)
        self.out_shape: Shape = tuple(in_shape)
        self.params: list[Any] = []
        self.state: list[Any] = []
        self.updates: list[tuple[Any, Any]] = []

    def forward(self, x: pt.TensorVariable, train: bool) -> pt.TensorVariable:
        """Symbolic output for input ``x``; ``train`` enables dropout / batch statistics."""
        raise NotImplementedError

    def __call__(self, x: pt.TensorVariable, train: bool = False) -> pt.TensorVariable:
        return self.forward(x, train)

    def flops(self) -> int:
        """Multiply-add FLOPs (x2) of one example's forward pass through GEMM-like ops."""
        return 0

    def n_params(self) -> int:
        """Number of trainable scalars."""
        return int(sum(p.get_value(borrow=True).size for p in self.params))

    def _param(
        self,
        suffix: str,
        value: np.ndarray,
        *,
        regularizable: bool | None = None,
        lr_mult: float = 1.0,
    ) -> Any:
        """Add a trainable shared variable ``<layer>.<suffix>`` to ``params`` and tag it.

        The tags (as Lasagne's ``add_param(..., regularizable=...)``) tell the optimiser
        what to do with it: ``p.tag.regularizable`` (weight decay applies; ``None``: only
        if ``value.ndim > 1``, so weights yes, biases and batch-norm scales no) and
        ``p.tag.lr_mult`` (the learning rate is multiplied by it; 1.0).
        """
        value = np.asarray(value, dtype=_floatx())
        if not isinstance(lr_mult, (int, float)) or not np.isfinite(lr_mult) or lr_mult < 0:
            raise ValueError(f"{self.name}.{suffix}: lr_mult={lr_mult!r} must be >= 0, e.g. 2.0")
        # with its static shape: every shape downstream is a constant, and no specify_shape
        # view of the weight keeps PyTensor's in-place pass from writing the optimizer's new
        # value into it (AlexNet b=32: 152 MB less at the step's peak, docs/performance.md)
        p = pytensor.shared(value, name=f"{self.name}.{suffix}", borrow=True, shape=value.shape)
        p.tag.regularizable = bool(value.ndim > 1 if regularizable is None else regularizable)
        p.tag.lr_mult = float(lr_mult)
        self.params.append(p)
        return p

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.in_shape} -> {self.out_shape})"


def _he(rng: np.random.Generator, shape: Shape, fan_in: int, std: float | None) -> np.ndarray:
    scale = np.sqrt(2.0 / fan_in) if std is None else std
    w = rng.standard_normal(shape, dtype=np.float32)
    w *= np.float32(scale)
    return w.astype(_floatx(), copy=False)


class Sequential(Layer):
    """A chain of layers; ``add(cls, *args, **kw)`` appends ``cls(self.out_shape, *args, **kw)``.

    >>> net = Sequential((1, 4, 4), "net")
    >>> net.add(Conv2D, 2, 3, pad=1, name="c1").add(ReLU).add(Flatten).out_shape
    (32,)
    """

    def __init__(self, in_shape: Shape, name: str = "seq", layers: Sequence[Layer] = ()) -> None:
        super().__init__(in_shape, name)
        self.layers: list[Layer] = []
        for layer in layers:
            self.append(layer)

    def append(self, layer: Layer) -> Sequential:
        """Append an already built layer (its ``in_shape`` must match ``out_shape``)."""
        if tuple(layer.in_shape) != self.out_shape:
            raise ValueError(
                f"{self.name}: layer {layer!r} takes {layer.in_shape} but the chain gives "
                f"{self.out_shape}; build it with in_shape={self.out_shape}"
            )
        self.layers.append(layer)
        self.out_shape = layer.out_shape
        self.params.extend(layer.params)
        self.state.extend(layer.state)
        return self

    def add(self, cls: type[Layer], *args: Any, **kw: Any) -> Sequential:
        """Build ``cls(self.out_shape, *args, **kw)`` and append it; returns ``self``."""
        return self.append(cls(self.out_shape, *args, **kw))

    @property
    def updates(self) -> list[tuple[Any, Any]]:  # type: ignore[override]
        return [u for layer in self.layers for u in layer.updates]

    @updates.setter
    def updates(self, value: list[tuple[Any, Any]]) -> None:
        pass

    def forward(self, x: pt.TensorVariable, train: bool) -> pt.TensorVariable:
        for layer in self.layers:
            x = layer(x, train)
        return x

    def flops(self) -> int:
        return sum(layer.flops() for layer in self.layers)


class Conv2D(Layer):
    """2-D convolution (cross-correlation, C Op: im2col + one BLAS GEMM per group), plus bias.

    Parameters
    ----------
    in_shape : tuple of int
        ``(C, H, W)`` of one example.
    n_filters : int
        Output channels ``F``; ``F`` and ``C`` must be divisible by ``groups``.
    filter_size, stride, pad : int or pair of int
        Kernel side, step and zero padding (AlexNet conv1: 11, 4, 0).
    groups : int
        Channel groups as in AlexNet's two-GPU split (conv2/4/5 use 2).
    bias : bool
        Add a per-channel bias ``b`` (initialised to ``b_init``).
    rng : numpy Generator, optional
        Source of the He-normal initial weights (or ``std`` Gaussian if given).
    b_lr_mult : float
        Learning-rate multiplier of ``b`` (its ``tag.lr_mult``; Caffe/Theano-MPI use 2).
        ``W`` is tagged regularizable (weight decay), ``b`` is not.

    Examples
    --------
    >>> conv = Conv2D((3, 8, 8), 4, 3, stride=2, pad=1, name="c")
    >>> conv.out_shape, [p.name for p in conv.params], conv.params[0].get_value().shape
    ((4, 4, 4), ['c.W', 'c.b'], (4, 3, 3, 3))
    """

    def __init__(
        self,
        in_shape: Shape,
        n_filters: int,
        filter_size: int | Sequence[int],
        stride: int | Sequence[int] = 1,
        pad: int | Sequence[int] = 0,
        groups: int = 1,
        bias: bool = True,
        name: str = "conv",
        rng: np.random.Generator | None = None,
        std: float | None = None,
        b_init: float = 0.0,
        b_lr_mult: float = 1.0,
    ) -> None:
        super().__init__(_check_shape(in_shape, 3, name), name)
        c, h, w = self.in_shape
        if not isinstance(n_filters, (int, np.integer)) or n_filters < 1:
            raise ValueError(f"{name}: n_filters={n_filters!r} must be a positive int")
        if (
            not isinstance(groups, (int, np.integer))
            or groups < 1
            or c % groups
            or n_filters % groups
        ):
            raise ValueError(
                f"{name}: groups={groups!r} must be a positive int dividing both the input "
                f"channels ({c}) and n_filters ({n_filters})"
            )
        self.k = _pair(filter_size, "filter_size", name)
        self.s = _pair(stride, "stride", name)
        self.p = _pair(pad, "pad", name, minimum=0)
        self.groups = int(groups)
        self.n_filters = int(n_filters)
        ho = conv_output_size(h, self.k[0], self.s[0], self.p[0])
        wo = conv_output_size(w, self.k[1], self.s[1], self.p[1])
        if ho < 1 or wo < 1:
            raise ValueError(
                f"{name}: filter_size={self.k} with pad={self.p} does not fit input {h}x{w}; "
                "use a smaller filter or more padding"
            )
        self.out_shape = (self.n_filters, ho, wo)
        rng = rng if rng is not None else np.random.default_rng(0)
        fan_in = (c // self.groups) * self.k[0] * self.k[1]
        w_init = _he(rng, (self.n_filters, c // self.groups, *self.k), fan_in, std)
        self.W = self._param("W", w_init, regularizable=True)
        self.b = (
            self._param(
                "b", np.full(self.n_filters, b_init), regularizable=False, lr_mult=b_lr_mult
            )
            if bias
            else None
        )

    def forward(self, x: pt.TensorVariable, train: bool) -> pt.TensorVariable:
        return conv2d(x, self.W, self.b, self.s, self.p, self.groups)

    def flops(self) -> int:
        c = self.in_shape[0] // self.groups
        return 2 * int(np.prod(self.out_shape)) * c * self.k[0] * self.k[1]


class _Pool(Layer):
    """Max or average pooling (the C Op :func:`~theanompi.models.ops.pool2d`)."""

    mode = ""

    def __init__(
        self,
        in_shape: Shape,
        pool_size: int | Sequence[int] = 2,
        stride: int | Sequence[int] | None = None,
        pad: int | Sequence[int] = 0,
        ceil_mode: bool = False,
        name: str | None = None,
    ) -> None:
        name = name or f"{self.mode}pool"
        super().__init__(_check_shape(in_shape, 3, name), name)
        self.k = _pair(pool_size, "pool_size", name)
        self.s = _pair(self.k if stride is None else stride, "stride", name)
        self.p = _pair(pad, "pad", name, minimum=0)
        if self.p[0] >= self.k[0] or self.p[1] >= self.k[1]:
            raise ValueError(f"{name}: pad={pad!r} must be smaller than pool_size={pool_size!r}")
        c, h, w = self.in_shape
        self.ceil_mode = bool(ceil_mode)
        ho = pool_output_size(h, self.k[0], self.s[0], self.p[0], self.ceil_mode)
        wo = pool_output_size(w, self.k[1], self.s[1], self.p[1], self.ceil_mode)
        if ho < 1 or wo < 1:
            raise ValueError(f"{name}: pool_size={self.k} does not fit input {h}x{w}")
        self.out_shape = (c, ho, wo)

    def forward(self, x: pt.TensorVariable, train: bool) -> pt.TensorVariable:
        return pool2d(x, self.k, self.s, self.p, self.mode, self.ceil_mode)


class MaxPool2D(_Pool):
    """Max pooling, overlapping windows allowed; padding never wins, ``ceil_mode`` keeps the
    partial last window (Caffe). Arguments: ``pool_size``, ``stride`` (default: the pool
    size), ``pad``, ``ceil_mode``, ``name``.

    >>> MaxPool2D((96, 55, 55), 3, stride=2).out_shape
    (96, 27, 27)
    """

    mode = "max"


class AvgPool2D(_Pool):
    """Average pooling; padding is excluded from the mean. Arguments as :class:`MaxPool2D`.

    >>> AvgPool2D((8, 7, 7), 7, stride=1).out_shape
    (8, 1, 1)
    """

    mode = "avg"


class GlobalAvgPool(Layer):
    """Mean over the spatial axes: ``(b, C, H, W) -> (b, C)``.

    >>> GlobalAvgPool((1024, 7, 7)).out_shape
    (1024,)
    """

    def __init__(self, in_shape: Shape, name: str = "gap") -> None:
        super().__init__(_check_shape(in_shape, 3, name), name)
        self.out_shape = (self.in_shape[0],)

    def forward(self, x: pt.TensorVariable, train: bool) -> pt.TensorVariable:
        return x.mean(axis=(2, 3))


class LRN(Layer):
    """AlexNet's cross-channel local response normalisation.

    ``y_c = x_c / (k + alpha/n * sum_{|c'-c| <= n//2} x_c'^2) ** beta`` (Caffe's and
    PyTorch's convention; Krizhevsky et al. 2012 use n=5, k=2, alpha=1e-4, beta=0.75).
    ``alpha_over_n=False`` drops the ``/n`` (``k + alpha * sum``: pylearn2's
    ``CrossChannelNormalization``, used by theano_alexnet and Theano-MPI), i.e. the same
    layer with ``alpha * n``.

    >>> LRN((96, 27, 27), n=5).out_shape
    (96, 27, 27)
    >>> LRN((96, 27, 27), alpha=1e-4, alpha_over_n=False).alpha_op
    0.0005
    """

    def __init__(
        self,
        in_shape: Shape,
        n: int = 5,
        k: float = 2.0,
        alpha: float = 1e-4,
        beta: float = 0.75,
        name: str = "lrn",
        alpha_over_n: bool = True,
    ) -> None:
        super().__init__(_check_shape(in_shape, 3, name), name)
        if not isinstance(n, (int, np.integer)) or n < 1 or n % 2 == 0:
            raise ValueError(
                f"{name}: n={n!r} must be a positive odd int (window of channels), e.g. 5"
            )
        if k <= 0 or alpha < 0 or beta < 0:
            raise ValueError(
                f"{name}: need k > 0, alpha >= 0, beta >= 0; got k={k!r}, alpha={alpha!r}, beta={beta!r}"
            )
        self.n, self.k, self.alpha, self.beta = int(n), float(k), float(alpha), float(beta)
        self.alpha_over_n = bool(alpha_over_n)
        #: the ``alpha`` of the Op, which always divides by ``n``
        self.alpha_op = self.alpha if self.alpha_over_n else self.alpha * self.n

    def forward(self, x: pt.TensorVariable, train: bool) -> pt.TensorVariable:
        return lrn(x, self.n, self.k, self.alpha_op, self.beta)


class ReLU(Layer):
    """Rectifier ``max(x, 0)``; any input shape; the one rectifier every model uses.

    Its gradient is 0 at exactly ``x == 0``, as in PyTorch and Caffe (PyTensor's
    ``maximum(x, 0)`` sends 1 there, which matters: zero biases on a black background make
    many pre-activations exactly 0). Built as ``x * (x > 0)``: NaN passes through (and
    ``-inf`` becomes NaN: a diverged net stays visibly diverged), negative inputs give -0.0
    (equal to 0). Forward and backward each fuse into one elemwise loop; a small-CNN step
    takes 4% less CPU time than with ``maximum`` (``switch(x <= 0, 0, x)``: 2-9% more).
    After a :class:`Conv2D` the rewrite ``fuse_conv_relu`` moves it into the conv's C kernel,
    and before a max pool ``mask_before_unpool`` masks the pooled gradient instead
    (:mod:`theanompi.models.ops.rewrites`; same bits).

    >>> import pytensor, pytensor.tensor as pt
    >>> v = pt.vector("v", dtype="float64")
    >>> pytensor.function([v], pytensor.grad(ReLU((3,))(v).sum(), v))([-1.0, 0.0, 2.0])
    array([0., 0., 1.])
    """

    def __init__(self, in_shape: Shape, name: str = "relu") -> None:
        super().__init__(in_shape, name)

    def forward(self, x: pt.TensorVariable, train: bool) -> pt.TensorVariable:
        return x * pt.gt(x, np.asarray(0, dtype=x.dtype))


class Dropout(Layer):
    """Inverted dropout: in training zero each unit with probability ``p`` and scale by
    ``1/(1-p)``; identity at evaluation. Seeded through its own shared RNG, which the
    training function advances via ``updates`` (so every step draws a new mask).

    >>> Dropout((10,), p=0.5, seed=1).out_shape
    (10,)
    """

    def __init__(
        self, in_shape: Shape, p: float = 0.5, seed: int = 0, name: str = "dropout"
    ) -> None:
        super().__init__(in_shape, name)
        if not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
            raise ValueError(f"{name}: p={p!r} must be a drop probability in [0, 1), e.g. 0.5")
        self.p = float(p)
        self.rng = pytensor.shared(np.random.default_rng(seed), name=f"{name}.rng")

    def forward(self, x: pt.TensorVariable, train: bool) -> pt.TensorVariable:
        if not train or self.p == 0.0:
            return x
        next_rng, u = pt.random.uniform(
            0.0, 1.0, size=x.shape, rng=self.rng, dtype=x.dtype, return_next_rng=True
        )
        self.updates = [(self.rng, next_rng)]
        keep = np.asarray(1.0 - self.p, dtype=x.dtype)
        return pt.switch(pt.lt(u, keep), x / keep, np.asarray(0, dtype=x.dtype))


class Flatten(Layer):
    """``(b, C, H, W) -> (b, C*H*W)``.

    >>> Flatten((256, 6, 6)).out_shape
    (9216,)
    """

    def __init__(self, in_shape: Shape, name: str = "flatten") -> None:
        super().__init__(in_shape, name)
        self.out_shape = (int(np.prod(self.in_shape)),)

    def forward(self, x: pt.TensorVariable, train: bool) -> pt.TensorVariable:
        return x.reshape((-1, self.out_shape[0]))


class Dense(Layer):
    """Fully connected layer ``x @ W + b`` (``W``: (n_in, n_out)); flattens its input.

    ``rng``/``std``/``b_init``/``b_lr_mult`` as :class:`Conv2D` (He-normal ``W`` unless
    ``std`` is given; ``W`` regularizable, ``b`` not, ``b``'s lr times ``b_lr_mult``).

    >>> fc = Dense((256, 6, 6), 4096, name="fc6")
    >>> fc.out_shape, fc.n_params()
    ((4096,), 37752832)
    """

    def __init__(
        self,
        in_shape: Shape,
        n_out: int,
        bias: bool = True,
        name: str = "fc",
        rng: np.random.Generator | None = None,
        std: float | None = None,
        b_init: float = 0.0,
        b_lr_mult: float = 1.0,
    ) -> None:
        super().__init__(in_shape, name)
        if not isinstance(n_out, (int, np.integer)) or n_out < 1:
            raise ValueError(f"{name}: n_out={n_out!r} must be a positive int")
        self.n_in = int(np.prod(self.in_shape))
        self.out_shape = (int(n_out),)
        rng = rng if rng is not None else np.random.default_rng(0)
        w_init = _he(rng, (self.n_in, int(n_out)), self.n_in, std)
        self.W = self._param("W", w_init, regularizable=True)
        self.b = (
            self._param("b", np.full(int(n_out), b_init), regularizable=False, lr_mult=b_lr_mult)
            if bias
            else None
        )

    def forward(self, x: pt.TensorVariable, train: bool) -> pt.TensorVariable:
        if x.ndim != 2:
            x = x.reshape((-1, self.n_in))
        out = pt.dot(x, self.W)
        return out + self.b if self.b is not None else out

    def flops(self) -> int:
        return 2 * self.n_in * self.out_shape[0]


class Softmax(Layer):
    """Row-wise softmax of ``(b, n)`` scores.

    >>> Softmax((10,)).out_shape
    (10,)
    """

    def __init__(self, in_shape: Shape, name: str = "softmax") -> None:
        super().__init__(_check_shape(in_shape, 1, name), name)

    def forward(self, x: pt.TensorVariable, train: bool) -> pt.TensorVariable:
        return softmax(x, axis=-1)


class Concat(Layer):
    """Apply parallel branches to one input and concatenate their outputs on the channel axis
    (GoogLeNet's inception module). Branches are layers whose ``in_shape`` is this layer's.

    >>> a = Conv2D((8, 5, 5), 4, 1, name="a")
    >>> b = Sequential((8, 5, 5), "b").add(Conv2D, 2, 3, pad=1, name="b1")
    >>> Concat((8, 5, 5), [a, b], name="mix").out_shape
    (6, 5, 5)
    """

    def __init__(self, in_shape: Shape, branches: Sequence[Layer], name: str = "concat") -> None:
        super().__init__(in_shape, name)
        if not branches:
            raise ValueError(f"{name}: branches={branches!r} must be a non-empty list of layers")
        spatial = {tuple(b.out_shape[1:]) for b in branches}
        if any(tuple(b.in_shape) != self.in_shape for b in branches) or len(spatial) != 1:
            shapes = [(b.in_shape, b.out_shape) for b in branches]
            raise ValueError(
                f"{name}: every branch must take {self.in_shape} and give the same spatial size; "
                f"got (in, out) = {shapes}"
            )
        self.branches = list(branches)
        self.out_shape = (sum(b.out_shape[0] for b in branches), *spatial.pop())
        for b in self.branches:
            self.params.extend(b.params)
            self.state.extend(b.state)

    @property
    def updates(self) -> list[tuple[Any, Any]]:  # type: ignore[override]
        return [u for b in self.branches for u in b.updates]

    @updates.setter
    def updates(self, value: list[tuple[Any, Any]]) -> None:
        pass

    def forward(self, x: pt.TensorVariable, train: bool) -> pt.TensorVariable:
        return concat_channels([b(x, train) for b in self.branches])

    def flops(self) -> int:
        return sum(b.flops() for b in self.branches)


class BatchNorm(Layer):
    """Batch normalisation over all axes but the channel axis (axis 1).

    Training normalises with the batch's mean and biased variance and moves the running
    ``mean``/``var`` (non-trainable, in ``state``; applied through ``updates``) towards the
    batch's mean and variance by ``momentum``; evaluation normalises with the running
    values. Each pass is one Op (:mod:`theanompi.models.ops.batchnorm`). ``gamma`` starts at
    ``gamma_init`` (0 for the last BN of a residual branch with ``zero_init_residual``).
    ``relu=True`` is BN followed by :class:`ReLU` in one Op, whose gradient needs only the
    rectified output: the pre-ReLU activation is not kept for the backward pass. Parameter
    and state names do not depend on it (a checkpoint loads either way).

    >>> bn = BatchNorm((16, 8, 8), name="bn1")
    >>> [p.name for p in bn.params], [s.name for s in bn.state]
    (['bn1.gamma', 'bn1.beta'], ['bn1.mean', 'bn1.var'])
    """

    def __init__(
        self,
        in_shape: Shape,
        eps: float = 1e-5,
        momentum: float = 0.1,
        name: str = "bn",
        gamma_init: float = 1.0,
        relu: bool = False,
    ) -> None:
        super().__init__(in_shape, name)
        self.relu = bool(relu)
        if not 0.0 < momentum <= 1.0:
            raise ValueError(f"{name}: momentum={momentum!r} must be in (0, 1], e.g. 0.1")
        if eps <= 0:
            raise ValueError(f"{name}: eps={eps!r} must be positive, e.g. 1e-5")
        c = self.in_shape[0]
        self.eps, self.momentum = float(eps), float(momentum)
        self.gamma = self._param("gamma", np.full(c, gamma_init))
        self.beta = self._param("beta", np.zeros(c))
        fx = _floatx()
        self.mean = pytensor.shared(np.zeros(c, fx), name=f"{name}.mean")
        self.var = pytensor.shared(np.ones(c, fx), name=f"{name}.var")
        self.state = [self.mean, self.var]

    def forward(self, x: pt.TensorVariable, train: bool) -> pt.TensorVariable:
        c = self.in_shape[0]
        # one Op per pass (theanompi.models.ops.batchnorm): a few nodes instead of ~30
        vecs = (self.gamma, self.beta, self.mean, self.var)
        args = [x, *(pt.specify_shape(v, (c,)) for v in vecs)]
        if not train:
            return batch_norm_infer(*args, eps=self.eps, relu=self.relu)
        y, new_mean, new_var, _, _ = batch_norm_train(
            *args, eps=self.eps, momentum=self.momentum, relu=self.relu
        )
        self.updates = [(self.mean, new_mean), (self.var, new_var)]
        return y


class Residual(Layer):
    """``main(x) + shortcut(x)`` (ResNet's block before its last ReLU); the identity when
    ``shortcut`` is ``None``. Both branches take this layer's input and give the same shape.

    >>> main = Sequential((8, 4, 4), "m").add(Conv2D, 8, 3, pad=1, bias=False, name="c")
    >>> Residual((8, 4, 4), main, name="block").out_shape
    (8, 4, 4)
    """

    def __init__(
        self, in_shape: Shape, main: Layer, shortcut: Layer | None = None, name: str = "res"
    ) -> None:
        super().__init__(in_shape, name)
        branches = [main] if shortcut is None else [main, shortcut]
        outs = {tuple(b.out_shape) for b in branches} | (
            {self.in_shape} if shortcut is None else set()
        )
        if any(tuple(b.in_shape) != self.in_shape for b in branches) or len(outs) != 1:
            shapes = [(b.in_shape, b.out_shape) for b in branches]
            raise ValueError(
                f"{name}: both branches must take {self.in_shape} and give the same shape "
                f"(the identity shortcut gives its input); got (in, out) = {shapes}"
            )
        self.main, self.shortcut = main, shortcut
        self.out_shape = tuple(main.out_shape)
        for b in branches:
            self.params.extend(b.params)
            self.state.extend(b.state)

    @property
    def updates(self) -> list[tuple[Any, Any]]:  # type: ignore[override]
        return list(self.main.updates) + (list(self.shortcut.updates) if self.shortcut else [])

    @updates.setter
    def updates(self, value: list[tuple[Any, Any]]) -> None:
        pass

    def forward(self, x: pt.TensorVariable, train: bool) -> pt.TensorVariable:
        short = x if self.shortcut is None else self.shortcut(x, train)
        return self.main(x, train) + short

    def flops(self) -> int:
        return self.main.flops() + (self.shortcut.flops() if self.shortcut else 0)
