"""Models and layers: ``create_model(section)`` builds a :class:`Model` by ``section.name``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from theanompi.errors import ConfigError
from theanompi.registry import Registry

if TYPE_CHECKING:
    from theanompi.models.base import Model

__all__ = ["BACKENDS", "create_model", "MODELS", "Model"]

#: what the training loop and eval call on a model (``Model`` has them all)
PROTOCOL = ("build", "train_step", "val_step", "predict", "adjust_hyperparams")


def _not_a_model(obj: Any) -> str | None:
    """Why ``obj`` cannot be trained as a model (None: it can), checked without importing
    PyTensor: a class with the methods of :data:`PROTOCOL`, as ``Model`` subclasses have."""
    if not isinstance(obj, type):
        return f"is a {type(obj).__name__}, not a model class; name a theanompi.Model subclass"
    missing = [m for m in PROTOCOL if not callable(getattr(obj, m, None))]
    if missing:
        return (
            f"{obj.__name__} is not a model (no {', '.join(missing)}); "
            "derive it from theanompi.Model"
        )
    return None


#: ``name:`` in configs/<model>.yaml; imported on first use
MODELS: Registry[type[Model]] = Registry(
    "model",
    {
        "alexnet": "theanompi.models.alexnet:AlexNet",
        "googlenet": "theanompi.models.googlenet:GoogLeNet",
        "resnet50": "theanompi.models.resnet:ResNet50",
        "vgg16": "theanompi.models.vgg:VGG16",
        "mlp": "theanompi.models.mlp:MLP",
        "small_cnn": "theanompi.models.small_cnn:SmallCNN",
    },
    check=_not_a_model,
)


#: compiler backends (``training.backend``, ``--backend``): name -> its mode's factory;
#: named here, where a config is checked without importing PyTensor (the launcher)
BACKENDS: Registry[Callable[[], Any]] = Registry(
    "backend", {"c": "theanompi.models.ops:c_mode", "jax": "theanompi.models.ops:jax_mode"}
)


def create_model(section: Mapping[str, Any]) -> Model:
    """Build the model named by ``section["name"]`` from a model config section.

    >>> m = create_model({"name": "small_cnn", "input_size": 28, "channels": 3, "n_classes": 10})
    >>> m.input_shape, m.n_classes, m.params[0].name
    ((3, 28, 28), 10, 'conv1.W')
    """
    name = section.get("name") if isinstance(section, Mapping) else None
    if not name:
        raise ConfigError("model config has no 'name'; set name: small_cnn (or alexnet, ...)")
    return MODELS.get(name)(section)


def __getattr__(name: str) -> Any:
    if name == "Model":
        from theanompi.models.base import Model

        return Model
    raise AttributeError(name)
