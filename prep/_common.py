"""Private helpers shared by the prep stages: MPI plumbing, collective errors, progress, hashing, writes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from theanompi.errors import DataError, ResourceError, UserError, resource_error
from theanompi.io import atomic as _io

__all__ = [
    "Comm",
    "get_comm",
    "wtime",
    "collective",
    "raise_collective",
    "Progress",
    "combined_checksum",
    "read_json",
    "misc_dir",
    "require",
    "write_problem",
    "resource_errors",
    "atomic_write",
    "write_json",
    "write_npy",
]

T = TypeVar("T")
Comm = Any  # an mpi4py communicator (typed loosely so that importing prep does not start MPI)


class _Serial:
    """A one-rank stand-in for an MPI communicator (used when mpi4py cannot start)."""

    def Get_rank(self) -> int:  # noqa: N802 - mirrors mpi4py
        return 0

    def Get_size(self) -> int:  # noqa: N802
        return 1

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return obj

    def gather(self, obj: Any, root: int = 0) -> list[Any]:
        return [obj]

    def allgather(self, obj: Any) -> list[Any]:
        return [obj]

    def allreduce(self, obj: Any, op: Any = None) -> Any:
        return obj

    def Barrier(self) -> None:  # noqa: N802
        pass


def get_comm(comm: Comm | None = None) -> Comm:
    """``comm`` itself, else ``MPI.COMM_WORLD``; outside mpirun a one-rank stand-in.

    The stand-in spares a single process MPI's start-up (a second or more) when mpi4py
    has not been started already.
    """
    if comm is not None:
        return comm
    from theanompi.comm import under_mpirun, world

    if not under_mpirun() and "mpi4py.MPI" not in sys.modules:
        return _Serial()
    return world()


def wtime() -> float:
    """``MPI.Wtime()`` once MPI is running, else ``time.perf_counter()``."""
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        return MPI.Wtime()
    return time.perf_counter()


def collective(comm: Comm, fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 and broadcast its result; a ``UserError`` is re-raised on every rank.

    The re-raised error carries ``collective = True`` so that the CLI prints it once (rank 0)
    instead of once per rank, and no rank is left waiting in a collective.
    """
    if comm.Get_size() == 1:
        return fn()
    result: Any = None
    error: UserError | None = None
    if comm.Get_rank() == 0:
        try:
            result = fn()
        except UserError as err:
            error = err
    error, result = comm.bcast((error, result), root=0)
    if error is not None:
        error.collective = True  # type: ignore[attr-defined]
        raise error
    return result


def raise_collective(
    comm: Comm, problem: UserError | str | None, exc_type: type[UserError] = DataError
) -> None:
    """Raise on every rank when rank 0 has a problem (broadcast): a message as
    ``exc_type(message)``, an error as itself (so a full disk keeps its exit code 4)."""
    problem = comm.bcast(problem, root=0) if comm.Get_size() > 1 else problem
    if problem is not None and problem != "":
        err = exc_type(problem) if isinstance(problem, str) else problem
        err.collective = True  # type: ignore[attr-defined]
        raise err


#: where the output is no terminal (a log, a pipe): one progress line at most this often
LOG_EVERY_S = 15.0


