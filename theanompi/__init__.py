"""theanompi: data-parallel training of PyTensor models over MPI. The front door of a user script:
``import theanompi as tm`` (each name below is imported on first use, so this import is cheap).

The package by concern, each part importing only the parts below it (``make lint`` holds it):
``cli`` (the ``tmpi`` command), ``bench``, ``train`` (the loop, run and eval), ``launch``
(mpirun, supervision, signals, watchdog), ``config``, ``rules``, ``exchange`` | ``models`` |
``data``, ``io`` (file formats) | ``pytensor_env``, ``schema``, ``registry`` | ``comm``, ``errors``.
"""

from __future__ import annotations

import importlib
from typing import Any

from theanompi._version import __version__

#: name -> "module:attribute" of the public API
_EXPORTS = {
    "Model": "theanompi.models.base:Model",
    "create_model": "theanompi.models:create_model",
    "Config": "theanompi.config:Config",
    "load_config": "theanompi.config:load_config",
    "Registry": "theanompi.registry:Registry",
    "MODELS": "theanompi.models:MODELS",
    "RULES": "theanompi.rules:RULES",
    "STRATEGIES": "theanompi.exchange:STRATEGIES",
    "COMPRESSORS": "theanompi.exchange.compression:COMPRESSORS",
    "UserError": "theanompi.errors:UserError",
    "ConfigError": "theanompi.errors:ConfigError",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'theanompi' has no attribute {name!r}")
    module, _, attr = _EXPORTS[name].partition(":")
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
