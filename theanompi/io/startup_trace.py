"""Rank 0's start-up marks, written as JSON where ``$THEANOMPI_STARTUP_TRACE`` says (``tmpi bench startup``)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from theanompi.comm import rank_from_env
from theanompi.io.atomic import atomic_write

__all__ = ["TRACE_ENV", "add", "enabled", "mark", "process_start", "write"]

TRACE_ENV = "THEANOMPI_STARTUP_TRACE"
_marks: dict[str, float] = {}  # name -> wall clock (time.time()) when first reached
_spans: dict[str, float] = {}  # name -> seconds, summed


def enabled() -> bool:
    """Whether this process records: rank 0 of a job whose launcher asked for a trace."""
    return bool(os.environ.get(TRACE_ENV)) and rank_from_env() == 0


def mark(name: str) -> None:
    """Remember when ``name`` was first reached (later calls keep the first time)."""
    if enabled():
        _marks.setdefault(name, time.time())


def add(name: str, seconds: float) -> None:
    """Add ``seconds`` to the span ``name`` (e.g. the rewrites of every compiled function)."""
    if enabled():
        _spans[name] = _spans.get(name, 0.0) + seconds


def process_start() -> float | None:
    """This process's start on the wall clock (Linux ``/proc``, to 10 ms), else None."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime, field 22 of proc(5), in clock ticks since boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def write() -> None:
    """Write the marks (with the process start) and spans once; later calls do nothing."""
    path = os.environ.get(TRACE_ENV, "")
    if not enabled() or "written" in _marks:
        return
    _marks["written"] = time.time()
    doc = {"process_start": process_start(), "marks": _marks, "spans": _spans}
    try:
        with atomic_write(path) as tmp:
            tmp.write_text(json.dumps(doc))
    except OSError:
        pass  # a benchmark's aid only: the bench reports the trace missing, training goes on
