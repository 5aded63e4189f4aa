"""A multi-layer perceptron whose hidden sizes come from ``arch.hidden``."""

from __future__ import annotations

from typing import Any

from theanompi.errors import ConfigError
from theanompi.models.base import Model
from theanompi.models.layers import Dense, Dropout, Flatten, Layer, ReLU, Sequential

__all__ = ["MLP"]


class MLP(Model):
    """``flatten -> [fc -> relu -> dropout] x len(hidden) -> fc``.

    ``arch`` keys: ``hidden`` (list of layer sizes, default ``[512, 256]``), ``dropout``
    (0.0), ``seed`` and ``input_scale``.

    Examples
    --------
    >>> m = MLP({"name": "mlp", "input_size": 8, "channels": 1, "n_classes": 10,
    ...          "arch": {"hidden": [32]}})
    >>> m.n_params() == 64 * 32 + 32 + 32 * 10 + 10
    True
    """

    name = "mlp"
    ARCH_DEFAULTS: dict[str, Any] = {"hidden": [512, 256], "dropout": 0.0}

    def build_network(self) -> Layer:
        hidden, p = self.arch["hidden"], self.arch["dropout"]
        if not all(isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in hidden):
            raise ConfigError(f"model.arch.hidden must be a list of positive ints, got {hidden!r}")
        net = Sequential(self.input_shape, "mlp").add(Flatten)
        for i, h in enumerate(hidden, 1):
            net.add(Dense, h, name=f"fc{i}", rng=self.rng).add(ReLU, name=f"relu{i}")
            if p:
                net.add(Dropout, p, seed=int(self.arch["seed"]) + i, name=f"drop{i}")
        net.add(Dense, self.n_classes, name="out", rng=self.rng)
        return net
