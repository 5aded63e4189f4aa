"""Fault injection for tests: ``THEANOMPI_FAIL=<where>:<rank>:<step>`` makes that rank fail.

``where`` is ``step`` (the training loop, main thread), ``loader`` (the prefetch thread,
while producing that step's batch) or ``checkpointed`` (the close of the epoch that ends at
that step, between its checkpoint and its record line): the rank raises. Used by the failure
tests to check that one raising rank stops the whole job with one line. ``kill`` (at the
``step`` point) makes the rank SIGKILL itself there: a real signal at a known step, where a
kill from outside, timed by the job's output, can land steps late while mpirun's relay lags.
``stop`` makes the rank SIGSTOP itself there: the job holds still at a known step until
SIGCONT, so that a signal sent from outside (Slurm's, whose delivery takes a scheduling cycle
or more) lands at that step, not after the run's end. For ``kill`` and ``stop`` the rank is
the process's rank at launch, so that after an elastic shrink (new ranks, the step trained
again) it acts on one process once.
"""

from __future__ import annotations

import os
import signal

__all__ = ["InjectedFailure", "fault_point"]

ENV = "THEANOMPI_FAIL"
_SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


class InjectedFailure(RuntimeError):
    """Raised by :func:`fault_point` when ``THEANOMPI_FAIL`` asks for it."""


def fault_point(where: str, rank: int, step: int) -> None:
    """Raise :class:`InjectedFailure` when ``$THEANOMPI_FAIL`` is ``f"{where}:{rank}:{step}"``
    (SIGKILL, or SIGSTOP, this process when it is ``f"kill:{rank}:{step}"``, or ``stop:``,
    and ``where`` is ``step``)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    parts = spec.split(":")
    if parts[0] in _SIGNALS:
        from theanompi.comm import rank_from_env

        rank = rank_from_env()
    if len(parts) != 3 or parts[1] != str(rank) or parts[2] != str(step):
        return
    if parts[0] == where:
        raise InjectedFailure(f"injected failure in {where} at step {step} ({ENV}={spec})")
    if parts[0] in _SIGNALS and where == "step":
        os.kill(os.getpid(), _SIGNALS[parts[0]])
