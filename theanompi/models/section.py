"""The model config's keys (configs/<model>.yaml): what every :class:`~theanompi.models.base.Model`
is built from, declared once with :func:`theanompi.schema.key`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from theanompi.registry import Registry
from theanompi.schema import (
    AT_LEAST_1,
    EPOCHS,
    FRACTION,
    LR,
    POSITIVE,
    Section,
    key,
)

__all__ = ["ModelSection", "LR_POLICIES"]

LR_POLICIES = ("step", "fixed")


def _models() -> Registry[Any]:
    from theanompi.models import MODELS

    return MODELS


@dataclass(frozen=True)
class ModelSection(Section):
    """A model config (configs/<model>.yaml), given to ``create_model`` as a mapping."""

    name: str = key("", choices=_models)  # required: theanompi.models.MODELS
    input_size: int = key(28, check=POSITIVE)  # crop side fed to the network
    channels: int = key(3, check=POSITIVE)
    n_classes: int = key(10, check=AT_LEAST_1)
    batch_size: int = key(32, check=POSITIVE)  # per-worker sub-batch; divides file_batch_size
    n_epochs: int = key(10, check=AT_LEAST_1)
    learning_rate: float = key(0.01, check=LR)
    lr_policy: str = key("step", choices=LR_POLICIES)
    lr_step: tuple[int, ...] = key((), check=EPOCHS)  # epochs after which lr *= lr_gamma
    lr_gamma: float = key(0.1, check=POSITIVE)
    momentum: float = key(0.9, check=FRACTION)
    nesterov: bool = False
    weight_decay: float = key(0.0005, check=FRACTION)
    arch: Mapping[str, Any] = key({})  # model-specific; validated by the model's constructor
