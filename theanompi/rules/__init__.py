"""Training rules: ``run_bsp`` (synchronous, theanompi.rules.bsp) and ``run_easgd`` (elastic
averaging, theanompi.rules.easgd); imported lazily so that one rule's imports never slow the other."""

from __future__ import annotations

from typing import Any

__all__ = ["run_bsp", "run_easgd", "RULES"]

#: ``weight_exchange.sync_rule`` -> (module, function)
RULES = {"BSP": ("theanompi.rules.bsp", "run_bsp"), "EASGD": ("theanompi.rules.easgd", "run_easgd")}


def __getattr__(name: str) -> Any:
    import importlib

    for module, fn in RULES.values():
        if name == fn:
            return getattr(importlib.import_module(module), fn)
    raise AttributeError(name)
