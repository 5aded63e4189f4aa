"""A small CNN for the demo dataset (3x28x28 digit crops, 10 classes)."""

from __future__ import annotations

from typing import Any

from theanompi.errors import ConfigError
from theanompi.models.base import Model
from theanompi.models.layers import Conv2D, Dense, Dropout, Layer, MaxPool2D, ReLU, Sequential

__all__ = ["SmallCNN"]


class SmallCNN(Model):
    """``[conv3x3 -> relu -> maxpool2] x len(channels) -> fc -> relu -> dropout -> fc``.

    ``arch`` keys: ``channels`` (filters per conv block, default ``[32, 64]``), ``fc``
    (hidden units, 128), ``dropout`` (0.25), ``seed`` and ``input_scale`` (1/255).

    Examples
    --------
    >>> m = SmallCNN({"name": "small_cnn", "input_size": 28, "channels": 3, "n_classes": 10})
    >>> m.net.out_shape, m.n_params()
    ((10,), 422218)
    """

    name = "small_cnn"
    ARCH_DEFAULTS: dict[str, Any] = {"channels": [32, 64], "fc": 128, "dropout": 0.25}

    def build_network(self) -> Layer:
        a = self.arch
        chans = a["channels"]
        if not chans or not all(isinstance(c, int) and c > 0 for c in chans):
            raise ConfigError(f"model.arch.channels must be a list of positive ints, got {chans!r}")
        net = Sequential(self.input_shape, "small_cnn")
        for i, c in enumerate(chans, 1):
            net.add(Conv2D, c, 3, pad=1, name=f"conv{i}", rng=self.rng).add(ReLU, name=f"relu{i}")
            if net.out_shape[1] >= 2:
                net.add(MaxPool2D, 2, name=f"pool{i}")
        net.add(Dense, a["fc"], name="fc1", rng=self.rng).add(ReLU, name="relu_fc1")
        if a["dropout"]:
            net.add(Dropout, a["dropout"], seed=int(a["seed"]), name="drop1")
        net.add(Dense, self.n_classes, name="fc2", rng=self.rng)
        return net
