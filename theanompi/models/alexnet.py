"""AlexNet as trained by Theano-MPI / theano_alexnet (Krizhevsky et al. 2012, two-GPU groups)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from theanompi.errors import ConfigError
from theanompi.models.base import Model, scaled_width
from theanompi.models.layers import LRN, Conv2D, Dense, Dropout, Layer, MaxPool2D, ReLU, Sequential

__all__ = ["AlexNet", "Recipe", "RECIPES"]

# (filters, kernel, stride, pad, groups, lrn, pool)
_CONVS = [
    (96, 11, 4, 0, 1, True, True),
    (256, 5, 1, 2, 2, True, True),
    (384, 3, 1, 1, 1, False, False),
    (384, 3, 1, 1, 2, False, False),
    (256, 3, 1, 1, 2, False, True),
]


@dataclass(frozen=True)
class Recipe:
    """How one training recipe orders, initialises and feeds the same AlexNet.

    Attributes
    ----------
    lrn_after_pool : bool
        Block order conv -> ReLU -> pool -> LRN (else conv -> ReLU -> LRN -> pool).
    lrn_alpha_over_n : bool
        LRN divides ``alpha`` by ``n`` (Caffe) or not (pylearn2); see :class:`LRN`.
    conv_std, fc_std, out_std : float or None
        Gaussian std of the conv, fc6/fc7 and fc8 weights; ``None``: He normal.
    bias : mapping of str to float
        Initial bias per layer name (others start at 0).
    b_lr_mult : float
        Learning-rate multiplier of every bias (biases never get weight decay).
    input_scale : float
        Default ``arch.input_scale``: the factor on the mean-subtracted 0..255 input.
    """

    lrn_after_pool: bool
    lrn_alpha_over_n: bool
    conv_std: float | None
    fc_std: float | None
    out_std: float | None
    bias: Mapping[str, float] = field(default_factory=dict)
    b_lr_mult: float = 1.0
    input_scale: float = 1 / 255


#: ``arch.recipe`` -> :class:`Recipe`; the only list of recipe names
RECIPES: dict[str, Recipe] = {
    # He-normal weights, zero biases, one lr, LRN before pooling, inputs x 1/255
    "ours": Recipe(
        lrn_after_pool=False, lrn_alpha_over_n=True, conv_std=None, fc_std=None, out_std=None
    ),
    # theano_alexnet / Theano-MPI's alex_net.py + layers2.py + lib/opt.py (docs/models.md)
    "theanompi": Recipe(
        lrn_after_pool=True,
        lrn_alpha_over_n=False,
        conv_std=0.01,
        fc_std=0.005,
        out_std=0.01,
        bias={"conv2": 0.1, "conv4": 0.1, "fc6": 0.1, "fc7": 0.1},
        b_lr_mult=2.0,
        input_scale=1.0,
    ),
}


class AlexNet(Model):
    """227x227 input, 5 conv + 3 fc layers, groups=2 on conv2/4/5, LRN on conv1/2's blocks.

    Per block conv -> ReLU -> LRN (n=5, k=2, alpha=1e-4, beta=0.75) -> 3x3 stride-2
    max-pool; fc6/fc7 have 4096 units with dropout 0.5; 60,965,224 parameters at 1000
    classes. ``arch`` keys: ``recipe`` (``ours``; a name in :data:`RECIPES`), ``width``
    (multiplier of the conv channel counts, 1.0), ``fc_units`` (4096), ``dropout`` (0.5),
    ``lrn`` (True), ``seed``, ``input_scale`` (the recipe's unless given).

    ``recipe: theanompi`` is Theano-MPI's training recipe on the same architecture: LRN
    after pooling with ``alpha`` not divided by ``n``, conv weights N(0, 0.01), fc6/fc7
    N(0, 0.005), fc8 N(0, 0.01), bias 0.1 on conv2/conv4/fc6/fc7 (0 elsewhere), biases at
    twice the learning rate without weight decay, raw 0..255 input minus the mean.

    Examples
    --------
    >>> m = AlexNet({"name": "alexnet", "input_size": 67, "channels": 3, "n_classes": 10,
    ...              "arch": {"width": 0.0625, "fc_units": 32}})
    >>> m.net.out_shape, [p.name for p in m.params][:3]
    ((10,), ['conv1.W', 'conv1.b', 'conv2.W'])
    >>> t = AlexNet({"name": "alexnet", "input_size": 67, "channels": 3, "n_classes": 10,
    ...              "arch": {"recipe": "theanompi", "width": 0.0625, "fc_units": 32}})
    >>> [layer.name for layer in t.net.layers][:4], t.arch["input_scale"]
    (['conv1', 'relu1', 'pool1', 'lrn1'], 1.0)
    """

    name = "alexnet"
    ARCH_DEFAULTS: dict[str, Any] = {
        "recipe": "ours",
        "width": 1.0,
        "fc_units": 4096,
        "dropout": 0.5,
        "lrn": True,
    }

    def _check_arch(self, arch: Mapping[str, Any]) -> dict[str, Any]:
        out = super()._check_arch(arch)
        if out["recipe"] not in RECIPES:
            raise ConfigError(
                f"model.arch.recipe={out['recipe']!r} is unknown for 'alexnet'; choose from "
                f"{', '.join(RECIPES)}"
            )
        if "input_scale" not in arch:
            out["input_scale"] = RECIPES[out["recipe"]].input_scale
        return out

    def build_network(self) -> Layer:
        a = self.arch
        r = RECIPES[a["recipe"]]
        net = Sequential(self.input_shape, "alexnet")
        for i, (f, k, s, p, g, lrn, pool) in enumerate(_CONVS, 1):
            f = scaled_width(f, a["width"], g)
            name = f"conv{i}"
            net.add(
                Conv2D,
                f,
                k,
                stride=s,
                pad=p,
                groups=g,
                name=name,
                rng=self.rng,
                std=r.conv_std,
                b_init=r.bias.get(name, 0.0),
                b_lr_mult=r.b_lr_mult,
            )
            net.add(ReLU, name=f"relu{i}")
            steps = [("lrn", lrn and a["lrn"]), ("pool", pool)]
            for what, on in reversed(steps) if r.lrn_after_pool else steps:
                if on and what == "lrn":
                    net.add(
                        LRN,
                        n=5,
                        k=2.0,
                        alpha=1e-4,
                        beta=0.75,
                        name=f"lrn{i}",
                        alpha_over_n=r.lrn_alpha_over_n,
                    )
                elif on:
                    net.add(MaxPool2D, 3, stride=2, name=f"pool{i}")
        for i in (6, 7):
            name = f"fc{i}"
            net.add(
                Dense,
                a["fc_units"],
                name=name,
                rng=self.rng,
                std=r.fc_std,
                b_init=r.bias.get(name, 0.0),
                b_lr_mult=r.b_lr_mult,
            )
            net.add(ReLU, name=f"relu{i}")
            if a["dropout"]:
                net.add(Dropout, a["dropout"], seed=int(a["seed"]) + i, name=f"drop{i}")
        net.add(
            Dense,
            self.n_classes,
            name="fc8",
            rng=self.rng,
            std=r.out_std,
            b_init=r.bias.get("fc8", 0.0),
            b_lr_mult=r.b_lr_mult,
        )
        return net
