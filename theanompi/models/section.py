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

__all__ = ["ModelSection"]


def _models() -> Registry[Any]:
    from theanompi.models import MODELS

    return MODELS


def _optimizers() -> Registry[Any]:
    from theanompi.models.optim import OPTIMIZERS  # no PyTensor import: a config stays cheap

    return OPTIMIZERS


def _lr_policies() -> Registry[Any]:
    from theanompi.models.optim import LR_POLICIES

    return LR_POLICIES


@dataclass(frozen=True)
class ModelSection(Section):
    """A model config (configs/<model>.yaml), given to ``create_model`` as a mapping."""

    name: str = key("", choices=_models)  # required: theanompi.models.MODELS
    input_size: int = key(28, check=POSITIVE)  # crop side fed to the network
    channels: int = key(3, check=POSITIVE)
    n_classes: int = key(10, check=AT_LEAST_1)
    batch_size: int = key(32, check=POSITIVE)  # per-worker sub-batch; divides file_batch_size
    n_epochs: int = key(10, check=AT_LEAST_1)
    optimizer: str = key("sgd", choices=_optimizers)  # theanompi.models.optim.OPTIMIZERS
    learning_rate: float = key(0.01, check=LR)
    lr_policy: str = key("step", choices=_lr_policies)  # theanompi.models.optim.LR_POLICIES
    lr_step: tuple[int, ...] = key((), check=EPOCHS)  # epochs after which lr *= lr_gamma
    lr_gamma: float = key(0.1, check=POSITIVE)
    lr_power: float = key(1.0, check=POSITIVE)  # poly: lr * (1 - step/total_steps) ** lr_power
    momentum: float = key(0.9, check=FRACTION)  # sgd, lars
    nesterov: bool = False  # sgd, lars
    weight_decay: float = key(0.0005, check=FRACTION)  # L2 (sgd, adam, lars); decoupled (adamw)
    beta1: float = key(0.9, check=FRACTION)  # adam, adamw
    beta2: float = key(0.999, check=FRACTION)  # adam, adamw
    eps: float = key(1e-8, check=POSITIVE)  # adam, adamw: denominator; lars: trust ratio's
    lars_eta: float = key(0.001, check=POSITIVE)  # lars trust coefficient
    label_smoothing: float = key(0.0, check=FRACTION)  # training loss only (torch's)
    arch: Mapping[str, Any] = key({})  # model-specific; validated by the model's constructor
