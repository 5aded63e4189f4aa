"""theanompi: data-parallel training of PyTensor models over MPI. The front door of a user script:
``import theanompi as tm`` (each name below is imported on first use, so this import is cheap).

A config trained as ``tmpi train`` trains it: ``tm.fit(tm.load_config(model="digits",
overrides={...}))``. A loop of your own (Horovod's model): ``tm.init()``, ``tm.rank()``,
``tm.size()``, ``tm.local_rank()``, ``tm.broadcast_parameters(params)``,
``tm.DistributedOptimizer(tm.SGD(params, lr), loss, inputs)`` and ``tm.allreduce(value)``.
Start either with ``tmpi run -n N script.py`` or ``mpirun -n N python script.py``.

The package by concern, each part importing only the parts below it (``make lint`` holds it):
``cli`` (the ``tmpi`` command), ``bench``, ``train`` (the loop, run, eval, ``fit``),
``distributed`` (the pieces of a loop of your own), ``launch`` (mpirun, supervision, signals,
watchdog), ``config``, ``rules``, ``exchange`` | ``models`` | ``data``, ``io`` (file formats) |
``pytensor_env``, ``schema``, ``registry`` | ``comm``, ``errors``.
"""

from __future__ import annotations

import importlib
from typing import Any

from theanompi._version import __version__
from theanompi.comm import quick_singleton_start

quick_singleton_start()  # before any module of ours starts MPI

#: name -> "module:attribute" of the public API
_EXPORTS = {
    "Model": "theanompi.models.base:Model",
    "wrap_network": "theanompi.models.base:wrap_network",
    "create_model": "theanompi.models:create_model",
    "Config": "theanompi.config:Config",
    "load_config": "theanompi.train.api:load_config",
    "fit": "theanompi.train.api:fit",
    "init": "theanompi.distributed.world:init",
    "rank": "theanompi.distributed.world:rank",
    "size": "theanompi.distributed.world:size",
    "local_rank": "theanompi.distributed.world:local_rank",
    "local_size": "theanompi.distributed.world:local_size",
    "broadcast_parameters": "theanompi.distributed.world:broadcast_parameters",
    "allreduce": "theanompi.distributed.world:allreduce",
    "DistributedOptimizer": "theanompi.distributed.optimizer:DistributedOptimizer",
    "SGD": "theanompi.models.optim:SGD",
    "Adam": "theanompi.models.optim:Adam",
    "AdamW": "theanompi.models.optim:AdamW",
    "LARS": "theanompi.models.optim:LARS",
    "Registry": "theanompi.registry:Registry",
    "MODELS": "theanompi.models:MODELS",
    "RULES": "theanompi.rules:RULES",
    "STRATEGIES": "theanompi.exchange:STRATEGIES",
    "COMPRESSORS": "theanompi.exchange.compression:COMPRESSORS",
    "OPTIMIZERS": "theanompi.models.optim:OPTIMIZERS",
    "LOGGERS": "theanompi.io.loggers:LOGGERS",
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
