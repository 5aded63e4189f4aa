"""The C Ops of ``theanompi.models.ops``: their C code against the numpy ``perform`` and an
independent float64 reference, gradients against central finite differences through the C
linker, every chunking path of the convolution, and the errors bad shapes give."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.compile.mode import Mode

from theanompi.models import ops

C = Mode(linker="cvm", optimizer="fast_compile")
PY = Mode(linker="py", optimizer="fast_compile")
R = np.random.default_rng(7)


def ref_conv(x, w, b, stride, pad, groups):
    """float64 loops, written independently of the Ops."""
    (sh, sw), (ph, pw) = stride, pad
    n, c, h, wd = x.shape
    f, cg, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    ho, wo = (h + 2 * ph - kh) // sh + 1, (wd + 2 * pw - kw) // sw + 1
    out = np.zeros((n, f, ho, wo))
    for o in range(f):
        g = o // (f // groups)
        for i in range(ho):
            for j in range(wo):
                patch = xp[:, g * cg : (g + 1) * cg, i * sh : i * sh + kh, j * sw : j * sw + kw]
                out[:, o, i, j] = (patch * w[o]).sum(axis=(1, 2, 3)) + b[o]
    return out


def numeric_grad(fn, value, idx, eps=1e-6):
    orig = value[idx]
    value[idx] = orig + eps
    up = fn()
    value[idx] = orig - eps
    down = fn()
    value[idx] = orig
    return (up - down) / (2 * eps)


def check_fd(inputs, values, cost, n_coords=5, rtol=1e-6, atol=1e-8):
    """Gradients of scalar ``cost`` (C linker, float64) vs central differences."""
    f = pytensor.function(inputs, cost, mode=C)
    grads = pytensor.function(inputs, pytensor.grad(cost, inputs), mode=C)(*values)
    for k, (v, g) in enumerate(zip(values, grads, strict=True)):
        for _ in range(n_coords):
            idx = tuple(int(R.integers(0, d)) for d in v.shape)
            num = numeric_grad(lambda: f(*values), v, idx)
            np.testing.assert_allclose(g[idx], num, rtol=rtol, atol=atol, err_msg=f"input {k}{idx}")


# (in channels, H, W, filters, kernel, stride, pad, groups)
CONVS = [
    (3, 9, 9, 4, (3, 3), (1, 1), (1, 1), 1),
    (4, 11, 10, 6, (5, 5), (2, 2), (2, 2), 2),
    (3, 15, 15, 4, (11, 11), (4, 4), (0, 0), 1),
    (4, 6, 6, 6, (1, 1), (1, 1), (0, 0), 2),  # 1x1: the input is the patch matrix
    (2, 7, 9, 3, (3, 5), (2, 1), (1, 2), 1),  # non-square everything
]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("per_chunk", [1, 2.5, 99])  # samples per GEMM: 5 = 2 + 2 + 1 for 2.5
@pytest.mark.parametrize("c,h,wd,f,k,s,p,g", CONVS)
def test_conv_c_matches_reference_and_perform(dtype, per_chunk, c, h, wd, f, k, s, p, g):
    x, w = pt.tensor4("x", dtype=dtype), pt.tensor4("w", dtype=dtype)
    b = pt.vector("b", dtype=dtype)
    patch = c * k[0] * k[1] * ops.conv_output_size(h, k[0], s[0], p[0])
    patch *= ops.conv_output_size(wd, k[1], s[1], p[1])  # patch-matrix elements per sample
    out = ops.conv2d(x, w, b, s, p, g, chunk=int(per_chunk * patch))
    proj = pt.tensor4("proj", dtype=dtype)
    graph = [out, *pytensor.grad((out * proj).sum(), [x, w, b])]
    xv = R.standard_normal((5, c, h, wd)).astype(dtype)
    wv = R.standard_normal((f, c // g, *k)).astype(dtype)
    bv = R.standard_normal(f).astype(dtype)
    want = ref_conv(xv.astype(float), wv.astype(float), bv.astype(float), s, p, g)
    pv = R.standard_normal(want.shape).astype(dtype)
    got_c = pytensor.function([x, w, b, proj], graph, mode=C)(xv, wv, bv, pv)
    got_py = pytensor.function([x, w, b, proj], graph, mode=PY)(xv, wv, bv, pv)
    tol = {"float64": 1e-10, "float32": 2e-4}[dtype]
    np.testing.assert_allclose(got_c[0], want, rtol=tol, atol=tol)
    for a, r in zip(got_c, got_py, strict=True):
        assert a.dtype == dtype and a.shape == r.shape
        np.testing.assert_allclose(a, r, rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("c,h,wd,f,k,s,p,g", CONVS[1:3] + CONVS[4:])
def test_conv_gradients_in_c_match_finite_differences(c, h, wd, f, k, s, p, g):
    x, w, b = pt.tensor4("x", dtype="float64"), pt.tensor4("w", dtype="float64"), pt.dvector("b")
    xv = R.standard_normal((3, c, h, wd))
    wv = R.standard_normal((f, c // g, *k))
    bv = R.standard_normal(f)
    out = ops.conv2d(x, w, b, s, p, g, chunk=200)
    proj = pt.constant(R.standard_normal(ref_conv(xv, wv, bv, s, p, g).shape))
    check_fd([x, w, b], [xv, wv, bv], (out * proj).sum())


@pytest.mark.parametrize("c,h,wd,f,k,s,p,g", [CONVS[0], CONVS[1]])
def test_conv_with_relu_matches_reference_perform_and_finite_differences(c, h, wd, f, k, s, p, g):
    """``Conv2d(relu=True)`` (what ``fuse_conv_relu`` makes of conv + ReLU): the rectified
    reference, the numpy ``perform``, and central differences for its gradients."""
    x, w, b = pt.tensor4("x", dtype="float64"), pt.tensor4("w", dtype="float64"), pt.dvector("b")
    xv, wv = R.standard_normal((3, c, h, wd)), R.standard_normal((f, c // g, *k))
    bv = R.standard_normal(f)
    want = np.maximum(ref_conv(xv, wv, bv, s, p, g), 0)
    out = ops.Conv2d(s, p, g, chunk=200, relu=True)(x, w, b)
    proj = pt.constant(R.standard_normal(want.shape))
    graph = [out, *pytensor.grad((out * proj).sum(), [x, w, b])]
    got_c = pytensor.function([x, w, b], graph, mode=C)(xv, wv, bv)
    got_py = pytensor.function([x, w, b], graph, mode=PY)(xv, wv, bv)
    np.testing.assert_allclose(got_c[0], want, rtol=1e-10, atol=1e-10)
    for a, r in zip(got_c, got_py, strict=True):
        np.testing.assert_allclose(a, r, rtol=1e-10, atol=1e-10)
    check_fd([x, w, b], [xv, wv, bv], (out * proj).sum())


def test_conv_second_order_gradients():
    """The gradient Ops are differentiable too (e.g. for a gradient penalty)."""
    x, w = pt.tensor4("x", dtype="float64"), pt.tensor4("w", dtype="float64")
    xv, wv = R.standard_normal((2, 4, 7, 7)), R.standard_normal((6, 2, 3, 3))
    out = ops.conv2d(x, w, None, (2, 2), (1, 1), 2)
    gx, gw = pytensor.grad((out * pt.constant(R.standard_normal((2, 6, 4, 4)))).sum(), [x, w])
    check_fd([x, w], [xv, wv], (gx**2).sum() + (gw**3).sum(), rtol=1e-5, atol=1e-7)


POOLS = [  # (H, W, window, stride, pad, ceil)
    (8, 8, (2, 2), (2, 2), (0, 0), False),
    (9, 9, (3, 3), (2, 2), (0, 0), False),
    (10, 10, (3, 3), (2, 2), (1, 1), True),
    (7, 6, (3, 2), (1, 2), (1, 0), False),
    (112, 112, (3, 3), (2, 2), (0, 0), True),  # GoogLeNet pool1
    (2, 2, (3, 3), (2, 2), (0, 0), True),  # a window larger than the input (ceil mode)
]


def ref_pool(x, window, stride, pad, ceil, mode):
    h, w = x.shape[2:]
    ho = ops.pool_output_size(h, window[0], stride[0], pad[0], ceil)
    wo = ops.pool_output_size(w, window[1], stride[1], pad[1], ceil)
    out = np.zeros((*x.shape[:2], ho, wo))
    for i in range(ho):
        for j in range(wo):
            r, c = i * stride[0] - pad[0], j * stride[1] - pad[1]
            win = x[:, :, max(r, 0) : r + window[0], max(c, 0) : c + window[1]]
            out[:, :, i, j] = win.max(axis=(2, 3)) if mode == "max" else win.mean(axis=(2, 3))
    return out


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("mode", ["max", "avg"])
@pytest.mark.parametrize("h,w,k,s,p,ceil", POOLS)
def test_pool_c_matches_reference_and_perform(dtype, mode, h, w, k, s, p, ceil):
    x, proj = pt.tensor4("x", dtype=dtype), pt.tensor4("proj", dtype=dtype)
    out = ops.pool2d(x, k, s, p, mode, ceil)
    graph = [out, pytensor.grad((out * proj).sum(), x)]
    xv = R.standard_normal((2, 3, h, w)).astype(dtype)
    want = ref_pool(xv.astype(float), k, s, p, ceil, mode)
    pv = R.standard_normal(want.shape).astype(dtype)
    got_c = pytensor.function([x, proj], graph, mode=C)(xv, pv)
    got_py = pytensor.function([x, proj], graph, mode=PY)(xv, pv)
    np.testing.assert_allclose(got_c[0], want, rtol=1e-6, atol=1e-6)
    for a, r in zip(got_c, got_py, strict=True):
        assert a.dtype == dtype
        np.testing.assert_allclose(a, r, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["max", "avg"])
@pytest.mark.parametrize("h,w,k,s,p,ceil", POOLS[1:4])
def test_pool_gradients_in_c_match_finite_differences(mode, h, w, k, s, p, ceil):
    x = pt.tensor4("x", dtype="float64")
    xv = R.standard_normal((2, 2, h, w))
    proj = pt.constant(R.standard_normal(ref_pool(xv, k, s, p, ceil, mode).shape))
    check_fd([x], [xv], (ops.pool2d(x, k, s, p, mode, ceil) * proj).sum(), n_coords=12)


def test_max_pool_gradient_goes_to_the_first_maximum():
    x = pt.tensor4("x", dtype="float64")
    g = pytensor.function([x], pytensor.grad(ops.pool2d(x, (2, 2)).sum(), x), mode=C)
    xv = np.array([[[[1.0, 3.0], [3.0, 0.0]]]])  # a tie: row-major first wins
    np.testing.assert_array_equal(g(xv), [[[[0.0, 1.0], [0.0, 0.0]]]])


def ref_lrn(x, n, k, alpha, beta):
    out = np.empty_like(x)
    for ch in range(x.shape[1]):
        lo, hi = max(0, ch - n // 2), min(x.shape[1], ch + n // 2 + 1)
        out[:, ch] = x[:, ch] / (k + alpha / n * (x[:, lo:hi] ** 2).sum(axis=1)) ** beta
    return out


@pytest.mark.parametrize("n", [1, 3, 5])
def test_lrn_c_matches_reference_perform_and_finite_differences(n):
    x, proj = pt.tensor4("x", dtype="float64"), pt.tensor4("proj", dtype="float64")
    out = ops.lrn(x, n, 2.0, 0.5, 0.75)
    xv = R.standard_normal((2, 7, 4, 3)) * 2
    pv = R.standard_normal(xv.shape)
    graph = [out, pytensor.grad((out * proj).sum(), x)]
    got_c = pytensor.function([x, proj], graph, mode=C)(xv, pv)
    got_py = pytensor.function([x, proj], graph, mode=PY)(xv, pv)
    np.testing.assert_allclose(got_c[0], ref_lrn(xv, n, 2.0, 0.5, 0.75), rtol=1e-12)
    for a, r in zip(got_c, got_py, strict=True):
        np.testing.assert_allclose(a, r, rtol=1e-12, atol=1e-14)
    check_fd([x], [xv], (out * pt.constant(pv)).sum())
    f32 = pytensor.function([x], ops.lrn(x.astype("float32"), n, 2.0, 0.5, 0.75), mode=C)(xv)
    assert f32.dtype == np.float32
    np.testing.assert_allclose(f32, ref_lrn(xv, n, 2.0, 0.5, 0.75), rtol=1e-5)


def test_channel_concat_forward_grad_and_static_shape():
    a = pt.tensor4("a", dtype="float64", shape=(None, 2, 3, 3))
    b = pt.tensor4("b", dtype="float64", shape=(None, 5, 3, 3))
    out = ops.concat_channels([a, b])
    assert out.type.shape == (None, 7, 3, 3)
    av, bv = R.standard_normal((2, 2, 3, 3)), R.standard_normal((2, 5, 3, 3))
    proj = R.standard_normal((2, 7, 3, 3))
    f = pytensor.function([a, b], [out, *pytensor.grad((out * proj).sum(), [a, b])], mode=C)
    got, ga, gb = f(av, bv)
    np.testing.assert_array_equal(got, np.concatenate([av, bv], axis=1))
    np.testing.assert_array_equal(ga, proj[:, :2])
    np.testing.assert_array_equal(gb, proj[:, 2:])
    with pytest.raises(TypeError, match="static channel count"):
        ops.concat_channels([a, pt.tensor4("c", dtype="float64")])


def test_bad_shapes_raise_clear_errors():
    x, w = pt.tensor4("x"), pt.tensor4("w")
    f = pytensor.function([x, w], ops.conv2d(x, w, groups=2), mode=C)
    with pytest.raises(ValueError, match="input has 6 channels, the filters take 2 per group x 2"):
        f(np.zeros((1, 6, 5, 5), "float32"), np.zeros((4, 2, 3, 3), "float32"))
    with pytest.raises(ValueError, match="kernel 7x7 does not fit the padded input 5x5"):
        f(np.zeros((1, 4, 5, 5), "float32"), np.zeros((4, 2, 7, 7), "float32"))
    with pytest.raises(TypeError, match="4-d tensors"):
        ops.conv2d(pt.matrix("m"), w)
    with pytest.raises(ValueError, match=r"pad=\(3, 3\) < window"):
        ops.pool2d(x, (3, 3), pad=(3, 3))
    with pytest.raises(ValueError, match="mode='median'"):
        ops.pool2d(x, (2, 2), mode="median")
    with pytest.raises(ValueError, match="odd n"):
        ops.lrn(x, n=4)
    p = pytensor.function([x], ops.pool2d(x, (3, 3)), mode=C)
    with pytest.raises(ValueError, match="does not fit a 2x2 input"):
        p(np.zeros((1, 1, 2, 2), "float32"))


def test_a_corrupt_argmax_is_a_value_error_raised_after_the_kernel():
    """The kernels run without the GIL and report a code; the glue raises it afterwards."""
    x, gz, idx = pt.tensor4("x"), pt.tensor4("gz"), pt.itensor4("idx")
    g = pytensor.function([x, gz, idx], ops.Pool2dGrad("max", (2, 2), (2, 2))(x, gz, idx), mode=C)
    ok = np.zeros((1, 1, 2, 2), "int32")
    assert g(np.zeros((1, 1, 4, 4), "float32"), np.ones((1, 1, 2, 2), "float32"), ok).sum() == 4
    with pytest.raises(ValueError, match="argmax index outside the input plane"):
        g(np.zeros((1, 1, 4, 4), "float32"), np.ones((1, 1, 2, 2), "float32"), ok + 16)


def test_the_kernels_release_the_gil_for_another_thread():
    """A Python thread keeps running while a convolution computes: the longest stretch it is
    held up is far shorter than the convolution (with the GIL held: the whole call)."""
    import threading
    import time

    x, w = pt.tensor4("x"), pt.tensor4("w")
    f = pytensor.function([x, w], ops.conv2d(x, w, pad=(1, 1)), mode=C)
    xv = R.standard_normal((64, 32, 28, 28)).astype("float32")
    wv = R.standard_normal((64, 32, 3, 3)).astype("float32")
    f(xv, wv)
    t0 = time.perf_counter()
    f(xv, wv)
    once = time.perf_counter() - t0
    calls = max(1, int(0.3 / once) + 1)  # one call of >= 0.3 s
    xv = np.concatenate([xv] * calls)

    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())

    thread = threading.Thread(target=tick)
    thread.start()
    try:
        time.sleep(0.02)
        t0 = time.perf_counter()
        f(xv, wv)
        t1 = time.perf_counter()
    finally:
        stop.set()
        thread.join()
    inside = [t for t in ticks if t0 <= t <= t1]
    gaps = np.diff([t0, *inside, t1])
    assert gaps.max() < 0.5 * (t1 - t0), (gaps.max(), t1 - t0)
