"""Layers: forward against independent numpy float64 references on random data, gradients
against central finite differences (float64, Python linker: the Ops' numpy ``perform``), and
one float32 C-backend graph checked against the reference. ``test_ops.py`` checks the C code
of the Ops themselves."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.compile.mode import Mode

from theanompi.models import layers as L

PY = Mode(linker="py", optimizer="fast_compile")
R = np.random.default_rng(42)


# ---------------------------------------------------------------- numpy references (float64)
def ref_conv(x, w, b, stride, pad, groups):
    n, c, h, wd = x.shape
    f, cg, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    ho, wo = (h + 2 * pad - kh) // stride + 1, (wd + 2 * pad - kw) // stride + 1
    out = np.zeros((n, f, ho, wo))
    fg = f // groups
    for o in range(f):
        g = o // fg
        for i in range(ho):
            for j in range(wo):
                patch = xp[
                    :,
                    g * cg : (g + 1) * cg,
                    i * stride : i * stride + kh,
                    j * stride : j * stride + kw,
                ]
                out[:, o, i, j] = (patch * w[o]).sum(axis=(1, 2, 3)) + b[o]
    return out


def ref_pool(x, k, s, pad, ceil_mode, op):
    n, c, h, w = x.shape
    ho = L.pool_output_size(h, k, s, pad, ceil_mode)
    wo = L.pool_output_size(w, k, s, pad, ceil_mode)
    out = np.zeros((n, c, ho, wo))
    for i in range(ho):
        for j in range(wo):
            r0, c0 = i * s - pad, j * s - pad
            win = x[:, :, max(r0, 0) : min(r0 + k, h), max(c0, 0) : min(c0 + k, w)]
            out[:, :, i, j] = win.max(axis=(2, 3)) if op == "max" else win.mean(axis=(2, 3))
    return out


def ref_lrn(x, n, k, alpha, beta):
    c = x.shape[1]
    out = np.empty_like(x)
    for ch in range(c):
        lo, hi = max(0, ch - n // 2), min(c, ch + n // 2 + 1)
        s = (x[:, lo:hi] ** 2).sum(axis=1)
        out[:, ch] = x[:, ch] / (k + alpha / n * s) ** beta
    return out


def ref_softmax(z):
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


# ---------------------------------------------------------------- helpers
def build64(make, in_shape, batch=2):
    """Build ``make(in_shape)`` with float64 params; return (layer, x var, out var)."""
    with pytensor.config.change_flags(floatX="float64"):
        layer = make(in_shape)
        x = pt.tensor(dtype="float64", shape=(None, *in_shape), name="x")
        out = layer(x, train=False)
    return layer, x, out


def forward(layer, x, out, xv):
    return pytensor.function([x], out, mode=PY)(xv)


def check_grads(layer, x, out, xv, n_coords=6, eps=1e-6, rtol=1e-5, atol=1e-7, wrt_x=True):
    """Gradient of sum(out * proj) wrt x and each param vs central differences."""
    fwd = pytensor.function([x], out, mode=PY)
    proj = R.standard_normal(fwd(xv).shape)
    cost = (out * proj).sum()
    targets = ([x] if wrt_x else []) + list(layer.params)
    grads = pytensor.function([x], pytensor.grad(cost, targets), mode=PY)(xv)
    cost_fn = pytensor.function([x], cost, mode=PY)
    for var, g in zip(targets, grads, strict=True):
        value = xv if var is x else var.get_value()
        for _ in range(n_coords):
            idx = tuple(int(R.integers(0, d)) for d in value.shape)
            orig = value[idx]
            vals = []
            for delta in (eps, -eps):
                value[idx] = orig + delta
                if var is not x:
                    var.set_value(value)
                vals.append(cost_fn(xv))
            value[idx] = orig
            if var is not x:
                var.set_value(value)
            numeric = (vals[0] - vals[1]) / (2 * eps)
            np.testing.assert_allclose(
                g[idx], numeric, rtol=rtol, atol=atol, err_msg=f"{var.name}{idx}"
            )


# ---------------------------------------------------------------- conv
@pytest.mark.parametrize(
    "c,h,f,k,stride,pad,groups",
    [(3, 9, 4, 3, 1, 1, 1), (4, 11, 6, 5, 2, 2, 2), (3, 15, 4, 11, 4, 0, 1), (4, 6, 6, 1, 1, 0, 2)],
)
def test_conv_forward_and_grad(c, h, f, k, stride, pad, groups):
    layer, x, out = build64(
        lambda s: L.Conv2D(s, f, k, stride=stride, pad=pad, groups=groups, name="c", rng=R),
        (c, h, h),
    )
    layer.b.set_value(R.standard_normal(f))
    xv = R.standard_normal((2, c, h, h))
    got = forward(layer, x, out, xv)
    want = ref_conv(xv, layer.W.get_value(), layer.b.get_value(), stride, pad, groups)
    assert got.shape == (2, *layer.out_shape) == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
    check_grads(layer, x, out, xv)


def test_conv_rejects_bad_arguments():
    with pytest.raises(ValueError, match="groups=3 must be a positive int dividing"):
        L.Conv2D((4, 8, 8), 6, 3, groups=3)
    with pytest.raises(ValueError, match="filter_size=0"):
        L.Conv2D((4, 8, 8), 6, 0)
    with pytest.raises(ValueError, match="does not fit input"):
        L.Conv2D((4, 3, 3), 6, 5)
    with pytest.raises(ValueError, match=r"in_shape=\(4, 8\) must be \(C, H, W\)"):
        L.Conv2D((4, 8), 6, 3)


# ---------------------------------------------------------------- pooling
@pytest.mark.parametrize(
    "k,s,pad,ceil",
    [(2, 2, 0, False), (3, 2, 0, False), (3, 2, 0, True), (3, 1, 1, False), (3, 2, 1, True)],
)
@pytest.mark.parametrize("op", ["max", "avg"])
def test_pool_forward_and_grad(k, s, pad, ceil, op):
    cls = L.MaxPool2D if op == "max" else L.AvgPool2D
    layer, x, out = build64(lambda sh: cls(sh, k, stride=s, pad=pad, ceil_mode=ceil), (3, 8, 8))
    xv = R.standard_normal((2, 3, 8, 8))
    got = forward(layer, x, out, xv)
    want = ref_pool(xv, k, s, pad, ceil, op)
    assert got.shape == (2, *layer.out_shape) == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-12)
    check_grads(layer, x, out, xv)


def test_pool_output_sizes_match_alexnet_and_googlenet():
    assert L.MaxPool2D((96, 55, 55), 3, 2).out_shape == (96, 27, 27)
    assert L.MaxPool2D((256, 13, 13), 3, 2).out_shape == (256, 6, 6)
    assert L.MaxPool2D((64, 112, 112), 3, 2, ceil_mode=True).out_shape == (64, 56, 56)
    assert L.MaxPool2D((192, 14, 14), 3, 1, pad=1).out_shape == (192, 14, 14)
    with pytest.raises(ValueError, match="pad=3 must be smaller than pool_size=3"):
        L.MaxPool2D((3, 8, 8), 3, 1, pad=3)


def test_global_avg_pool():
    layer, x, out = build64(lambda s: L.GlobalAvgPool(s), (4, 5, 5))
    xv = R.standard_normal((2, 4, 5, 5))
    np.testing.assert_allclose(forward(layer, x, out, xv), xv.mean(axis=(2, 3)))
    check_grads(layer, x, out, xv)


# ---------------------------------------------------------------- LRN, ReLU, dense, softmax
@pytest.mark.parametrize("n", [5, 3, 1])
def test_lrn_forward_and_grad(n):
    # large alpha so that the normalisation is far from the identity
    layer, x, out = build64(lambda s: L.LRN(s, n=n, k=2.0, alpha=0.5, beta=0.75), (7, 4, 4))
    xv = R.standard_normal((2, 7, 4, 4)) * 2
    np.testing.assert_allclose(
        forward(layer, x, out, xv), ref_lrn(xv, n, 2.0, 0.5, 0.75), rtol=1e-12
    )
    check_grads(layer, x, out, xv)
    with pytest.raises(ValueError, match="n=4 must be a positive odd int"):
        L.LRN((7, 4, 4), n=4)


def test_lrn_without_dividing_alpha_by_n():
    """pylearn2/Theano-MPI's ``k + alpha * sum`` (no ``/n``), against the reference."""
    layer, x, out = build64(lambda s: L.LRN(s, n=3, alpha=0.2, alpha_over_n=False), (6, 3, 3))
    xv = R.standard_normal((2, 6, 3, 3)) * 2
    want = ref_lrn(xv, 3, 2.0, 0.2 * 3, 0.75)  # ref_lrn divides by n
    np.testing.assert_allclose(forward(layer, x, out, xv), want, rtol=1e-12)
    check_grads(layer, x, out, xv)


