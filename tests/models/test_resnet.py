"""ResNet-50: parameter count and names, the config, BatchNorm's running statistics against numpy,
the residual add, and a reduced ResNet-50 training on the photo-like data."""

from __future__ import annotations

import numpy as np
import pytest

from theanompi.config import load_config
from theanompi.errors import ConfigError
from theanompi.models import create_model
from theanompi.models.layers import BatchNorm, Conv2D, Residual, Sequential

FULL = dict(name="resnet50", input_size=224, channels=3, n_classes=1000)


def test_full_size_has_torchvision_parameter_count_without_compiling():
    m = create_model(FULL)
    assert m.n_params() == 25_557_032  # torchvision.models.resnet50()
    names = [p.name for p in m.params]
    assert names[:3] == ["conv1.W", "bn1.gamma", "bn1.beta"] and names[-2:] == ["fc.W", "fc.b"]
    assert "layer4.2.conv3.W" in names and "layer2.0.downsample.0.W" in names
    assert not any(n.endswith(".b") for n in names[:-1])  # convs carry no bias
    # 53 BN layers (49 in blocks + 4 downsample): running mean and var each, not parameters
    assert len(m.buffers) == 2 * 53 and {b.name for b in m.buffers}.isdisjoint(names)
    # v1.5: the stride of a stage's first block is on its 3x3 conv
    convs = {c.name: c for c in _layers(m.net) if isinstance(c, Conv2D)}
    assert convs["layer2.0.conv1"].s == (1, 1) and convs["layer2.0.conv2"].s == (2, 2)
    assert convs["layer2.0.downsample.0"].s == (2, 2)


def _layers(layer):
    yield layer
    for child in getattr(layer, "layers", []):
        yield from _layers(child)
    for attr in ("main", "shortcut"):
        if getattr(layer, attr, None) is not None:
            yield from _layers(getattr(layer, attr))


def test_config_validates_and_names_agree(tmp_path):
    run = tmp_path / "config.yaml"
    run.write_text("data:\n  image_size: 256\n  file_batch_size: 128\n")
    cfg = load_config(run, model="resnet50")
    assert cfg.model.name == "resnet50" and cfg.model.input_size == 224
    assert cfg.model.learning_rate == pytest.approx(0.1 * cfg.model.batch_size / 256)
    with pytest.raises(ConfigError, match="zero_init_residual must be bool"):
        create_model({**FULL, "arch": {"zero_init_residual": 1}})


def test_zero_init_residual_zeroes_each_blocks_last_gamma():
    m = create_model(
        {**FULL, "input_size": 32, "arch": {"width": 0.0625, "zero_init_residual": True}}
    )
    gammas = {p.name: p.get_value() for p in m.params if p.name.endswith("gamma")}
    assert all((v == 0).all() for k, v in gammas.items() if k.endswith("bn3.gamma"))
    assert (gammas["layer1.0.bn2.gamma"] == 1).all() and (gammas["bn1.gamma"] == 1).all()


