"""AlexNet's two recipes: ``theanompi`` (configs/alexnet_theanompi.yaml: Theano-MPI's init,
LRN placement and alpha, bias lr and input scaling) is built as specified and trains on the
photo-like data; ``ours`` (configs/alexnet.yaml) is unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from theanompi.config import configs_dir, load_config
from theanompi.errors import ConfigError
from theanompi.models import create_model
from theanompi.models.alexnet import RECIPES
from theanompi.models.layers import LRN, Conv2D, Dense

N_PARAMS = 60_965_224  # Krizhevsky et al. 2012 with two-GPU groups, 1000 classes

THEANOMPI_ORDER = [
    "conv1", "relu1", "pool1", "lrn1",
    "conv2", "relu2", "pool2", "lrn2",
    "conv3", "relu3", "conv4", "relu4", "conv5", "relu5", "pool5",
    "fc6", "relu6", "drop6", "fc7", "relu7", "drop7", "fc8",
]  # fmt: skip
OURS_ORDER = [  # LRN before pooling
    *("conv1", "relu1", "lrn1", "pool1", "conv2", "relu2", "lrn2", "pool2"),
    *THEANOMPI_ORDER[8:],
]


def _config(tmp_path, model: str):
    run = tmp_path / "config.yaml"
    run.write_text("data:\n  image_size: 256\n  file_batch_size: 128\n")
    return load_config(run, model=model)


@pytest.fixture(scope="module")
def full_theanompi(tmp_path_factory):
    """The full-size model of configs/alexnet_theanompi.yaml (built, not compiled)."""
    cfg = _config(tmp_path_factory.mktemp("cfg"), "alexnet_theanompi")
    return cfg, create_model(cfg.model)


def test_config_has_theanompis_schedule(full_theanompi):
    cfg, m = full_theanompi
    c = cfg.model
    assert (c.name, c.input_size, c.n_classes, c.batch_size) == ("alexnet", 227, 1000, 128)
    assert (c.learning_rate, c.lr_policy, list(c.lr_step), c.lr_gamma) == (
        0.01,
        "step",
        [20, 40, 60],
        0.1,
    )
    assert (c.momentum, c.nesterov, c.weight_decay, c.n_epochs) == (0.9, False, 0.0005, 70)
    assert m.arch["recipe"] == "theanompi" and m.arch["input_scale"] == 1.0


def test_theanompi_recipe_layers_init_and_tags(full_theanompi):
    _, m = full_theanompi
    layers = m.net.layers
    assert [layer.name for layer in layers] == THEANOMPI_ORDER
    assert m.n_params() == N_PARAMS
    for lrn in (la for la in layers if isinstance(la, LRN)):
        assert (lrn.n, lrn.k, lrn.alpha, lrn.beta, lrn.alpha_over_n) == (5, 2.0, 1e-4, 0.75, False)
        assert lrn.alpha_op == pytest.approx(5e-4)  # k + 1e-4 * sum, not k + 1e-4/5 * sum
    stds = {"conv": 0.01, "fc6": 0.005, "fc7": 0.005, "fc8": 0.01}
    biases = {"conv2": 0.1, "conv4": 0.1, "fc6": 0.1, "fc7": 0.1}
    for la in (la for la in layers if isinstance(la, (Conv2D, Dense))):
        w, b = la.W.get_value(), la.b.get_value()
        std = stds.get(la.name, stds["conv"])
        assert abs(w.mean()) < 5 * std / np.sqrt(w.size), la.name  # 5 standard errors
        assert w.std() == pytest.approx(std, rel=max(0.02, 5 / np.sqrt(2 * w.size))), la.name
        np.testing.assert_array_equal(b, np.float32(biases.get(la.name, 0.0)), err_msg=la.name)
        assert (la.W.tag.regularizable, la.W.tag.lr_mult) == (True, 1.0), la.name
        assert (la.b.tag.regularizable, la.b.tag.lr_mult) == (False, 2.0), la.name


def test_our_recipe_is_unchanged(tmp_path):
    """configs/alexnet.yaml: LRN before pooling, He-normal init drawn as before, zero
    biases, one lr, inputs x 1/255; the same parameter count."""
    cfg = _config(tmp_path, "alexnet")
    m = create_model(cfg.model)
    assert m.arch["recipe"] == "ours" and m.arch["input_scale"] == pytest.approx(1 / 255)
    assert [layer.name for layer in m.net.layers] == OURS_ORDER
    assert m.n_params() == N_PARAMS
    # the first draw of the seed-0 generator, He-scaled: the init of before the recipes
    want = np.random.default_rng(0).standard_normal((96, 3, 11, 11), dtype=np.float32)
    want *= np.float32(np.sqrt(2.0 / 363))
    np.testing.assert_array_equal(m.params[0].get_value(), want)
    for p in m.params:
        is_w = p.name.endswith(".W")
        assert (p.tag.regularizable, p.tag.lr_mult) == (is_w, 1.0), p.name
        if not is_w:
            assert not p.get_value().any(), p.name
    lrns = [la for la in m.net.layers if isinstance(la, LRN)]
    assert [la.alpha_op for la in lrns] == [1e-4, 1e-4]
    assert set(RECIPES) == {"ours", "theanompi"}


def test_unknown_recipe_is_a_config_error():
    with pytest.raises(
        ConfigError, match=r"recipe='caffe' is unknown .* choose from ours, theanompi"
    ):
        create_model({"name": "alexnet", "input_size": 67, "arch": {"recipe": "caffe"}})
    with pytest.raises(ConfigError, match=r"model.arch.recipe must be str"):
        create_model({"name": "alexnet", "input_size": 67, "arch": {"recipe": 1}})


def test_input_scale_given_wins_over_the_recipes():
    m = create_model(
        {"name": "alexnet", "input_size": 67, "arch": {"recipe": "theanompi", "input_scale": 0.5}}
    )
    assert m.arch["input_scale"] == 0.5


def test_theanompi_recipe_trains_on_photos(photos):
    """Reduced width (1/16) at 99x99, dropout on: a few steps lower the (dropout-free) loss."""
    x, y = photos(99, 32, 10, seed=11)
    m = create_model(
        {
            "name": "alexnet",
            "input_size": 99,
            "channels": 3,
            "n_classes": 10,
            "learning_rate": 0.01,
            "momentum": 0.9,
            "weight_decay": 0.0005,
            "arch": {"recipe": "theanompi", "width": 0.0625, "fc_units": 64},
        }
    ).build(batch_size=32)
    before = m.val_step(x, y)[0]
    losses = [m.train_step(x, y)[0] for _ in range(8)]
    after = m.val_step(x, y)[0]
    print(f"theanompi recipe: val loss {before:.5f} -> {after:.5f}; train losses {losses}")
    assert np.isfinite(losses).all() and np.isfinite(after)
    assert after < before - 1e-3, (before, after, losses)
    assert losses[-1] < losses[0], losses


def test_unknown_recipe_is_one_line_from_the_cli(cli, digits_data, tmp_path):
    """A model YAML naming an unknown recipe: exit 2 (config), one line with the choices."""
    bad = tmp_path / "alexnet_bad.yaml"
    yaml = (configs_dir() / "alexnet_theanompi.yaml").read_text()
    bad.write_text(yaml.replace("recipe: theanompi", "recipe: caffe").replace("227", "32"))
    out = cli("train", "--model", str(bad), "-n", "1", "--data", str(digits_data))
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, (out.returncode, out.stderr)
    assert lines[0] == (
        "tmpi: error: model.arch.recipe='caffe' is unknown for 'alexnet'; choose from ours, theanompi"
    )
