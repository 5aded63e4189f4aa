"""small_cnn: shapes, parameter count, one SGD step, and learning the real digits data."""

from __future__ import annotations

import time

import numpy as np
import pytest

from theanompi.config import load_config
from theanompi.errors import ConfigError
from theanompi.models import create_model

SECTION = dict(name="small_cnn", input_size=28, channels=3, n_classes=10, batch_size=32)


@pytest.fixture(scope="module")
def digits_model(run_config):
    cfg = load_config(run_config, model="digits")
    return create_model(cfg.model).build(cfg.model.batch_size), cfg.model


def test_digits_yaml_validates_and_builds_small_cnn(run_config):
    cfg = load_config(run_config, model="digits")
    m = cfg.model
    assert m.name == "small_cnn" and (m.input_size, m.channels, m.n_classes) == (28, 3, 10)
    assert 128 % m.batch_size == 0
    model = create_model(m)
    assert model.input_shape == (3, 28, 28) and model.n_classes == 10
    names = [p.name for p in model.params]
    assert len(set(names)) == len(names) and names[:2] == ["conv1.W", "conv1.b"]
    assert model.n_params() == (3 * 9 + 1) * 32 + (32 * 9 + 1) * 64 + (64 * 49 + 1) * 128 + 129 * 10
    assert [s.get_value().shape for s in model.opt_state] == [
        p.get_value().shape for p in model.params
    ]
    assert [g.get_value().shape for g in model.grads] == [p.get_value().shape for p in model.params]


def test_bad_arch_key_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown key 'chanels'.*valid keys"):
        create_model({**SECTION, "arch": {"chanels": [8]}})
    with pytest.raises(ConfigError, match="arch.fc must be int"):
        create_model({**SECTION, "arch": {"fc": "big"}})


def test_small_cnn_learns_digits(digits_model, digits, crops):
    """>= 90% held-out top-1 after 3 epochs of real digits (random 28x28 crops)."""
    model, sec = digits_model
    xtr, ytr, xva, yva = digits
    rng = np.random.default_rng(1)
    b = sec.batch_size
    x0, y0 = xtr[:b, :, 2:30, 2:30], ytr[:b]
    loss_before = model.val_step(x0, y0)[0]
    t0 = time.perf_counter()
    for epoch in range(3):
        model.adjust_hyperparams(epoch)
        perm = rng.permutation(len(ytr))
        for i in range(0, len(perm) - b + 1, b):
            idx = perm[i : i + b]
            loss, err = model.train_step(crops(xtr[idx], 28, rng), ytr[idx])
            assert np.isfinite(loss) and 0.0 <= err <= 1.0
    train_s = time.perf_counter() - t0
    assert model.val_step(x0, y0)[0] < loss_before
    n = len(yva) // b * b
    errs = [model.val_step(xva[i : i + b, :, 2:30, 2:30], yva[i : i + b]) for i in range(0, n, b)]
    top1 = 1.0 - float(np.mean([e[1] for e in errs]))
    assert top1 >= 0.90, f"val top-1 {top1:.3f} after 3 epochs ({train_s:.1f}s)"
    probs = model.predict(xva[:5, :, 2:30, 2:30])
    assert probs.shape == (5, 10) and probs.dtype == np.float32
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-5)
    assert (probs.argmax(axis=1) == yva[:5]).mean() >= 0.6


def test_compute_then_apply_grads_equals_train_step(digits):
    """compute_grads + apply_grads is the same update as train_step (no dropout: p=0)."""
    sec = {**SECTION, "arch": {"dropout": 0.0, "channels": [4], "fc": 8}}
    a, b = create_model(sec).build(8), create_model(sec).build(8)
    xtr, ytr, *_ = digits
    x, y = xtr[:8, :, :28, :28], ytr[:8]
    for _ in range(2):
        la = a.train_step(x, y)
        lb = b.compute_grads(x, y)
        b.apply_grads()
        np.testing.assert_allclose(la, lb, rtol=1e-5)
    for pa, pb in zip(a.params, b.params, strict=True):
        np.testing.assert_allclose(pa.get_value(), pb.get_value(), rtol=1e-4, atol=1e-6)
    assert any(np.abs(g.get_value()).sum() > 0 for g in b.grads)


def test_lr_step_policy():
    m = create_model({**SECTION, "learning_rate": 0.1, "lr_step": [2, 4], "lr_gamma": 0.5})
    got = []
    for e in range(6):
        m.adjust_hyperparams(e)
        got.append(float(m.lr.get_value()))
    np.testing.assert_allclose(got, [0.1, 0.1, 0.05, 0.05, 0.025, 0.025], rtol=1e-6)
    f = create_model({**SECTION, "learning_rate": 0.1, "lr_policy": "fixed", "lr_step": [1]})
    f.adjust_hyperparams(5)
    assert float(f.lr.get_value()) == pytest.approx(0.1)
