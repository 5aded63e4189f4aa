"""``python _slow_validation.py VICTIM <tmpi args>``: ``tmpi <args>`` where rank VICTIM, in
its first validation (the watchdog is armed after the first step), prints ``rank R validating`` and then
computes slowly, so that a test can SIGSTOP it there while the other ranks wait for it in
validation's collectives (``metrics.evaluate``)."""

from __future__ import annotations

import os
import runpy
import sys
import time

import theanompi.models.metrics as metrics

VICTIM = int(sys.argv.pop(1))
_calls = {"validations": 0, "in": False}
_evaluate = metrics.evaluate
_batch_metrics = metrics.batch_metrics


def _slow_evaluate(*args, **kw):  # type: ignore[no-untyped-def]
    _calls["validations"] += 1
    _calls["in"] = _calls["validations"] == 1
    try:
        return _evaluate(*args, **kw)
    finally:
        _calls["in"] = False


def _slow_batch_metrics(*args, **kw):  # type: ignore[no-untyped-def]
    if _calls["in"]:
        print(f"rank {VICTIM} validating", file=sys.stderr, flush=True)
        time.sleep(2)
    return _batch_metrics(*args, **kw)


if os.environ.get("OMPI_COMM_WORLD_RANK") == str(VICTIM):
    metrics.evaluate = _slow_evaluate
    metrics.batch_metrics = _slow_batch_metrics

sys.argv[0] = "tmpi"
runpy.run_module("theanompi.cli", run_name="__main__", alter_sys=True)
