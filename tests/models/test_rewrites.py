"""Our rewrites reach any graph compiled with the C backend's mode, a user's too."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.tensor.special import LogSoftmax, Softmax, log_softmax, softmax

from theanompi.models.layers import Conv2D, MaxPool2D, ReLU
from theanompi.models.ops import compile_mode
from theanompi.models.ops.conv import Conv2d


def _compile(mode):
    x = pt.matrix("x")
    y = pt.ivector("y")
    logp = log_softmax(x, axis=-1)
    loss = -logp[pt.arange(y.shape[0]), y].mean()
    return pytensor.function([x, y], [softmax(x, axis=-1), logp, pytensor.grad(loss, x)], mode=mode)


def _ops(fn) -> set[type]:
    return {type(n.op) for n in fn.maker.fgraph.apply_nodes}


def test_softmax_and_log_softmax_are_inlined_and_exact() -> None:
    mode = compile_mode("c")
    fn = _compile(mode)
    assert not _ops(fn) & {Softmax, LogSoftmax}
    assert {Softmax, LogSoftmax} <= _ops(_compile(mode.excluding("theanompi")))

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 5)) * 30).astype(np.float32)  # large: the max shift matters
    y = rng.integers(0, 5, 6).astype(np.int32)
    sm, logp, g = fn(x, y)
    x64 = x.astype(np.float64)
    ref_logp = x64 - x64.max(1, keepdims=True)
    ref_logp -= np.log(np.exp(ref_logp).sum(1, keepdims=True))
    ref_g = np.exp(ref_logp)
    ref_g[np.arange(6), y] -= 1
    np.testing.assert_allclose(logp, ref_logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sm, np.exp(ref_logp), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g, ref_g / 6, rtol=1e-5, atol=1e-7)


def _conv_relu_pool(mode, also_return_conv: bool = False):
    """Our Conv2D, ReLU and max-pool layers, the loss's gradients for the filters, the bias and
    the input; optionally the conv's own output too (which blocks the fusion)."""
    conv = Conv2D((3, 8, 8), 4, 3, pad=1, name="c", rng=np.random.default_rng(0))
    x, proj = pt.tensor4("x"), pt.tensor4("proj")
    v = conv(x)
    out = MaxPool2D((4, 8, 8), 2, stride=2)(ReLU((4, 8, 8))(v), True)
    loss = (out * proj).sum()
    extra = [v] if also_return_conv else []
    return pytensor.function(
        [x, proj], [out, *pytensor.grad(loss, [*conv.params, x]), *extra], mode=mode
    )


def _relu_flags(fn) -> list[int]:
    return sorted(n.op.relu for n in fn.maker.fgraph.apply_nodes if isinstance(n.op, Conv2d))


def test_conv_relu_is_fused_and_gives_the_same_bits() -> None:
    mode = compile_mode("c")
    fused, plain = _conv_relu_pool(mode), _conv_relu_pool(mode.excluding("fuse_conv_relu"))
    assert _relu_flags(fused) == [1] and _relu_flags(plain) == [0]

    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 3, 8, 8)).astype(np.float32)
    x[0] = 0.0  # a black image: every pre-activation is the bias, exactly 0, gradient 0 there
    proj = rng.standard_normal((5, 4, 4, 4)).astype(np.float32)
    for got, want in zip(fused(x, proj), plain(x, proj), strict=True):
        np.testing.assert_array_equal(got, want)
    x[1, 0, 2, 3] = np.nan  # NaN stays visible through the rectifier and its gradient
    for got, want in zip(fused(x, proj), plain(x, proj), strict=True):
        np.testing.assert_array_equal(got, want)


def test_conv_relu_is_not_fused_when_the_conv_output_is_used_elsewhere() -> None:
    fn = _conv_relu_pool(compile_mode("c"), also_return_conv=True)
    assert _relu_flags(fn) == [0]
    x = np.random.default_rng(2).standard_normal((2, 3, 8, 8)).astype(np.float32)
    out, *_, v = fn(x, np.ones((2, 4, 4, 4), np.float32))
    assert (v < 0).any()  # the conv's own output stays unrectified


def test_relu_mask_moves_before_an_overlapping_max_unpool_and_gives_the_same_bits() -> None:
    """3x3 windows at stride 2 overlap: a position may take the gradient of several windows."""
    x, proj = pt.tensor4("x"), pt.tensor4("proj")
    out = MaxPool2D((2, 9, 9), 3, stride=2)(ReLU((2, 9, 9))(x), True)
    grad = pytensor.grad((out * proj).sum(), x)
    mode = compile_mode("c")
    moved = pytensor.function([x, proj], grad, mode=mode)
    plain = pytensor.function([x, proj], grad, mode=mode.excluding("mask_before_unpool"))

    def masks_after_unpool(fn) -> int:
        nodes = fn.maker.fgraph.apply_nodes
        return sum(
            any(i.owner is not None and type(i.owner.op).__name__ == "Pool2dGrad" for i in n.inputs)
            for n in nodes
            if type(n.op).__name__ == "Elemwise"
        )

    assert masks_after_unpool(moved) == 0 and masks_after_unpool(plain) == 1
    rng = np.random.default_rng(3)
    xv = rng.standard_normal((3, 2, 9, 9)).astype(np.float32)
    xv[0] = np.round(xv[0])  # ties and exact zeros
    xv[1, 0] = -1.0  # a plane of negatives: every window's max is negative, gradient 0
    pv = rng.standard_normal((3, 2, 4, 4)).astype(np.float32)
    np.testing.assert_array_equal(moved(xv, pv), plain(xv, pv))
    assert (moved(xv, pv)[1, 0] == 0).all() and (moved(xv, pv) != 0).any()