def test_relu_forward_and_grad():
    layer, x, out = build64(lambda s: L.ReLU(s), (3, 4, 4))
    xv = R.standard_normal((2, 3, 4, 4))
    np.testing.assert_array_equal(forward(layer, x, out, xv), np.maximum(xv, 0))
    check_grads(layer, x, out, xv)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_relu_gradient_is_zero_at_exactly_zero(dtype):
    """PyTorch/Caffe's convention (PyTensor's maximum sends 1 at 0); elsewhere the gradient
    is the one-sided finite difference; NaN passes through; the C graph is one elemwise."""
    x = pt.vector("x", dtype=dtype)
    y = L.ReLU((5,))(x)
    fn = pytensor.function([x], [y, pytensor.grad(y.sum(), x)])
    xv = np.array([-2.0, -0.0, 0.0, 1e-30, 3.0], dtype=dtype)
    val, grad = fn(xv)
    np.testing.assert_array_equal(val, [0, 0, 0, xv[3], 3.0])  # (-0.0 == 0: -2 gives -0.0)
    np.testing.assert_array_equal(grad, [0, 0, 0, 1, 1])
    for i, v in enumerate(xv):  # away from 0: the central difference of the compiled forward
        if v != 0:
            h = abs(v) / 4
            f = fn(np.array([v + h, v - h], dtype))[0]
            assert grad[i] == pytest.approx((f[0] - f[1]) / (2 * h), rel=1e-6)
    h = 1e-3
    right = (fn(np.array([h], dtype))[0] - fn(np.array([0], dtype))[0]) / h
    left = (fn(np.array([0], dtype))[0] - fn(np.array([-h], dtype))[0]) / h
    assert left == 0 and right == pytest.approx(1)  # the subgradient picked is the left one
    assert np.isnan(fn(np.array([np.nan], dtype))[0]).all()
    elemwise = [n for n in fn.maker.fgraph.apply_nodes if n.op.__class__.__name__ == "Elemwise"]
    assert len(elemwise) == 1, [str(n.op) for n in elemwise]  # forward + grad fused in one loop


