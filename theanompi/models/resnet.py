"""ResNet-50 (He et al. 2015, v1.5 as torchvision): bottleneck blocks [3, 4, 6, 3] with BatchNorm."""

from __future__ import annotations

from typing import Any

import numpy as np

from theanompi.models.base import Model, scaled_width
from theanompi.models.layers import (
    BatchNorm,
    Conv2D,
    Dense,
    GlobalAvgPool,
    Layer,
    MaxPool2D,
    ReLU,
    Residual,
    Sequential,
)

__all__ = ["ResNet50", "bottleneck", "STAGES"]

#: (blocks, bottleneck width) of the four stages; a block's output is 4x its width
STAGES: tuple[tuple[int, int], ...] = ((3, 64), (4, 128), (6, 256), (3, 512))
EXPANSION = 4


def bottleneck(
    in_shape: tuple[int, ...],
    width: int,
    stride: int,
    name: str,
    rng: np.random.Generator,
    zero_init_residual: bool = False,
) -> Sequential:
    """One bottleneck block, ``relu(bn3(conv3(relu(bn2(conv2(relu(bn1(conv1(x))))))))
    + shortcut(x))``: 1x1 (``width``) -> 3x3 (``width``, ``stride``: v1.5 strides here)
    -> 1x1 (``4 * width``); the shortcut is a 1x1 conv + BN (``downsample``) when the
    stride or the channel count changes, else the identity. Convs carry no bias. bn1 and bn2
    carry their ReLU (``BatchNorm(relu=True)``: the pre-ReLU activations are not stored).

    >>> bottleneck((64, 56, 56), 64, 1, "layer1.0", np.random.default_rng(0)).out_shape
    (256, 56, 56)
    """
    out = width * EXPANSION
    main = Sequential(in_shape, f"{name}.main")
    main.add(Conv2D, width, 1, bias=False, name=f"{name}.conv1", rng=rng)
    main.add(BatchNorm, name=f"{name}.bn1", relu=True)
    main.add(Conv2D, width, 3, stride=stride, pad=1, bias=False, name=f"{name}.conv2", rng=rng)
    main.add(BatchNorm, name=f"{name}.bn2", relu=True)
    main.add(Conv2D, out, 1, bias=False, name=f"{name}.conv3", rng=rng)
    main.add(BatchNorm, name=f"{name}.bn3", gamma_init=0.0 if zero_init_residual else 1.0)
    short = None
    if stride != 1 or in_shape[0] != out:
        short = Sequential(in_shape, f"{name}.downsample")
        short.add(Conv2D, out, 1, stride=stride, bias=False, name=f"{name}.downsample.0", rng=rng)
        short.add(BatchNorm, name=f"{name}.downsample.1")
    block = Sequential(in_shape, name)
    block.append(Residual(in_shape, main, short, name=f"{name}.add"))
    return block.add(ReLU, name=f"{name}.relu")


class ResNet50(Model):
    """224x224 input; 7x7/2 conv + BN + ReLU, 3x3/2 max-pool, 16 bottleneck blocks in
    stages of [3, 4, 6, 3], global average pool, one fc layer: 25,557,032 parameters at
    1000 classes (torchvision's ``resnet50``; BN's gamma/beta count, its running
    statistics are ``buffers``, not parameters).

    v1.5: a stage's first block strides on its 3x3 conv (torchvision, NVIDIA), not on
    the first 1x1 as in the paper's v1 (Caffe/Lasagne; same parameter count). Parameter
    names follow torchvision (``layer1.0.conv1.W``, ``layer1.0.bn1.gamma``). Convs are
    He-normal, BN gamma 1 and beta 0, the fc He-normal with bias 0. ``arch`` keys:
    ``width`` (channel multiplier, 1.0), ``zero_init_residual`` (start each block's last
    BN gamma at 0, Goyal et al. 2017; false), ``seed``, ``input_scale``.

    Examples
    --------
    >>> m = ResNet50({"name": "resnet50", "input_size": 32, "channels": 3, "n_classes": 10,
    ...               "arch": {"width": 0.0625}})
    >>> m.net.out_shape, len(m.buffers), m.buffers[0].name
    ((10,), 106, 'bn1.mean')
    """

    name = "resnet50"
    ARCH_DEFAULTS: dict[str, Any] = {"width": 1.0, "zero_init_residual": False}

    def build_network(self) -> Layer:
        a = self.arch

        def w(n: int) -> int:
            return scaled_width(n, a["width"])

        rng = self.rng
        net = Sequential(self.input_shape, "resnet50")
        net.add(Conv2D, w(64), 7, stride=2, pad=3, bias=False, name="conv1", rng=rng)
        net.add(BatchNorm, name="bn1", relu=True)
        net.add(MaxPool2D, 3, 2, pad=1, name="maxpool")
        for s, (blocks, width) in enumerate(STAGES):
            for i in range(blocks):
                stride = 2 if s > 0 and i == 0 else 1
                net.append(
                    bottleneck(
                        net.out_shape,
                        w(width),
                        stride,
                        f"layer{s + 1}.{i}",
                        rng,
                        bool(a["zero_init_residual"]),
                    )
                )
        net.add(GlobalAvgPool, name="avgpool")
        net.add(Dense, self.n_classes, name="fc", rng=rng)
        return net
