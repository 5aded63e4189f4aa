"""Pieces for a script that writes its own loop (Horovod's model): ``init``, ``rank``/``size``,
``broadcast_parameters``, ``allreduce`` and ``DistributedOptimizer``.

May import launch (signals, watchdog) and every layer below it; the training run (``train``)
builds on it.
"""

from __future__ import annotations

from theanompi.distributed.optimizer import DistributedOptimizer
from theanompi.distributed.world import (
    allreduce,
    broadcast_parameters,
    init,
    local_rank,
    local_size,
    rank,
    size,
)

__all__ = [
    "init",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "broadcast_parameters",
    "allreduce",
    "DistributedOptimizer",
]