def test_params_are_tagged_for_decay_and_lr_multipliers():
    """Lasagne-style tags: W regularizable, b not (and its lr multiplier), BN scales not."""
    from theanompi.models.optim import SGD, param_tags

    conv = L.Conv2D((3, 8, 8), 4, 3, name="c", b_lr_mult=2.0)
    fc = L.Dense((4,), 3, name="fc")
    bn = L.BatchNorm((4, 2, 2), name="bn")
    layers = conv.params + fc.params + bn.params
    tags = {p.name: (p.tag.regularizable, p.tag.lr_mult) for p in layers}
    assert tags == {
        "c.W": (True, 1.0),
        "c.b": (False, 2.0),
        "fc.W": (True, 1.0),
        "fc.b": (False, 1.0),
        "bn.gamma": (False, 1.0),
        "bn.beta": (False, 1.0),
    }
    with pytest.raises(ValueError, match=r"c2.b: lr_mult=-1.0 must be >= 0"):
        L.Conv2D((3, 8, 8), 4, 3, name="c2", b_lr_mult=-1.0)
    # untagged (hand-made) parameters keep the old rule: decay iff ndim > 1, lr x 1
    w = pytensor.shared(np.ones((2, 2)), name="w")
    assert param_tags(w) == (True, 1.0) and param_tags(pytensor.shared(np.ones(2))) == (False, 1.0)

    # SGD reads the tags: one step from zero velocity, against numpy
    lr, mu, wd = 0.1, 0.9, 0.01
    u = pytensor.shared(np.full((2, 2), 3.0), name="u")  # a matrix tagged not regularizable
    u.tag.regularizable, u.tag.lr_mult = False, 0.5
    v = pytensor.shared(np.full(3, 2.0), name="v")  # a vector tagged regularizable
    v.tag.regularizable, v.tag.lr_mult = True, 2.0
    params = [w, u, v]
    opt = SGD(params, pytensor.shared(np.float64(lr)), momentum=mu, weight_decay=wd)
    grads = [pt.ones_like(p) for p in params]
    pytensor.function([], [], updates=opt.updates(grads), mode=PY)()
    np.testing.assert_allclose(w.get_value(), 1 - lr * (1 + wd * 1))
    np.testing.assert_allclose(u.get_value(), 3 - lr * 0.5 * 1)
    np.testing.assert_allclose(v.get_value(), 2 - lr * 2.0 * (1 + wd * 2))
    np.testing.assert_allclose(opt.state[2].get_value(), -lr * 2.0 * (1 + wd * 2))
    v.tag.lr_mult = float("nan")
    with pytest.raises(ValueError, match=r"v: tag.lr_mult=nan must be >= 0"):
        SGD(params, pytensor.shared(np.float64(lr)))


