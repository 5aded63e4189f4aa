"""The batch-norm C Ops (training forward and backward, evaluation; with and without the
fused ReLU): their C code against the numpy ``perform`` and a float64 reference, gradients
against finite differences through the C linker, constant and NaN channels, the fused Op
against BN followed by the ReLU layer, and a reduced ResNet-50 step with the fused sites
against the same net with separate ReLU layers."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.compile.mode import Mode
from pytensor.gradient import verify_grad

from theanompi.models import layers as L
from theanompi.models.ops.batchnorm import (
    BatchNormInfer,
    BatchNormTrain,
    BatchNormTrainGrad,
    batch_norm_infer,
    batch_norm_train,
)

C = Mode(linker="cvm", optimizer="fast_compile")
PY = Mode(linker="py", optimizer="fast_compile")
R = np.random.default_rng(11)
EPS, MOM = 1e-5, 0.1
BN_OPS = (BatchNormTrain, BatchNormTrainGrad, BatchNormInfer)


def ref_train(x, g, b, rm, rv, relu):
    """float64: (y, new running mean, new running var, mean, invstd)."""
    axes = (0, *range(2, x.ndim))
    bc = (1, -1) + (1,) * (x.ndim - 2)
    mean, var = x.mean(axis=axes), x.var(axis=axes)
    invstd = 1 / np.sqrt(var + EPS)
    y = (x - mean.reshape(bc)) * (g * invstd).reshape(bc) + b.reshape(bc)
    if relu:
        y = y * (y > 0)
    return y, (1 - MOM) * rm + MOM * mean, (1 - MOM) * rv + MOM * var, mean, invstd


def ref_grad(x, g, gz, y, relu):
    """float64 (dx, dgamma, dbeta) of sum(y * gz), ``y`` the (rectified) training output."""
    axes = (0, *range(2, x.ndim))
    bc = (1, -1) + (1,) * (x.ndim - 2)
    n = x.size // x.shape[1]
    dy = gz * (y > 0) if relu else gz
    mean, var = x.mean(axis=axes), x.var(axis=axes)
    invstd = 1 / np.sqrt(var + EPS)
    xhat = (x - mean.reshape(bc)) * invstd.reshape(bc)
    dbeta, dgamma = dy.sum(axis=axes), (dy * xhat).sum(axis=axes)
    dx = (g * invstd / n).reshape(bc) * (n * dy - dbeta.reshape(bc) - xhat * dgamma.reshape(bc))
    return dx, dgamma, dbeta


def graph(shape, dtype, relu):
    """Inputs and outputs of a training pass, its gradients of ``sum(y * proj)`` and an
    evaluation pass with its gradients."""
    x = pt.tensor("x", dtype=dtype, shape=(None,) * len(shape))
    g, b, rm, rv = (pt.vector(n, dtype=dtype) for n in ("g", "b", "rm", "rv"))
    proj = pt.tensor("proj", dtype=dtype, shape=(None,) * len(shape))
    outs = batch_norm_train(x, g, b, rm, rv, EPS, MOM, relu=relu)
    grads = pytensor.grad((outs[0] * proj).sum(), [x, g, b])
    ev = batch_norm_infer(x, g, b, rm, rv, EPS, relu=relu)
    ev_grads = pytensor.grad((ev * proj).sum(), [x, g, b])
    return [x, g, b, rm, rv, proj], [*outs, *grads, ev, *ev_grads]


def values(shape, dtype):
    c = shape[1]
    return [
        R.normal(1, 2, shape).astype(dtype),
        R.uniform(0.5, 2, c).astype(dtype),
        R.normal(0, 1, c).astype(dtype),
        R.normal(0, 1, c).astype(dtype),
        R.uniform(0.5, 2, c).astype(dtype),
        R.normal(0, 1, shape).astype(dtype),
    ]


def assert_c_thunks(fn):
    """Every batch-norm node of ``fn`` runs compiled C code, not the numpy fallback."""
    bn = [
        (n, t) for n, t in zip(fn.vm.nodes, fn.vm.thunks, strict=True) if isinstance(n.op, BN_OPS)
    ]
    assert bn and all(hasattr(t, "cthunk") for _, t in bn), [(n.op, t) for n, t in bn]


# each dtype, rank and relu once (a cold compile is ~4 s a case)
@pytest.mark.parametrize(
    ("shape", "dtype", "relu"),
    [
        ((6, 3, 5, 4), "float32", True),
        ((6, 3, 5, 4), "float64", False),
        ((9, 4), "float32", False),
        ((9, 4), "float64", True),
    ],
)
def test_c_matches_perform_and_float64_reference(shape, dtype, relu):
    ins, outs = graph(shape, dtype, relu)
    fc = pytensor.function(ins, outs, mode=C)
    assert_c_thunks(fc)
    vals = values(shape, dtype)
    got = fc(*vals)
    tight = dict(rtol=1e-10, atol=1e-12) if dtype == "float64" else dict(rtol=2e-5, atol=2e-5)
    for a, b in zip(got, pytensor.function(ins, outs, mode=PY)(*vals), strict=True):
        assert a.dtype == dtype and a.shape == b.shape
        np.testing.assert_allclose(a, b, **tight)
    x, g, b, rm, rv, proj = (v.astype(np.float64) for v in vals)
    want = ref_train(x, g, b, rm, rv, relu)
    want += ref_grad(x, g, proj, want[0], relu)
    loose = dict(rtol=1e-10, atol=1e-12) if dtype == "float64" else dict(rtol=1e-4, atol=1e-4)
    for k, (a, w) in enumerate(zip(got[:8], want, strict=True)):
        np.testing.assert_allclose(a, w, err_msg=f"output {k}", **loose)


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("shape", [(4, 3, 2, 3), (5, 2)])
def test_c_gradients_match_finite_differences(shape, relu):
    rm, rv = R.normal(0, 1, shape[1]), R.uniform(0.5, 2, shape[1])
    x, g, b = R.normal(1, 2, shape), R.uniform(0.5, 2, shape[1]), R.normal(0, 1, shape[1])
    verify_grad(
        lambda x, g, b: batch_norm_train(x, g, b, rm, rv, relu=relu)[0], [x, g, b], rng=R, mode=C
    )
    verify_grad(
        lambda x, g, b, m, v: batch_norm_infer(x, g, b, m, v, relu=relu),
        [x, g, b, rm, rv],
        rng=R,
        mode=C,
    )


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("level", [0.0, 3.7])
def test_a_constant_channel_has_zero_variance(dtype, level):
    """The variance of a constant channel is exactly 0 (invstd = 1/sqrt(eps)), its output
    beta and its input gradient gamma / sqrt(eps) * (dy - mean(dy))."""
    ins, outs = graph((5, 3, 4, 4), dtype, False)
    fn = pytensor.function(ins, outs, mode=C)
    vals = values((5, 3, 4, 4), dtype)
    vals[0][:, 1] = level
    y, new_m, new_v, mean, invstd, dx, dg, db = fn(*vals)[:8]
    g, b, rm, rv, proj = (v.astype(np.float64) for v in vals[1:])
    assert mean[1] == np.asarray(level, dtype) and invstd[1] == pytest.approx(1 / np.sqrt(EPS))
    assert new_v[1] == pytest.approx((1 - MOM) * rv[1], rel=1e-6)
    np.testing.assert_allclose(y[:, 1], b[1], rtol=1e-6)
    want_dx = g[1] / np.sqrt(EPS) * (proj[:, 1] - proj[:, 1].mean())
    np.testing.assert_allclose(dx[:, 1], want_dx, rtol=1e-4, atol=1e-3)
    assert dg[1] == 0 and np.isfinite(dx).all()


@pytest.mark.parametrize("relu", [False, True])
def test_nan_in_a_channel_propagates_to_that_channel(relu):
    ins, outs = graph((4, 3, 3, 3), "float32", relu)
    fn = pytensor.function(ins, outs, mode=C)
    vals = values((4, 3, 3, 3), "float32")
    vals[0][2, 1, 0, 1] = np.nan
    y, new_m, new_v, mean, invstd, dx, dg, db, ev = fn(*vals)[:9]
    assert np.isnan(y[:, 1]).all() and np.isnan(dx[:, 1]).all()
    assert np.isnan(ev).sum() == 1 and np.isnan(ev[2, 1, 0, 1])  # the running statistics
    for v in (new_m, new_v, mean, invstd, dg):
        assert np.isnan(v[1]) and np.isfinite(v[[0, 2]]).all()
    assert np.isfinite(y[:, [0, 2]]).all() and np.isfinite(dx[:, [0, 2]]).all()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fused_relu_equals_bn_then_the_relu_layer(dtype):
    """Outputs, the running statistics and every gradient, training and evaluation."""
    shape, got = (6, 4, 5, 5), {}
    xv = R.normal(0.5, 2, shape).astype(dtype)
    proj = R.normal(0, 1, shape).astype(dtype)
    gv, bv = R.uniform(0.5, 2, 4).astype(dtype), R.normal(0, 1, 4).astype(dtype)
    for fused in (False, True):
        with pytensor.config.change_flags(floatX=dtype):
            bn = L.BatchNorm(shape[1:], name="bn", relu=fused)
        bn.gamma.set_value(gv)
        bn.beta.set_value(bv)
        x = pt.tensor4("x", dtype=dtype)
        layers = [bn] if fused else [bn, L.ReLU(shape[1:])]
        y, ev = x, x
        for layer in layers:
            y, ev = layer(y, train=True), layer(ev, train=False)
        grads = pytensor.grad((y * proj).sum(), [x, bn.gamma, bn.beta])
        ev_grads = pytensor.grad((ev * proj).sum(), [x, bn.gamma, bn.beta])
        fn = pytensor.function([x], [y, *grads, ev, *ev_grads], updates=bn.updates)
        assert_c_thunks(fn)
        kinds = [n.op for n in fn.maker.fgraph.apply_nodes if isinstance(n.op, BN_OPS)]
        assert all(getattr(op, "relu", 0) == int(fused) for op in kinds), kinds
        got[fused] = [*fn(xv), bn.mean.get_value(), bn.var.get_value()]
    assert (got[True][0] == 0).mean() > 0.2  # the rectifier is doing something
    for k, (a, b) in enumerate(zip(got[False], got[True], strict=True)):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6, err_msg=f"output {k}")


def test_bad_shapes_are_a_value_error():
    x, g = pt.tensor4("x"), pt.vector("g")
    fn = pytensor.function([x, g], batch_norm_train(x, g, g, g, g)[0], mode=C)
    with pytest.raises(ValueError, match="channel-long vectors"):
        fn(np.zeros((2, 3, 2, 2), "float32"), np.ones(4, "float32"))
    with pytest.raises(TypeError, match="exactly when relu"):
        BatchNormTrainGrad(relu=True)(x, g, g, g, x)


def test_fused_bn_relu_under_jax_matches_the_c_backend():
    pytest.importorskip("jax")
    from theanompi.models.ops import compile_mode

    jax_mode = compile_mode("jax")
    ins, outs = graph((6, 3, 4, 4), "float32", True)
    vals = values((6, 3, 4, 4), "float32")
    want = pytensor.function(ins, outs, mode=C)(*vals)
    got = pytensor.function(ins, outs, mode=jax_mode)(*vals)
    for k, (a, b) in enumerate(zip(want, got, strict=True)):
        scale = float(np.abs(a).max()) + 1e-6
        np.testing.assert_allclose(np.asarray(b), a, rtol=1e-4, atol=1e-4 * scale, err_msg=str(k))


# ------------------------------------------------------------------------- ResNet-50 wiring
def test_resnet50_fuses_its_bn_relu_sites_and_keeps_its_names():
    from theanompi.models import create_model

    sec = dict(name="resnet50", input_size=32, channels=3, n_classes=10, arch={"width": 0.0625})
    m = create_model(sec)
    bns = {}

    def walk(layer):
        if isinstance(layer, L.BatchNorm):
            bns[layer.name] = layer.relu
        for child in getattr(layer, "layers", []):
            walk(child)
        for attr in ("main", "shortcut"):
            if getattr(layer, attr, None) is not None:
                walk(getattr(layer, attr))

    walk(m.net)
    assert bns["bn1"] and bns["layer1.0.bn1"] and bns["layer4.2.bn2"]
    assert not bns["layer1.0.bn3"] and not bns["layer1.0.downsample.1"]
    assert sum(bns.values()) == 1 + 2 * 16 and len(bns) == 53
    names = [p.name for p in m.params] + [b.name for b in m.buffers]
    assert names[:5] == [
        "conv1.W",
        "bn1.gamma",
        "bn1.beta",
        "layer1.0.conv1.W",
        "layer1.0.bn1.gamma",
    ]
    assert "layer1.0.bn1.mean" in names and "layer1.0.bn2.var" in names
