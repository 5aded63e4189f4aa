"""``training.backend: jax``: the small CNN trains like the C backend, its parameters stay on the
device between steps, checkpoints move between backends, and the digits demo learns at N=2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from theanompi.io.checkpoint import apply_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402
from theanompi.launch.testing import tmpi  # noqa: E402
from theanompi.models import create_model  # noqa: E402
from theanompi.models.params import (  # noqa: E402
    ParamBuffer,
    get_values,
    on_device,
    set_values,
    to_device,
)

# the digits demo's small CNN (configs/digits.yaml) without dropout: JAX draws other masks
SECTION = {
    "name": "small_cnn",
    "input_size": 28,
    "channels": 3,
    "n_classes": 10,
    "batch_size": 32,
    "learning_rate": 0.02,
    "arch": {"channels": [32, 64], "fc": 128, "dropout": 0.0},
}
B = SECTION["batch_size"]


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray]:
    """sklearn digits as (n, 3, 28, 28) float32 in 0..255 units (mean-subtracted), int32 labels."""
    from sklearn.datasets import load_digits

    d = load_digits()
    img = np.kron(d.images.astype(np.float32) * np.float32(255 / 16), np.ones((4, 4), np.float32))
    x = np.repeat(img[:, None, 2:30, 2:30], 3, axis=1)
    return np.ascontiguousarray(x - x.mean(axis=0)), d.target.astype(np.int32)


@pytest.fixture(scope="module")
def models() -> dict[str, object]:
    """One small CNN per backend, both from the same initial values."""
    return {be: create_model(SECTION).build(B, backend=be) for be in ("c", "jax")}


def _batches(x: np.ndarray, y: np.ndarray, n: int):
    order = np.random.default_rng(0).permutation(len(y))
    for i in range(n):
        idx = order[i * B : (i + 1) * B]
        yield x[idx], y[idx]


def test_jax_follows_the_c_backend_for_20_steps(models, digits):
    c, j = models["c"], models["jax"]
    for a, b in zip(get_values(c.params), get_values(j.params), strict=True):
        np.testing.assert_array_equal(a, b)
    losses = {"c": [], "jax": []}
    for step, (x, y) in enumerate(_batches(*digits, 20)):
        for be, m in models.items():
            fn = m.train_step if step % 2 else m.compute_grads  # both update paths
            losses[be].append(fn(x, y)[0])
            if step % 2 == 0:
                m.apply_grads()
    c_loss, j_loss = np.array(losses["c"]), np.array(losses["jax"])
    assert c_loss[-1] < 0.7 * c_loss[0]  # it learns (the comparison is not between two stalls)
    np.testing.assert_allclose(j_loss, c_loss, rtol=0, atol=1e-4)
    x, y = digits[0][-64:], digits[1][-64:]
    np.testing.assert_allclose(j.val_step(x, y), c.val_step(x, y), rtol=0, atol=1e-4)
    np.testing.assert_allclose(j.predict(x[:5]), c.predict(x[:5]), rtol=0, atol=1e-5)


def test_a_jax_step_moves_nothing_but_the_batch_and_the_metrics(models, digits):
    m = models["jax"]
    x, y = next(_batches(*digits, 1))
    m.train_step(x, y)
    state = m.params + m.opt_state + m.grads + [m.lr]
    assert all(on_device(v.get_value(borrow=True)) for v in state)
    xd, yd = m._xy(x, y)  # the batch in: the one host-to-device copy of a step
    for key in ("train", "grads", "apply"):
        with jax.transfer_guard("disallow"):  # raises on any implicit or explicit copy
            outs = m._fn(key)(*((xd, yd) if key != "apply" else ()))
        assert all(on_device(o) for o in outs)  # loss and error leave the device afterwards
    assert all(on_device(v.get_value(borrow=True)) for v in state)
    with pytest.raises(ValueError, match="compiled the training step for batches of 32, got 5"):
        m.train_step(x[:5], y[:5])


def test_the_exchange_copies_device_values_to_host_and_back(models):
    """What the rules do once per step: device -> numpy (ParamBuffer / get_values), then back."""
    m = models["jax"]
    before = [np.array(a) for a in get_values(m.params)]
    buf = ParamBuffer(m.params)
    flat = buf.gather()
    assert isinstance(flat, np.ndarray) and flat.size == m.n_params()
    buf.scatter(flat * 2)
    for v, a in zip(m.params, before, strict=True):
        assert on_device(v.get_value(borrow=True))
        np.testing.assert_array_equal(np.asarray(v.get_value(borrow=True)), a * 2)
    arrays = get_values(m.params)
    assert all(isinstance(a, np.ndarray) and a.flags.writeable for a in arrays)
    set_values(m.params, before)
    assert all(on_device(v.get_value(borrow=True)) for v in m.params)
    np.testing.assert_array_equal(get_values(m.params)[0], before[0])


@pytest.mark.parametrize("src,dst", [("c", "jax"), ("jax", "c")])
def test_checkpoints_move_between_backends(models, digits, tmp_path: Path, src, dst):
    a, b = models[src], create_model(SECTION).build(B, backend=dst)
    path = save_checkpoint(tmp_path / "ck.npz", a, {"epoch": 1, "step": 20})
    apply_checkpoint(b, load_checkpoint(path))
    for u, v in zip(
        get_values(a.params + a.opt_state), get_values(b.params + b.opt_state), strict=True
    ):
        np.testing.assert_array_equal(u, v)
    x, y = next(_batches(*digits, 1))
    np.testing.assert_allclose(b.val_step(x, y), a.val_step(x, y), rtol=0, atol=1e-5)
    np.testing.assert_allclose(b.train_step(x, y), a.train_step(x, y), rtol=0, atol=1e-4)


@pytest.mark.slow
def test_tiny_alexnet_under_jax_follows_the_numpy_ops():
    """Groups, stride 4, LRN and overlapping pools in a whole net: 3 SGD steps under JAX match
    the same model on PyTensor's Python linker (the Ops' numpy ``perform``)."""
    from pytensor.compile.mode import Mode

    sec = {
        "name": "alexnet",
        "input_size": 67,
        "channels": 3,
        "n_classes": 10,
        "arch": {"width": 0.0625, "fc_units": 32, "dropout": 0.0},
    }
    rng = np.random.default_rng(0)
    x = rng.normal(0, 60, (8, 3, 67, 67)).astype(np.float32)
    y = rng.integers(0, 10, 8).astype(np.int32)
    j = create_model(sec).build(8, backend="jax")
    p = create_model(sec).build(8, mode=Mode(linker="py", optimizer="fast_compile"))
    steps = [(j.train_step(x, y), p.train_step(x, y)) for _ in range(3)]
    np.testing.assert_allclose(*zip(*steps, strict=True), rtol=0, atol=1e-4)
    assert steps[-1][1][0] < steps[0][1][0]  # it learns
    for a, b in zip(get_values(j.params), get_values(p.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


@pytest.mark.mpi
@pytest.mark.slow
def test_digits_demo_with_backend_jax_at_n2(digits_data: Path, tmp_path: Path):
    """The CLI end to end on the prepped demo: train BSP on 2 ranks with --backend jax
    (<= 10 % val top-1 error after 3 epochs), evaluate its checkpoint with --backend jax
    (same number)."""
    data = digits_data
    bad = tmpi("train", "--data", str(data), "--backend", "cuda")
    assert bad.returncode == 2 and "training.backend" in bad.stderr and "jax" in bad.stderr
    run = tmp_path / "run"
    common = ["--data", str(data), "--run-dir", str(run)]
    out = tmpi("train", "-n", "2", *common, "--backend", "jax", "--epochs", "3", timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    ck = load_checkpoint(run / "checkpoints" / "epoch_0003.npz")
    assert ck.meta["config"]["training"]["backend"] == "jax"
    err = float(out.stdout.split("top-1 err ")[-1].split("%")[0])
    assert err <= 10.0, out.stdout[-2000:]
    ev = tmpi("eval", "-n", "2", *common, "--backend", "jax", timeout=600)
    assert ev.returncode == 0, ev.stderr[-3000:]
    report = json.loads((run / "checkpoints" / "epoch_0003.eval.json").read_text())
    assert abs(100 * report["top1_error"] - err) <= 0.005  # as validated (printed to 0.01 %)


def test_values_put_on_the_device_do_not_follow_the_host_buffer():
    """The exchangers reuse their buffers: a value handed to the device must be a snapshot
    (JAX may alias a small host array, or copy a large one asynchronously)."""
    import pytensor

    for n in (3, 1 << 20):
        host = np.zeros(n, np.float32)
        var = pytensor.shared(host)
        to_device([var])
        host[:] = 7.0
        src = np.ones(n, np.float32)
        set_values([var], [src])
        src[:] = 5.0
        assert on_device(var.get_value(borrow=True))
        np.testing.assert_array_equal(get_values([var])[0], np.ones(n, np.float32))
