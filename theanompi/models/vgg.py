"""VGG-16 (Simonyan & Zisserman 2014, configuration D)."""

from __future__ import annotations

from typing import Any

from theanompi.models.base import Model, scaled_width
from theanompi.models.layers import Conv2D, Dense, Dropout, Layer, MaxPool2D, ReLU, Sequential

__all__ = ["VGG16"]

_CFG_D = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]


class VGG16(Model):
    """13 3x3 conv layers (pad 1) in 5 blocks with 2x2 max-pools, then 3 fc layers.

    138,357,544 parameters at 224x224 and 1000 classes. ``arch`` keys: ``width`` (channel
    multiplier, 1.0), ``fc_units`` (4096), ``dropout`` (0.5), ``fc_std`` (0.01), ``seed``,
    ``input_scale``.

    Initialisation: conv layers He-normal, fc6-fc8 N(0, ``fc_std``) (Caffe's VGG and
    torchvision's), all biases 0. ``fc_std: 0`` gives the fc layers He-normal too: at lr 0.01
    and 4096 fc units that net dies (every ReLU off, constant output) within ~10 steps on
    photo-like data (docs/models.md, "VGG-16 recipe").

    Examples
    --------
    >>> m = VGG16({"name": "vgg16", "input_size": 32, "channels": 3, "n_classes": 10,
    ...            "arch": {"width": 0.0625, "fc_units": 16}})
    >>> m.net.out_shape, m.params[-2].name
    ((10,), 'fc8.W')
    """

    name = "vgg16"
    ARCH_DEFAULTS: dict[str, Any] = {"width": 1.0, "fc_units": 4096, "dropout": 0.5, "fc_std": 0.01}

    def build_network(self) -> Layer:
        a = self.arch
        if not a["fc_std"] >= 0:
            raise ValueError(f"arch.fc_std must be >= 0 (0: He init), got {a['fc_std']!r}")
        fc_std = float(a["fc_std"]) or None  # None: He-normal
        net = Sequential(self.input_shape, "vgg16")
        block, idx = 1, 1
        for v in _CFG_D:
            if v == "M":
                net.add(MaxPool2D, 2, name=f"pool{block}")
                block, idx = block + 1, 1
                continue
            f = scaled_width(v, a["width"])
            net.add(Conv2D, f, 3, pad=1, name=f"conv{block}_{idx}", rng=self.rng)
            net.add(ReLU, name=f"relu{block}_{idx}")
            idx += 1
        for i in (6, 7):
            net.add(Dense, a["fc_units"], name=f"fc{i}", rng=self.rng, std=fc_std)
            net.add(ReLU, name=f"relu{i}")
            if a["dropout"]:
                net.add(Dropout, a["dropout"], seed=int(a["seed"]) + i, name=f"drop{i}")
        net.add(Dense, self.n_classes, name="fc8", rng=self.rng, std=fc_std)
        return net