def test_dense_and_flatten_forward_and_grad():
    layer, x, out = build64(lambda s: L.Dense(s, 5, name="fc", rng=R), (2, 3, 3))
    layer.b.set_value(R.standard_normal(5))
    xv = R.standard_normal((4, 2, 3, 3))
    want = xv.reshape(4, -1) @ layer.W.get_value() + layer.b.get_value()
    np.testing.assert_allclose(forward(layer, x, out, xv), want, rtol=1e-12)
    check_grads(layer, x, out, xv)
    fl, xf, of = build64(lambda s: L.Flatten(s), (2, 3, 3))
    np.testing.assert_array_equal(forward(fl, xf, of, xv), xv.reshape(4, 18))
    with pytest.raises(ValueError, match="n_out=0 must be a positive int"):
        L.Dense((3,), 0)


def test_softmax_forward_and_grad():
    layer, x, out = build64(lambda s: L.Softmax(s), (6,))
    xv = R.standard_normal((3, 6)) * 3
    np.testing.assert_allclose(forward(layer, x, out, xv), ref_softmax(xv), rtol=1e-12)
    check_grads(layer, x, out, xv)


# ---------------------------------------------------------------- concat, dropout, batch norm
def test_concat_forward_and_grad():
    def make(s):
        a = L.Conv2D(s, 2, 1, name="a", rng=R)
        b = L.Sequential(s, "b").add(L.Conv2D, 3, 3, pad=1, name="b1", rng=R).add(L.ReLU)
        c = L.Sequential(s, "c").add(L.MaxPool2D, 3, 1, pad=1).add(L.Conv2D, 1, 1, name="c1", rng=R)
        return L.Concat(s, [a, b, c], name="mix")

    layer, x, out = build64(make, (3, 5, 5))
    xv = R.standard_normal((2, 3, 5, 5))
    got = forward(layer, x, out, xv)
    a, b, c = layer.branches
    w = [p.get_value() for p in layer.params]
    pa = ref_conv(xv, w[0], w[1], 1, 0, 1)
    pb = np.maximum(ref_conv(xv, w[2], w[3], 1, 1, 1), 0)
    pc = ref_conv(ref_pool(xv, 3, 1, 1, False, "max"), w[4], w[5], 1, 0, 1)
    assert layer.out_shape == (6, 5, 5)
    np.testing.assert_allclose(got, np.concatenate([pa, pb, pc], axis=1), rtol=1e-10, atol=1e-12)
    check_grads(layer, x, out, xv)
    assert [p.name for p in layer.params] == ["a.W", "a.b", "b1.W", "b1.b", "c1.W", "c1.b"]


