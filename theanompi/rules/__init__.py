"""Sync rules by name: the one registry that config validation, the CLI, docs and tests read.

A rule keeps the workers' replicas together (see :class:`~theanompi.rules.base.SyncRule`);
:class:`~theanompi.train.trainer.Trainer` runs the loop. Adding a rule is one module here plus
one line in ``RULES`` (docs/extending.md); a rule builds itself from the config
(``SyncRule.from_config``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from theanompi.registry import Registry

if TYPE_CHECKING:
    from theanompi.rules.base import SyncRule

__all__ = ["RULES"]

#: ``weight_exchange.sync_rule``; imported on first use
RULES: Registry[type[SyncRule]] = Registry(
    "sync rule",
    {
        "BSP": "theanompi.rules.bsp:BSP",
        "EASGD": "theanompi.rules.easgd:EASGD",
        "GOSGD": "theanompi.rules.gosgd:GOSGD",
    },
)
