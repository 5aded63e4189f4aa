"""AlexNet as trained by Theano-MPI / theano_alexnet (Krizhevsky et al. 2012, two-GPU groups)."""

from __future__ import annotations

from typing import Any

from theanompi.models.base import Model
from theanompi.models.layers import LRN, Conv2D, Dense, Dropout, Layer, MaxPool2D, ReLU, Sequential

__all__ = ["AlexNet"]

# (filters, kernel, stride, pad, groups, lrn, pool)
_CONVS = [
    (96, 11, 4, 0, 1, True, True),
    (256, 5, 1, 2, 2, True, True),
    (384, 3, 1, 1, 1, False, False),
    (384, 3, 1, 1, 2, False, False),
    (256, 3, 1, 1, 2, False, True),
]


class AlexNet(Model):
    """227x227 input, 5 conv + 3 fc layers, groups=2 on conv2/4/5, LRN after conv1/2.

    Layer order per block: conv -> ReLU -> LRN (n=5, k=2, alpha=1e-4, beta=0.75) ->
    3x3 stride-2 max-pool; fc6/fc7 have 4096 units with dropout 0.5; 60,965,224 parameters
    at 1000 classes. ``arch`` keys: ``width`` (multiplier of the conv channel counts, 1.0),
    ``fc_units`` (4096), ``dropout`` (0.5), ``lrn`` (True), ``seed``, ``input_scale``.

    Examples
    --------
    >>> m = AlexNet({"name": "alexnet", "input_size": 67, "channels": 3, "n_classes": 10,
    ...              "arch": {"width": 0.0625, "fc_units": 32}})
    >>> m.net.out_shape, [p.name for p in m.params][:3]
    ((10,), ['conv1.W', 'conv1.b', 'conv2.W'])
    """

    name = "alexnet"
    ARCH_DEFAULTS: dict[str, Any] = {"width": 1.0, "fc_units": 4096, "dropout": 0.5, "lrn": True}

    def build_network(self) -> Layer:
        a = self.arch
        net = Sequential(self.input_shape, "alexnet")
        for i, (f, k, s, p, g, lrn, pool) in enumerate(_CONVS, 1):
            f = max(g, int(round(f * a["width"] / g)) * g)
            net.add(Conv2D, f, k, stride=s, pad=p, groups=g, name=f"conv{i}", rng=self.rng)
            net.add(ReLU, name=f"relu{i}")
            if lrn and a["lrn"]:
                net.add(LRN, n=5, k=2.0, alpha=1e-4, beta=0.75, name=f"lrn{i}")
            if pool:
                net.add(MaxPool2D, 3, stride=2, name=f"pool{i}")
        for i in (6, 7):
            net.add(Dense, a["fc_units"], name=f"fc{i}", rng=self.rng).add(ReLU, name=f"relu{i}")
            if a["dropout"]:
                net.add(Dropout, a["dropout"], seed=int(a["seed"]) + i, name=f"drop{i}")
        net.add(Dense, self.n_classes, name="fc8", rng=self.rng)
        return net
