"""Our Ops compiled by JAX agree with the C Ops (float32) and with numpy in float64, forward and
gradient, for every geometry the models use (groups, padding, stride, ceil mode, ties)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax")

import pytensor  # noqa: E402
import pytensor.tensor as pt  # noqa: E402
from pytensor.compile.mode import Mode  # noqa: E402

from theanompi.models.ops import (  # noqa: E402
    compile_mode,
    concat_channels,
    conv2d,
    lrn,
    pool2d,
)
from theanompi.models.ops.conv import Conv2d  # noqa: E402
from theanompi.models.ops.pool import Pool2d  # noqa: E402

TOL = 1e-5  # float32 agreement, relative to the largest magnitude of the reference
NUMPY64 = Mode(linker="py", optimizer="fast_compile")  # the Ops' numpy ``perform``, float64

# (id, graph builder, input shapes): every geometry the four models use, and a few more
CASES = [
    ("conv_s1_p1", lambda x, w, b: conv2d(x, w, b, pad=(1, 1)), [(2, 3, 7, 7), (4, 3, 3, 3), (4,)]),
    (
        "conv_s4_alexnet1",
        lambda x, w, b: conv2d(x, w, b, stride=(4, 4)),
        [(2, 3, 23, 23), (5, 3, 11, 11), (5,)],
    ),
    (
        "conv_groups2_s2_p2",
        lambda x, w, b: conv2d(x, w, b, stride=(2, 2), pad=(2, 1), groups=2),
        [(2, 4, 9, 8), (6, 2, 5, 3), (6,)],
    ),
    ("conv_1x1_nobias", lambda x, w: conv2d(x, w), [(3, 5, 4, 4), (7, 5, 1, 1)]),
    (
        "conv_relu",
        lambda x, w, b: Conv2d(pad=(1, 1), relu=True)(x, w, b),
        [(2, 3, 7, 7), (4, 3, 3, 3), (4,)],
    ),
    ("maxpool_3s2_ceil", lambda x: pool2d(x, (3, 3), (2, 2), ceil_mode=True), [(2, 3, 8, 8)]),
    ("maxpool_3s2_floor", lambda x: pool2d(x, (3, 3), (2, 2)), [(2, 3, 9, 7)]),
    ("maxpool_3s1_p1", lambda x: pool2d(x, (3, 3), (1, 1), pad=(1, 1)), [(2, 3, 5, 6)]),
    (
        "avgpool_3s2_p1_ceil",
        lambda x: pool2d(x, (3, 3), (2, 2), pad=(1, 1), mode="avg", ceil_mode=True),
        [(2, 3, 8, 7)],
    ),
    ("avgpool_global", lambda x: pool2d(x, (5, 5), (1, 1), mode="avg"), [(2, 4, 5, 5)]),
    ("lrn_5", lambda x: lrn(x, n=5, alpha=1e-1, beta=0.75), [(2, 7, 3, 3)]),
    ("lrn_3_k1", lambda x: lrn(x, n=3, k=1.0, alpha=0.5, beta=0.6), [(1, 4, 2, 5)]),
    (
        "concat",
        lambda a, b, c: concat_channels([a, b, c]),
        [(2, 1, 3, 3), (2, 3, 3, 3), (2, 2, 3, 3)],
    ),
]


def _inputs(shapes: list[tuple[int, ...]], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s) for s in shapes]


def _value_and_grads(build, arrays: list[np.ndarray], dtype: str, mode) -> list[np.ndarray]:
    """[forward output, d cost / d input ...] with cost = sum(out * fixed random weights)."""
    syms = [pt.tensor(f"i{k}", dtype=dtype, shape=a.shape) for k, a in enumerate(arrays)]
    out = build(*syms)
    weights = np.random.default_rng(7).standard_normal(out.type.shape).astype(dtype)
    cost = (out * weights).sum()
    fn = pytensor.function(syms, [out, *pytensor.grad(cost, syms)], mode=mode)
    return [np.asarray(v, dtype=np.float64) for v in fn(*[a.astype(dtype) for a in arrays])]


def _close(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    assert got.shape == ref.shape, what
    scale = max(1.0, float(np.abs(ref).max()))
    err = float(np.abs(got - ref).max()) / scale
    assert err <= TOL, f"{what}: max relative error {err:.2e} > {TOL}"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_jax_op_matches_c_and_numpy64(case):
    name, build, shapes = case
    arrays = _inputs(shapes)
    jax32 = _value_and_grads(build, arrays, "float32", compile_mode("jax"))
    c32 = _value_and_grads(build, arrays, "float32", compile_mode("c"))
    np64 = _value_and_grads(build, arrays, "float64", NUMPY64)
    labels = ["forward"] + [f"grad input {k}" for k in range(len(shapes))]
    for label, j, c, r in zip(labels, jax32, c32, np64, strict=True):
        _close(j, c, f"{name} {label}: jax vs C float32")
        _close(j, r, f"{name} {label}: jax float32 vs numpy float64")


@pytest.mark.parametrize("ceil_mode", [False, True])
def test_jax_max_pool_ties_pick_the_first_maximum(ceil_mode):
    """Integer inputs make many equal maxima: argmax and the gradient's target must be the
    first maximum in row-major order, exactly as in the C Op."""
    x = np.random.default_rng(3).integers(0, 3, (2, 2, 7, 7)).astype(np.float32)
    xs = pt.tensor4("x", dtype="float32", shape=x.shape)
    out, idx = Pool2d("max", (3, 3), (2, 2), (1, 1), ceil_mode)(xs)
    gx = pytensor.grad((out * np.arange(out.type.shape[-1], dtype="float32")).sum(), xs)
    res = {
        be: [
            np.asarray(v) for v in pytensor.function([xs], [out, idx, gx], mode=compile_mode(be))(x)
        ]
        for be in ("c", "jax")
    }
    for j, c in zip(res["jax"], res["c"], strict=True):
        np.testing.assert_array_equal(j, c)
    assert res["jax"][1].dtype == np.int32


def test_unknown_backend_is_a_config_error():
    from theanompi.errors import ConfigError

    with pytest.raises(
        ConfigError, match="unknown backend 'cuda'; choose from 'c', 'jax', or give"
    ):
        compile_mode("cuda")


def test_backend_jax_without_jax_names_the_extra(monkeypatch):
    import sys

    from theanompi.errors import ConfigError

    monkeypatch.setitem(sys.modules, "theanompi.models.ops.jax_ops", None)  # as if not installed
    with pytest.raises(
        ConfigError, match=r"backend 'jax' needs JAX .*pip install 'theanompi\[jax\]'"
    ):
        compile_mode("jax")
