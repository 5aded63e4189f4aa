"""Fault injection for tests: ``THEANOMPI_FAIL=<where>:<rank>:<step>`` makes that rank raise.

``where`` is ``step`` (the training loop, main thread) or ``loader`` (the
prefetch thread, while producing that step's batch). Used by the failure tests
to check that one raising rank stops the whole job with one line.
"""

from __future__ import annotations

import os

__all__ = ["InjectedFailure", "fault_point"]

ENV = "THEANOMPI_FAIL"


class InjectedFailure(RuntimeError):
    """Raised by :func:`fault_point` when ``THEANOMPI_FAIL`` asks for it."""


def fault_point(where: str, rank: int, step: int) -> None:
    """Raise :class:`InjectedFailure` when ``$THEANOMPI_FAIL`` is ``f"{where}:{rank}:{step}"``."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    parts = spec.split(":")
    if len(parts) == 3 and parts[0] == where and parts[1] == str(rank) and parts[2] == str(step):
        raise InjectedFailure(f"injected failure in {where} at step {step} ({ENV}={spec})")
