"""The training driver behind ``tmpi train``: dispatch a validated config to its rule."""

from __future__ import annotations

from typing import Any

__all__ = ["run"]


def run(cfg: Any, *, resume: bool = False, comm: Any = None) -> dict[str, Any]:
    """Run ``cfg.weight_exchange.sync_rule`` (``BSP`` or ``EASGD``) on ``comm`` (default world).

    Returns the rule's summary dict. A run stopped by Ctrl-C/SIGTERM at a step
    boundary exits with status 130 (its last checkpoint stays valid).
    """
    if comm is None:
        from theanompi.comm import world

        comm = world()
    rule = cfg.weight_exchange.sync_rule
    if rule == "BSP":
        from theanompi.rules.bsp import run_bsp

        summary = run_bsp(cfg, comm, resume=resume)
    elif rule == "EASGD":
        from theanompi.rules.easgd import run_easgd

        summary = run_easgd(cfg, comm, resume=resume)
    else:  # load_config validates the choice; this guards programmatic use
        raise ValueError(f"unknown sync_rule {rule!r}; choose from BSP, EASGD")
    if isinstance(summary, dict) and summary.get("interrupted"):
        raise SystemExit(130)
    return summary