def _eta(seconds: float) -> str:
    """``45s``, ``1m03s``, ``2h05m``.

    >>> _eta(63), _eta(7500), _eta(4.2)
    ('1m03s', '2h05m', '5s')
    """
    s = max(0, math.ceil(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s // 60 % 60:02d}m"


def _on_terminal(stream: Any) -> bool:
    """Whether ``stream``'s output ends on a terminal: the launcher says so for the ranks
    (:data:`~theanompi.launch.output.TERMINAL_ENV`), else ask the stream."""
    from theanompi.launch.output import TERMINAL_ENV

    said = os.environ.get(TERMINAL_ENV, "")
    if said in ("0", "1"):
        return said == "1"
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False


class Progress:
    """Progress on stderr (rank 0 only): ``label: done/total images (p%), img/s, ETA``.

    On a terminal (also through ``tmpi ... -n N``, whose launcher passes updates on as they
    come) one line is redrawn with ``\\r`` every ``interval`` seconds; elsewhere (a log, a pipe,
    a bare mpirun) a line is printed at the start, every :data:`LOG_EVERY_S` seconds and at the
    end, so that logs stay readable. Each rank counts its own images; rank 0 shows its count
    times the number of ranks, an estimate that needs no communication. The caller prints the
    final report.
    """

    def __init__(
        self, label: str, total: int, comm: Comm, interval: float = 0.5, stream: Any = None
    ) -> None:
        self.label = label
        self.total = total
        self.size = comm.Get_size()
        self.enabled = comm.Get_rank() == 0 and total > 0
        self.stream = sys.stderr if stream is None else stream
        self.live = self.enabled and _on_terminal(self.stream)
        self.interval = interval if self.live else max(interval, LOG_EVERY_S)
        self.start = time.perf_counter()
        self.done = 0
        self._last: float | None = None
        self._width = 0  # of the line drawn last (a shorter one is padded over it)
        self._shown = False

    def line(self, shown: int, seconds: float) -> str:
        """The progress text for ``shown`` images after ``seconds``."""
        rate = shown / max(seconds, 1e-9)
        eta = _eta((self.total - shown) / rate) if rate > 0 else "--"
        pct = 100 * shown // self.total
        return f"{self.label}: {shown}/{self.total} images ({pct}%), {rate:,.0f} img/s, ETA {eta}"

    def update(self, n: int) -> None:
        """Add ``n`` images done by this rank; redraw at most every ``interval`` seconds."""
        self.done += n
        if not self.enabled:
            return
        now = time.perf_counter()
        shown = min(self.total, self.done * self.size)
        last = self._last
        if last is not None and now - last < self.interval and shown < self.total:
            return
        self._last = now
        text = self.line(shown, now - self.start)
        if self.live:
            print(f"\r{text.ljust(self._width)}", end="", file=self.stream, flush=True)
            self._width = len(text)
        else:
            print(text, file=self.stream, flush=True)
        self._shown = True

    def close(self) -> None:
        """End the progress line."""
        if self.live and self._shown:
            print(file=self.stream, flush=True)


def combined_checksum(digests: dict[str, list[str]]) -> str:
    """One SHA-256 over every batch digest, split by split in a fixed order (train, val)."""
    h = hashlib.sha256()
    for split in sorted(digests):
        h.update(f"{split}:{len(digests[split])}\n".encode())
        for d in digests[split]:
            h.update(d.encode() + b"\n")
    return h.hexdigest()


def misc_dir(out: Path) -> Path:
    return Path(out) / "misc"


def read_json(path: Path) -> Any:
    """Read a JSON file written by an earlier stage."""
    return json.loads(Path(path).read_text())


def require(path: Path, stage: str) -> Path:
    """``path`` if it exists, else a ``DataError`` telling which stage to run first."""
    if not Path(path).exists():
        raise DataError(f"{path} not found; run `tmpi prep {stage}` first")
    return Path(path)


def write_problem(err: BaseException, path: str | os.PathLike[str]) -> ResourceError | None:
    """A one-line :class:`ResourceError` (exit 4) naming ``path`` for a full disk, a quota, a
    read-only or unwritable folder (``err`` an ``OSError`` from Python, numpy or h5py); else
    None. The same wording as training's outputs (:func:`theanompi.errors.resource_error`).
    """
    if isinstance(err, OSError):
        return resource_error(err, "prep output", path, key="--out")
    return None


@contextlib.contextmanager
def resource_errors(path: str | os.PathLike[str]) -> Iterator[None]:
    """Within the block, a full disk (etc.) writing ``path`` becomes one ``ResourceError`` line."""
    try:
        yield
    except OSError as err:
        problem = write_problem(err, path)
        if problem is None:
            raise
        raise problem from None


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str]) -> Iterator[Path]:
    """``theanompi.io.atomic.atomic_write`` under :func:`resource_errors`: nothing is left under
    ``path`` (the temp file is removed) and an older ``path`` stays."""
    with resource_errors(path), _io.atomic_write(path) as tmp:
        yield tmp


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """``theanompi.io.atomic.write_json`` under :func:`resource_errors`."""
    with resource_errors(path):
        _io.write_json(path, obj)


def write_npy(path: str | os.PathLike[str], array: Any) -> None:
    """``theanompi.io.atomic.write_npy`` under :func:`resource_errors`."""
    with resource_errors(path):
        _io.write_npy(path, array)