def test_dropout_is_seeded_random_in_training_and_identity_at_eval():
    layer = L.Dropout((1000,), p=0.3, seed=7)
    x = pt.matrix("x")
    train = pytensor.function([x], layer(x, train=True), updates=layer.updates, mode=PY)
    xv = np.ones((4, 1000), dtype=pytensor.config.floatX)
    a, b = train(xv), train(xv)
    assert not np.array_equal(a, b)  # the rng advances each call
    assert abs((a == 0).mean() - 0.3) < 0.03
    np.testing.assert_allclose(a[a != 0], 1 / 0.7, rtol=1e-6)  # inverted dropout keeps the mean
    again = L.Dropout((1000,), p=0.3, seed=7)
    f2 = pytensor.function([x], again(x, train=True), updates=again.updates, mode=PY)
    np.testing.assert_array_equal(f2(xv), a)  # same seed, same masks
    evalf = pytensor.function([x], layer(x, train=False), mode=PY)
    np.testing.assert_array_equal(evalf(xv), xv)
    with pytest.raises(ValueError, match="p=1.0 must be a drop probability"):
        L.Dropout((3,), p=1.0)


def test_batchnorm_train_and_eval():
    layer, x, _ = build64(lambda s: L.BatchNorm(s, momentum=0.5, name="bn"), (3, 4, 4))
    layer.gamma.set_value(R.standard_normal(3))
    layer.beta.set_value(R.standard_normal(3))
    with pytensor.config.change_flags(floatX="float64"):
        out_t = layer(x, train=True)
        ups = layer.updates
        out_e = layer(x, train=False)
    xv = R.standard_normal((5, 3, 4, 4)) * 3 + 1
    m, v = xv.mean(axis=(0, 2, 3)), xv.var(axis=(0, 2, 3))
    g, be = layer.gamma.get_value(), layer.beta.get_value()
    want = (xv - m[:, None, None]) / np.sqrt(v[:, None, None] + 1e-5) * g[:, None, None] + be[
        :, None, None
    ]
    np.testing.assert_allclose(
        pytensor.function([x], out_t, updates=ups, mode=PY)(xv), want, rtol=1e-10
    )
    np.testing.assert_allclose(layer.mean.get_value(), 0.5 * m, rtol=1e-10)
    np.testing.assert_allclose(layer.var.get_value(), 0.5 + 0.5 * v, rtol=1e-10)
    rm, rv = layer.mean.get_value(), layer.var.get_value()
    want_e = (xv - rm[:, None, None]) / np.sqrt(rv[:, None, None] + 1e-5) * g[:, None, None] + be[
        :, None, None
    ]
    np.testing.assert_allclose(pytensor.function([x], out_e, mode=PY)(xv), want_e, rtol=1e-10)
    check_grads(layer, x, out_t, xv)


# ---------------------------------------------------------------- the C backend, float32
def test_float32_c_graph_uses_the_c_ops_and_matches_reference():
    """conv(groups=2, stride 2) -> ReLU -> LRN -> overlapping max-pool, compiled in C."""
    from theanompi.models import ops
    from theanompi.pytensor_env import blas_ldflags

    net = L.Sequential((4, 13, 13), "net")
    net.add(L.Conv2D, 6, 5, stride=2, pad=2, groups=2, name="c", rng=R).add(L.ReLU)
    net.add(L.LRN, n=5, alpha=0.5).add(L.MaxPool2D, 3, 2)
    x = pt.tensor4("x", dtype="float32")
    out = net(x)
    fn = pytensor.function([x], [out, pytensor.grad(out.sum(), net.params[0])])
    nodes = fn.maker.fgraph.apply_nodes
    kinds = {type(node.op) for node in nodes}
    assert {ops.Conv2d, ops.Conv2dGradWeights, ops.LRNOp, ops.Pool2d} <= kinds, kinds
    conv = next(n.op for n in nodes if isinstance(n.op, ops.Conv2d))
    assert "sgemm_" in conv.c_support_code() and conv.c_libraries() == ["scipy_openblas"]
    assert "-Dsgemm_=scipy_sgemm_" in blas_ldflags()
    assert not {type(n.op).__name__ for n in nodes} & {"Scan", "OpFromGraph"}
    xv = R.standard_normal((3, 4, 13, 13)).astype(np.float32)
    got, _ = fn(xv)
    w, b = (p.get_value().astype(np.float64) for p in net.params)
    want = np.maximum(ref_conv(xv.astype(np.float64), w, b, 2, 2, 2), 0)
    want = ref_pool(ref_lrn(want, 5, 2.0, 0.5, 0.75), 3, 2, 0, False, "max")
    assert got.dtype == np.float32 and got.shape == want.shape == (3, *net.out_shape)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
