"""A Horovod-style timeline: every rank's spans (compute, exchange, ...) in one Chrome trace file."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from theanompi.errors import ConfigError, ResourceError, resource_error
from theanompi.io.atomic import atomic_write

__all__ = ["Timeline", "DEFAULT_MAX_EVENTS"]

DEFAULT_MAX_EVENTS = 50_000  # per rank: ~12k steps of 4 spans; ~17 MB held, ~6 MB of JSON

_NULL_SPAN = contextlib.nullcontext()  # reusable: the whole cost of a disabled span()


class _Span:
    """``with tl.span(name):`` records ``[enter, exit]`` in ``MPI.Wtime`` seconds."""

    __slots__ = ("_tl", "_name", "_args", "_t0")

    def __init__(self, tl: Timeline, name: str, args: dict[str, Any] | None) -> None:
        self._tl, self._name, self._args = tl, name, args

    def __enter__(self) -> _Span:
        self._t0 = self._tl._clock()
        return self

    def __exit__(self, *exc: object) -> None:
        self._tl.add(self._name, self._t0, self._tl._clock(), self._args)


class Timeline:
    """Spans of every rank of ``comm``, written by rank 0 as one Chrome trace JSON at ``close()``.

    Open the file in ``chrome://tracing`` or https://ui.perfetto.dev: one process per
    rank ("rank 0", "rank 1", ...), one row per thread, a box per span.

    Parameters
    ----------
    path : where rank 0 writes the trace (``.json``); ``""`` or ``None`` disables the
        timeline. Only rank 0's value counts (it is broadcast), so other ranks may pass
        the same path or ``None``.
    comm : the mpi4py communicator of every rank that takes part (``None``: this
        process alone). Every rank of it must construct the Timeline (one ``bcast``,
        plus a ``Barrier`` when enabled) and call :meth:`close` (a ``gather`` when
        enabled, nothing when disabled). A rank outside the training loop (an EASGD
        server) takes part just so: construct on the same ``comm``, then ``close()``.
    max_events : spans kept per rank; beyond that the first half and the most recent
        half are kept, the middle is dropped and counted (see Notes).
    label : shown after the rank in the trace's process name, e.g. ``"server"``.

    Notes
    -----
    **Time origin.** The constructor ends with a ``Barrier``; every rank then reads its own
    ``MPI.Wtime()`` as its origin, and spans are stored relative to it. All ranks leave a
    barrier within microseconds of each other, so the ranks share one time axis without
    needing synchronised clocks (``MPI_WTIME_IS_GLOBAL`` is not assumed; this works across
    nodes). The error is the barrier's exit skew plus any clock drift over the run. ``ts``
    and ``dur`` are in microseconds from that origin; the origin's Unix time (rank 0) is in
    the trace's ``otherData.origin_unix_s``, to line the trace up with ``record.jsonl``.

    **Memory.** Each rank keeps at most ``max_events`` spans (~350 bytes each with an
    args dict): the first ``ceil(max_events / 2)`` and the last ``floor(max_events / 2)``.
    When spans were dropped, the trace says so in ``otherData.dropped_events`` (``{"rank": count}``)
    and in that rank's process label. Rank 0 gathers every rank's spans at ``close()``.

    A disabled timeline stores nothing: ``span()`` returns a shared no-op context and
    ``add()`` returns at once. There is no ``with Timeline(...)``: closing from
    ``__exit__`` while one rank is raising would leave the others waiting in a gather.

    Examples
    --------
    >>> tl = Timeline(None)
    >>> with tl.span("compute", {"step": 0}):
    ...     pass
    >>> tl.enabled, tl.close()
    (False, None)
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        comm: Any = None,
        *,
        max_events: int = DEFAULT_MAX_EVENTS,
        label: str | None = None,
    ) -> None:
        if not isinstance(max_events, int) or max_events < 1:
            raise ValueError(f"max_events must be an int >= 1, got {max_events!r}")
        self.rank, self.size = (comm.Get_rank(), comm.Get_size()) if comm is not None else (0, 1)
        self._comm = comm
        self._label = label
        self._max_events = max_events
        self._closed = False
        # rank 0 decides (and checks the folder) so that every rank agrees or raises alike
        msg: tuple[str | None, str | None] = (None, None)
        if self.rank == 0:
            msg = _check_path(path)
        if comm is not None and self.size > 1:
            msg = comm.bcast(msg, root=0)
        target, error = msg
        if error is not None:
            raise ConfigError(error)
        self.path = Path(target) if target is not None else None
        if self.path is None:
            return
        from mpi4py import MPI

        self._clock = MPI.Wtime
        if comm is not None:
            comm.Barrier()
        self._origin = self._clock()
        self._origin_unix = time.time()
        self._head: list[tuple[Any, ...]] = []
        self._head_cap = (max_events + 1) // 2
        self._tail: deque[tuple[Any, ...]] = deque(maxlen=max_events // 2)
        self._n = 0
        self._lock = threading.Lock()  # only taken by a thread's first span
        self._threads: dict[int | str, tuple[int, str]] = {
            threading.get_ident(): (0, threading.current_thread().name)
        }

    @property
    def enabled(self) -> bool:
        """Whether spans are recorded (rank 0's ``path`` was set)."""
        return self.path is not None and not self._closed

    def span(
        self, name: str, args: dict[str, Any] | None = None, **fields: Any
    ) -> contextlib.AbstractContextManager[Any]:
        """Context manager recording the time spent in its body as span ``name``.

        ``args`` and/or keyword ``fields`` (JSON-able, e.g. ``step=12``) are shown with
        the span. Spans may nest; a nested span shows below its parent.
        """
        if self.path is None or self._closed:
            return _NULL_SPAN
        return _Span(self, name, {**args, **fields} if args and fields else args or fields)

    def add(
        self,
        name: str,
        t_start: float,
        t_end: float,
        args: dict[str, Any] | None = None,
        thread: str | None = None,
        **fields: Any,
    ) -> None:
        """Record span ``name`` from ``t_start`` to ``t_end`` (``MPI.Wtime()`` seconds).

        ``args`` / ``fields`` as for :meth:`span`. A span whose end is before its start
        is kept with duration 0. ``thread``: the row to show it in (default: the calling
        thread's), for spans another thread measured and this one records.
        """
        if self.path is None or self._closed:
            return
        if fields:
            args = {**args, **fields} if args else fields
        ident: int | str = threading.get_ident() if thread is None else thread
        if ident not in self._threads:
            with self._lock:
                self._threads.setdefault(
                    ident, (len(self._threads), thread or threading.current_thread().name)
                )
        ev = (name, t_start, max(t_end, t_start), self._threads[ident][0], args)
        self._n += 1
        if len(self._head) < self._head_cap:
            self._head.append(ev)
        else:
            self._tail.append(ev)

    @property
    def dropped(self) -> int:
        """Spans of this rank dropped so far to stay within ``max_events``."""
        if self.path is None:
            return 0
        return self._n - len(self._head) - len(self._tail)

    def close(self) -> Path | None:
        """Collective over ``comm``: gather every rank's spans; rank 0 writes the trace.

        The file appears complete or not at all (``atomic_write``). Returns the path on
        rank 0 of an enabled timeline, else ``None``. A second call does nothing.
        """
        if self.path is None or self._closed:
            self._closed = True
            return None
        self._closed = True
        mine = {
            "rank": self.rank,
            "label": self._label,
            "dropped": self.dropped,
            "threads": sorted(self._threads.values()),
            "events": [
                (n, (t0 - self._origin) * 1e6, (t1 - self._origin) * 1e6, tid, a)
                for n, t0, t1, tid, a in (*self._head, *self._tail)
            ],
        }
        self._head, self._tail = [], deque()
        if self._comm is not None and self.size > 1:
            everyone = self._comm.gather(mine, root=0)
        else:
            everyone = [mine]
        err: str | None = None
        if self.rank == 0:
            try:
                with atomic_write(self.path) as tmp, open(tmp, "w") as fh:
                    _write_trace(fh, everyone, self._trace_info(everyone))
            except OSError as exc:
                res = resource_error(exc, "the timeline", self.path, "output.timeline")
                if res is None:
                    raise
                err = str(res)
        if self._comm is not None and self.size > 1:  # every rank stops alike on a full disk
            err = self._comm.bcast(err, root=0)
        if err is not None:
            failed = ResourceError(err)
            failed.agreed = True
            raise failed
        return self.path if self.rank == 0 else None

    def _trace_info(self, everyone: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "producer": "theanompi.io.timeline",
            "world_size": self.size,
            "origin": "each rank's MPI.Wtime() just after a Barrier at Timeline construction",
            "origin_unix_s": round(self._origin_unix, 6),
            "max_events_per_rank": self._max_events,
            "dropped_events": {str(r["rank"]): r["dropped"] for r in everyone if r["dropped"]},
        }


def _check_path(path: str | os.PathLike[str] | None) -> tuple[str | None, str | None]:
    """``(path, None)`` when rank 0 can write there, ``(None, None)`` when disabled, else an error."""
    if path is None or os.fspath(path) == "":
        return None, None
    p = Path(path)
    if p.is_dir():
        return (
            None,
            f"timeline path {str(p)!r} is a folder; pass a file name such as {str(p / 'timeline.json')!r}",
        )
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        why = err.strerror or type(err).__name__
        return (
            None,
            f"cannot create the folder of timeline path {str(p)!r}: {why}; pass a path in a writable folder",
        )
    if not os.access(p.parent, os.W_OK):
        return (
            None,
            f"cannot write timeline path {str(p)!r}: folder not writable; pass a path in a writable folder",
        )
    return str(p), None


def _json_default(v: Any) -> Any:
    if hasattr(v, "item"):  # numpy scalars
        return v.item()
    return str(v)


def _write_trace(fh: Any, everyone: list[dict[str, Any]], info: dict[str, Any]) -> None:
    """Chrome trace "JSON object format": one event per line, metadata events first."""

    def dump(ev: dict[str, Any]) -> str:
        return json.dumps(ev, separators=(",", ":"), default=_json_default)

    lines = []
    for r in everyone:
        pid = r["rank"]
        name = f"rank {pid}" + (f" ({r['label']})" if r["label"] else "")
        lines.append(
            dump({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
        )
        lines.append(
            dump(
                {
                    "ph": "M",
                    "name": "process_sort_index",
                    "pid": pid,
                    "tid": 0,
                    "args": {"sort_index": pid},
                }
            )
        )
        if r["dropped"]:
            keep = info["max_events_per_rank"]
            note = f"{r['dropped']} spans dropped (kept the first {(keep + 1) // 2} and last {keep // 2})"
            lines.append(
                dump(
                    {
                        "ph": "M",
                        "name": "process_labels",
                        "pid": pid,
                        "tid": 0,
                        "args": {"labels": note},
                    }
                )
            )
        for tid, tname in r["threads"]:
            lines.append(
                dump(
                    {
                        "ph": "M",
                        "name": "thread_name",
                        "pid": pid,
                        "tid": tid,
                        "args": {"name": tname},
                    }
                )
            )
    fh.write('{"displayTimeUnit":"ms",\n"otherData":' + dump(info) + ',\n"traceEvents":[\n')
    fh.write(",\n".join(lines))
    for r in everyone:
        pid = r["rank"]
        for name, us0, us1, tid, args in r["events"]:
            ts = round(us0, 3)
            ev = {
                "ph": "X",
                "name": name,
                "cat": name,
                "pid": pid,
                "tid": tid,
                "ts": ts,
                "dur": round(max(round(us1, 3) - ts, 0.0), 3),
            }
            if args:
                ev["args"] = args
            fh.write(",\n" + dump(ev))
    fh.write("\n]}\n")