def test_batchnorm_matches_numpy_in_training_and_evaluation():
    """Batch statistics in training, running statistics (momentum 0.1, the batch's biased
    variance) moved by each training step, and used by evaluation."""
    import pytensor
    import pytensor.tensor as pt

    bn = BatchNorm((3, 4, 5), momentum=0.1, name="bn")
    rng = np.random.default_rng(0)
    bn.gamma.set_value(rng.uniform(0.5, 2, 3).astype(np.float32))
    bn.beta.set_value(rng.normal(0, 1, 3).astype(np.float32))
    x = pt.tensor4("x", dtype="float32")
    train = pytensor.function([x], bn(x, train=True), updates=bn.updates)
    evaluate = pytensor.function([x], bn(x, train=False))
    g, b = bn.gamma.get_value().astype(np.float64), bn.beta.get_value().astype(np.float64)
    run_mean, run_var = np.zeros(3), np.ones(3)
    for step in range(3):
        xv = rng.normal(step, 3, (6, 3, 4, 5)).astype(np.float32)
        x64 = xv.astype(np.float64)
        mu, var = x64.mean(axis=(0, 2, 3)), x64.var(axis=(0, 2, 3))
        want = (x64 - mu[:, None, None]) / np.sqrt(var[:, None, None] + 1e-5)
        want = want * g[:, None, None] + b[:, None, None]
        np.testing.assert_allclose(train(xv), want, rtol=1e-4, atol=1e-4)
        run_mean = 0.9 * run_mean + 0.1 * mu
        run_var = 0.9 * run_var + 0.1 * var
        np.testing.assert_allclose(bn.mean.get_value(), run_mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(bn.var.get_value(), run_var, rtol=1e-5, atol=1e-6)
    xv = rng.normal(0, 1, (2, 3, 4, 5)).astype(np.float32)
    want = (xv - run_mean[:, None, None]) / np.sqrt(run_var[:, None, None] + 1e-5)
    want = want * g[:, None, None] + b[:, None, None]
    np.testing.assert_allclose(evaluate(xv), want, rtol=1e-4, atol=1e-4)


def test_residual_adds_the_branches_and_checks_shapes():
    import pytensor
    import pytensor.tensor as pt

    main = Sequential((2, 3, 3), "m").add(Conv2D, 2, 1, bias=False, name="c")
    main.layers[0].W.set_value(np.eye(2, dtype=np.float32).reshape(2, 2, 1, 1) * 2)
    x = pt.tensor4("x", dtype="float32")
    f = pytensor.function([x], Residual((2, 3, 3), main, name="r")(x))
    xv = np.arange(36, dtype=np.float32).reshape(2, 2, 3, 3)
    np.testing.assert_allclose(f(xv), 3 * xv)  # 2x (the conv) + x (identity)
    wide = Sequential((2, 3, 3), "w").add(Conv2D, 4, 1, name="c4")
    with pytest.raises(ValueError, match="same shape"):
        Residual((2, 3, 3), wide, name="bad")


def test_reduced_resnet50_trains_on_photos(photos):
    """width 1/16 at 64x64 (the full depth: 53 BN layers, 16 blocks): a few SGD steps on
    photo-like JPEGs give finite losses that go down, and the running statistics move."""
    x, y = photos(64, 32, 4, seed=3)
    sec = {
        "name": "resnet50",
        "input_size": 64,
        "channels": 3,
        "n_classes": 4,
        "batch_size": 16,
        "learning_rate": 0.05,
        "arch": {"width": 0.0625},
    }
    m = create_model(sec).build(16)
    before = [b.get_value().copy() for b in m.buffers]
    ev0 = m.val_step(x[:16], y[:16])[0]
    losses = []
    for step in range(12):
        i = (step % 2) * 16
        loss, err = m.train_step(x[i : i + 16], y[i : i + 16])
        assert np.isfinite(loss) and 0.0 <= err <= 1.0
        losses.append(loss)
    assert np.mean(losses[-4:]) < np.mean(losses[:4]), losses
    moved = [not np.array_equal(a, b.get_value()) for a, b in zip(before, m.buffers, strict=True)]
    assert all(moved)
    ev1 = m.val_step(x[:16], y[:16])[0]  # evaluation: the running statistics
    assert np.isfinite(ev0) and np.isfinite(ev1)


def test_batchnorm_ops_gradients_match_finite_differences():
    """The training Op's hand-written gradient and the evaluation Op's, in float64."""
    from pytensor.gradient import verify_grad

    from theanompi.models.ops.batchnorm import batch_norm_infer, batch_norm_train

    rng = np.random.default_rng(0)
    x = rng.normal(1, 2, (4, 3, 2, 2))
    g, b = rng.uniform(0.5, 2, 3), rng.normal(0, 1, 3)
    rm, rv = rng.normal(0, 1, 3), rng.uniform(0.5, 2, 3)
    verify_grad(lambda x, g, b: batch_norm_train(x, g, b, rm, rv)[0], [x, g, b], rng=rng)
    verify_grad(lambda x, g, b, m, v: batch_norm_infer(x, g, b, m, v), [x, g, b, rm, rv], rng=rng)


def test_batchnorm_ops_under_jax_match_the_c_backend():
    """training.backend jax: the same outputs, gradients, running statistics and evaluation."""
    pytest.importorskip("jax")
    import pytensor
    import pytensor.tensor as pt

    from theanompi.models.ops import compile_mode

    jax_mode = compile_mode("jax")  # registers every Op of ours with JAX, batch norm included
    rng = np.random.default_rng(0)
    xv = rng.normal(1, 3, (8, 3, 4, 4)).astype(np.float32)
    proj = rng.normal(0, 1, xv.shape).astype(np.float32)  # dx of a plain sum would be ~0
    got = {}
    for name, mode in (("c", None), ("jax", jax_mode)):
        bn = BatchNorm((3, 4, 4), name="bn")
        bn.gamma.set_value(np.array([0.5, 1.5, 2], np.float32))
        x = pt.tensor4("x", dtype="float32")
        y = bn(x, train=True)
        cost = (y * proj).sum()
        grads = pytensor.grad(cost, [x, bn.gamma, bn.beta])
        train = pytensor.function([x], [y, *grads], updates=bn.updates, mode=mode)
        outs = [np.asarray(v) for v in train(xv)]
        evaluate = pytensor.function([x], bn(x, train=False), mode=mode)
        got[name] = [*outs, bn.mean.get_value(), bn.var.get_value(), np.asarray(evaluate(xv))]
    for a, b in zip(got["c"], got["jax"], strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * float(np.abs(a).max()) + 1e-6)
