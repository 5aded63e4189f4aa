"""Models: published parameter counts, output shapes, one SGD step lowers the loss, factory."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from pytensor.compile.mode import Mode

from theanompi.config import load_config
from theanompi.errors import ConfigError
from theanompi.models import MODELS, create_model


@pytest.mark.parametrize(
    "name,size,published,flops",
    [
        ("alexnet", 227, 60_965_224, 1.45e9),  # Krizhevsky et al. 2012 (two-GPU groups): ~61 M
        ("vgg16", 224, 138_357_544, 30.9e9),  # Simonyan & Zisserman 2014, config D: ~138 M
        ("googlenet", 224, 6_998_552, 3.17e9),  # Szegedy et al. 2014, no aux heads: ~7.0 M
    ],
)
def test_full_size_parameter_count_and_shapes(name, size, published, flops):
    """Built at full size (no compile): count, unique names, shape chain, forward FLOPs."""
    m = create_model({"name": name, "input_size": size, "channels": 3, "n_classes": 1000})
    assert m.n_params() == published
    assert m.net.in_shape == (3, size, size) and m.net.out_shape == (1000,)
    names = [p.name for p in m.params]
    assert len(names) == len(set(names)) and all(p.dtype == "float32" for p in m.params)
    assert len(m.opt_state) == len(m.grads) == len(m.params)
    assert m.flops_per_image() == pytest.approx(flops, rel=0.01)
    del m
    gc.collect()


def test_alexnet_layer_shapes_match_the_paper():
    m = create_model(
        {
            "name": "alexnet",
            "input_size": 227,
            "channels": 3,
            "n_classes": 1000,
            "arch": {"fc_units": 8},
        }
    )
    shapes = {layer.name: layer.out_shape for layer in m.net.layers}
    assert shapes["conv1"] == (96, 55, 55) and shapes["pool1"] == (96, 27, 27)
    assert shapes["conv2"] == (256, 27, 27) and shapes["pool2"] == (256, 13, 13)
    assert shapes["conv3"] == (384, 13, 13) and shapes["conv4"] == (384, 13, 13)
    assert shapes["pool5"] == (256, 6, 6)
    groups = {layer.name: layer.groups for layer in m.net.layers if hasattr(layer, "groups")}
    assert groups == {"conv1": 1, "conv2": 2, "conv3": 1, "conv4": 2, "conv5": 2}


TINY = {
    "alexnet": dict(input_size=67, arch={"width": 0.0625, "fc_units": 32}),
    "vgg16": dict(input_size=32, arch={"width": 0.0625, "fc_units": 16}),
    "googlenet": dict(input_size=32, arch={"width": 0.0625}),
    "mlp": dict(input_size=8, arch={"hidden": [32, 16], "dropout": 0.2}),
}


# the C compile of a whole net takes minutes cold; small_cnn/mlp cover the C path end to end
# (test_small_cnn.py, "mlp" here) and test_layers.py compiles conv+LRN+pool in C. The deeper
# nets run the very same graph on PyTensor's Python linker (numpy perform, no gcc).
PY = Mode(linker="py", optimizer="fast_compile")
SLOW = {"googlenet", "vgg16"}  # minutes of graph rewriting even on the Python linker


@pytest.mark.parametrize(
    "name",
    [n if n not in SLOW else pytest.param(n, marks=pytest.mark.slow) for n in sorted(TINY)],
)
def test_tiny_variant_output_shape_and_one_sgd_step_lowers_loss(name):
    sec = {"name": name, "channels": 3, "n_classes": 10, "learning_rate": 0.01, **TINY[name]}
    m = create_model(sec).build(8, mode=None if name == "mlp" else PY)
    rng = np.random.default_rng(0)
    x = rng.normal(0, 60, (8, *m.input_shape)).astype(np.float32)
    y = rng.integers(0, 10, 8).astype(np.int32)
    probs = m.predict(x)
    assert probs.shape == (8, 10) and np.allclose(probs.sum(axis=1), 1, rtol=1e-5)
    before = m.val_step(x, y)
    assert len(before) == 3 and before[0] > 0 and 0 <= before[2] <= before[1] <= 1
    loss, err = m.train_step(x, y)
    assert np.isfinite(loss) and 0 <= err <= 1
    after = m.val_step(x, y)[0]
    assert after < before[0], f"{name}: loss {before[0]:.4f} -> {after:.4f} after one step"


@pytest.mark.parametrize(
    "yaml_name,model_name",
    [
        ("alexnet", "alexnet"),
        ("googlenet", "googlenet"),
        ("vgg16", "vgg16"),
        ("customized", "mlp"),
        ("digits", "small_cnn"),
    ],
)
def test_model_yamls_validate(tmp_path, yaml_name, model_name):
    run = tmp_path / "config.yaml"
    run.write_text("data:\n  image_size: 256\n  file_batch_size: 128\n")
    cfg = load_config(run, model=yaml_name)
    assert cfg.model.name == model_name
    assert 128 % cfg.model.batch_size == 0
    arch_keys = set(MODELS.get(model_name).ARCH_DEFAULTS) | {"seed", "input_scale"}
    assert set(cfg.model.arch) <= arch_keys


def test_customized_yaml_builds_its_mlp(tmp_path):
    run = tmp_path / "config.yaml"
    run.write_text("data:\n  image_size: 32\n  file_batch_size: 128\n")
    cfg = load_config(run, model="customized")
    m = create_model(cfg.model)
    hidden = cfg.model.arch["hidden"]
    assert [p.get_value().shape[1] for p in m.params[::2]] == [*hidden, cfg.model.n_classes]


def test_factory_errors():
    with pytest.raises(
        ConfigError,
        match=r"unknown model 'resnet' \(did you mean 'resnet50'\?\); choose from 'alexnet', 'googlenet'",
    ):
        create_model({"name": "resnet"})
    with pytest.raises(ConfigError, match="has no 'name'"):
        create_model({"input_size": 28})
    with pytest.raises(ConfigError, match="model.input_size must be a positive int"):
        create_model({"name": "mlp", "input_size": 0})
    with pytest.raises(ConfigError, match="does not fit input"):
        create_model({"name": "alexnet", "input_size": 8, "n_classes": 10})
    with pytest.raises(ConfigError, match="arch.hidden must be a list of positive ints"):
        create_model({"name": "mlp", "arch": {"hidden": [0]}})


@pytest.mark.parametrize(
    "name,arch,message",
    [
        ("alexnet", {"width": 0.0}, "model.arch.width must be > 0, got 0.0"),
        ("vgg16", {"fc_units": 0}, "model.arch.fc_units must be >= 1, got 0"),
        ("googlenet", {"dropout": 1.0}, "model.arch.dropout must be in [0, 1), got 1.0"),
        ("mlp", {"dropout": -0.1}, "model.arch.dropout must be in [0, 1), got -0.1"),
        ("small_cnn", {"dropout": 1}, "model.arch.dropout must be in [0, 1), got 1"),
    ],
)
def test_shared_arch_ranges_give_one_line(name, arch, message):
    from theanompi.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        create_model({"name": name, "channels": 3, "n_classes": 10, "input_size": 32, "arch": arch})
    assert str(info.value) == message
