"""The model's random streams (dropout): find them, seed them per rank, save and restore their state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from theanompi.errors import ConfigError

__all__ = ["rng_vars", "get_rng_states", "set_rng_states", "seed_rngs"]


def rng_vars(model: Any) -> list[Any]:
    """Shared variables holding a ``numpy.random.Generator`` reachable from ``model``.

    Uses ``model.rng_vars`` when the model provides it, else walks its attributes
    (layers, lists, dicts) in definition order.
    """
    if hasattr(model, "rng_vars"):
        return list(model.rng_vars)
    found: dict[int, Any] = {}
    seen: set[int] = set()

    def walk(obj: Any, depth: int) -> None:
        if depth > 12 or id(obj) in seen:
            return
        seen.add(id(obj))
        if hasattr(obj, "get_value") and hasattr(obj, "set_value"):
            try:
                val = obj.get_value(borrow=True)
            except Exception:  # noqa: BLE001 - not a readable shared variable
                return
            if isinstance(val, np.random.Generator):
                found.setdefault(id(obj), obj)
            return
        if isinstance(obj, dict):
            for v in obj.values():
                walk(v, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, depth + 1)
        elif type(obj).__module__.startswith("theanompi.") and hasattr(obj, "__dict__"):
            for k, v in vars(obj).items():
                if not k.startswith("_fn"):
                    walk(v, depth + 1)

    walk(model, 0)
    return list(found.values())


def get_rng_states(model: Any) -> list[dict[str, Any]]:
    """JSON-able bit-generator states of :func:`rng_vars`."""
    return [v.get_value(borrow=True).bit_generator.state for v in rng_vars(model)]


def set_rng_states(model: Any, states: Sequence[dict[str, Any]]) -> None:
    """Restore states saved by :func:`get_rng_states` (count must match)."""
    vs = rng_vars(model)
    if len(vs) != len(states):
        raise ConfigError(
            f"checkpoint holds {len(states)} RNG state(s) but the model has {len(vs)}; "
            "use the model config the checkpoint was trained with"
        )
    for v, st in zip(vs, states, strict=True):
        g = np.random.default_rng()
        g.bit_generator.state = st
        v.set_value(g, borrow=True)


def seed_rngs(model: Any, seed: int, rank: int) -> None:
    """Give each model RNG (dropout) a stream determined by ``(seed, rank, index)``."""
    for i, v in enumerate(rng_vars(model)):
        v.set_value(np.random.default_rng([int(seed), int(rank), i]), borrow=True)
