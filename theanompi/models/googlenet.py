"""GoogLeNet / Inception v1 (Szegedy et al. 2014, Caffe's bvlc_googlenet), without aux heads."""

from __future__ import annotations

from typing import Any

import numpy as np

from theanompi.models.base import Model, scaled_width
from theanompi.models.layers import (
    LRN,
    Concat,
    Conv2D,
    Dense,
    Dropout,
    GlobalAvgPool,
    Layer,
    MaxPool2D,
    ReLU,
    Sequential,
)

__all__ = ["GoogLeNet", "inception"]

# name: (1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5, pool proj); "M": 3x3/2 max-pool (ceil)
_BLOCKS: list[Any] = [
    ("3a", (64, 96, 128, 16, 32, 32)),
    ("3b", (128, 128, 192, 32, 96, 64)),
    "M",
    ("4a", (192, 96, 208, 16, 48, 64)),
    ("4b", (160, 112, 224, 24, 64, 64)),
    ("4c", (128, 128, 256, 24, 64, 64)),
    ("4d", (112, 144, 288, 32, 64, 64)),
    ("4e", (256, 160, 320, 32, 128, 128)),
    "M",
    ("5a", (256, 160, 320, 32, 128, 128)),
    ("5b", (384, 192, 384, 48, 128, 128)),
]


def inception(
    in_shape: tuple[int, ...], name: str, sizes: tuple[int, ...], rng: np.random.Generator
) -> Concat:
    """An inception module: 1x1 | 1x1->3x3 | 1x1->5x5 | 3x3 max-pool->1x1, concatenated.

    >>> inception((192, 28, 28), "3a", (64, 96, 128, 16, 32, 32), np.random.default_rng(0)).out_shape
    (256, 28, 28)
    """
    n1, r3, n3, r5, n5, pp = sizes

    def conv_relu(seq: Sequential, f: int, k: int, tag: str) -> Sequential:
        return seq.add(Conv2D, f, k, pad=k // 2, name=f"inception_{name}.{tag}", rng=rng).add(
            ReLU, name=f"inception_{name}.relu_{tag}"
        )

    b1 = conv_relu(Sequential(in_shape, f"{name}.b1"), n1, 1, "1x1")
    b3 = conv_relu(conv_relu(Sequential(in_shape, f"{name}.b3"), r3, 1, "3x3_reduce"), n3, 3, "3x3")
    b5 = conv_relu(conv_relu(Sequential(in_shape, f"{name}.b5"), r5, 1, "5x5_reduce"), n5, 5, "5x5")
    bp = Sequential(in_shape, f"{name}.bp").add(MaxPool2D, 3, 1, pad=1, name=f"{name}.pool")
    bp = conv_relu(bp, pp, 1, "pool_proj")
    return Concat(in_shape, [b1, b3, b5, bp], name=f"inception_{name}")


class GoogLeNet(Model):
    """224x224 input; stem (7x7/2 conv, pools, LRN, 1x1 and 3x3 convs), 9 inception modules,
    global average pool, dropout 0.4 and one fc layer: 6,998,552 parameters at 1000 classes.

    Max-pools use Caffe's ceil mode (112 -> 56 -> 28 -> 14 -> 7). The auxiliary classifiers
    are not built. ``arch`` keys: ``width`` (channel multiplier, 1.0), ``dropout`` (0.4),
    ``seed``, ``input_scale``.

    Examples
    --------
    >>> m = GoogLeNet({"name": "googlenet", "input_size": 32, "channels": 3, "n_classes": 10,
    ...                "arch": {"width": 0.0625}})
    >>> m.net.out_shape
    (10,)
    """

    name = "googlenet"
    ARCH_DEFAULTS: dict[str, Any] = {"width": 1.0, "dropout": 0.4}

    def build_network(self) -> Layer:
        a = self.arch

        def w(n: int) -> int:
            return scaled_width(n, a["width"])

        rng = self.rng
        net = Sequential(self.input_shape, "googlenet")
        net.add(Conv2D, w(64), 7, stride=2, pad=3, name="conv1", rng=rng).add(ReLU, name="relu1")
        net.add(MaxPool2D, 3, 2, ceil_mode=True, name="pool1").add(LRN, name="lrn1")
        net.add(Conv2D, w(64), 1, name="conv2_reduce", rng=rng).add(ReLU, name="relu2r")
        net.add(Conv2D, w(192), 3, pad=1, name="conv2", rng=rng).add(ReLU, name="relu2")
        net.add(LRN, name="lrn2").add(MaxPool2D, 3, 2, ceil_mode=True, name="pool2")
        n_pool = 2
        for blk in _BLOCKS:
            if blk == "M":
                n_pool += 1
                net.add(MaxPool2D, 3, 2, ceil_mode=True, name=f"pool{n_pool}")
            else:
                name, sizes = blk
                net.append(inception(net.out_shape, name, tuple(w(s) for s in sizes), rng))
        net.add(GlobalAvgPool, name="pool5")
        if a["dropout"]:
            net.add(Dropout, a["dropout"], seed=int(a["seed"]), name="drop5")
        net.add(Dense, self.n_classes, name="loss3.classifier", rng=rng)
        return net
