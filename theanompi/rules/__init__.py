"""Sync rules by name: the one registry that config validation, the CLI, docs and tests read.

A rule keeps the workers' replicas together (see :class:`~theanompi.rules.base.SyncRule`);
:class:`~theanompi.train.trainer.Trainer` runs the loop. Adding a rule is one module here plus
one line in ``RULES`` (docs/extending.md).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from theanompi.errors import ConfigError

if TYPE_CHECKING:
    from theanompi.rules.base import SyncRule

__all__ = ["RULES", "rule_class"]

#: ``weight_exchange.sync_rule`` -> (module, class); imported on first use
RULES: dict[str, tuple[str, str]] = {
    "BSP": ("theanompi.rules.bsp", "BSP"),
    "EASGD": ("theanompi.rules.easgd", "EASGD"),
    "GOSGD": ("theanompi.rules.gosgd", "GOSGD"),
}


def rule_class(name: str) -> type[SyncRule]:
    """The rule class registered under ``name``; a one-line ``ConfigError`` otherwise."""
    if name not in RULES:
        raise ConfigError(f"unknown sync rule {name!r}; choose from {', '.join(RULES)}")
    module, cls = RULES[name]
    return getattr(importlib.import_module(module), cls)
