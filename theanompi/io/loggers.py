"""Training loggers fed the record's entries: a CSV writer, a TensorBoard writer, user callbacks.

The record (:mod:`theanompi.io.record`) stays the source of truth: the Trainer hands each
logger the very ``step`` and ``epoch`` entries it appended to the record, on the rank that
writes the record (worker 0) only. ``output.loggers`` names them from :data:`LOGGERS`: a
registered name (``csv``, ``tensorboard``), ``package.module:Class`` or
``path/to/file.py:Class``. Each is built as ``Cls(run_dir=..., history=...)``, where
``history`` is the record as it stands at start (the kept entries of a resumed run, then
the new ``start`` entry); the built-in writers rebuild their files from it, so after a
``--resume`` or ``--overwrite`` they hold what the record holds.

>>> import tempfile, pathlib
>>> run = pathlib.Path(tempfile.mkdtemp())
>>> log = CSVLogger(run_dir=run)
>>> log.on_step({"kind": "step", "time": 1.5, "step": 10, "loss": 0.25, "lr": None})
>>> log.close()
>>> print((run / "csv" / "steps.csv").read_text(), end="")
step,loss,lr,time
10,0.25,,1.5
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from theanompi.errors import ConfigError, resource_error
from theanompi.io._tfevents import event
from theanompi.io.atomic import atomic_write
from theanompi.registry import Registry

__all__ = [
    "Logger",
    "CSVLogger",
    "TensorBoardLogger",
    "LOGGERS",
    "TB_TAGS",
    "open_loggers",
    "close_all",
]

Entry = Mapping[str, Any]

#: the TensorBoard scalar tag of each record field, per entry kind (x axis: the entry's ``step``)
TB_TAGS: dict[str, dict[str, str]] = {
    "step": {
        "loss": "train/loss",
        "error": "train/error",
        "images_per_s": "train/images_per_s",
        "lr": "train/lr",
        "t_compute": "time/compute_s",
        "t_exchange": "time/exchange_s",
        "t_wait": "time/wait_s",
        "t_wall": "time/step_s",
        "t_hidden": "time/exchange_hidden_s",
        "t_sync": "time/slowest_rank_wait_s",
    },
    "epoch": {
        "train_loss": "epoch/train_loss",
        "train_error": "epoch/train_error",
        "val_loss": "val/loss",
        "val_top1_err": "val/top1_error",
        "val_top5_err": "val/top5_error",
        "images_per_s": "epoch/images_per_s",
        "lr": "epoch/lr",
        "seconds": "epoch/seconds",
        "t_compute": "epoch/compute_s",
        "t_exchange": "epoch/exchange_s",
        "t_wait": "epoch/wait_s",
        "t_hidden": "epoch/exchange_hidden_s",
        "t_sync": "epoch/slowest_rank_wait_s",
    },
}


class Logger:
    """A training logger: override any of :meth:`on_step`, :meth:`on_epoch`, :meth:`close`.

    Parameters
    ----------
    run_dir : the run's folder (``output.run_dir``); write under it.
    history : the record's entries at start (``kind`` ``start``, ``step``, ``epoch``, ...).

    Examples
    --------
    A user's own (``output.loggers: [my_loggers.py:Printer]``):

    >>> class Printer(Logger):
    ...     def on_epoch(self, entry):
    ...         print(f"epoch {entry['epoch']}: val loss {entry['val_loss']}")
    >>> Printer(run_dir=".").on_epoch({"kind": "epoch", "epoch": 0, "val_loss": 0.5})
    epoch 0: val loss 0.5
    """

    def __init__(self, run_dir: str | Path, history: Sequence[Entry] = ()) -> None:
        self.run_dir = Path(run_dir)

    def on_step(self, entry: Entry) -> None:
        """A ``step`` entry (a window of ``print_freq`` steps), as the record got it."""

    def on_epoch(self, entry: Entry) -> None:
        """An ``epoch`` entry (train and val metrics of a finished epoch)."""

    def close(self) -> None:
        """The run ended (also after an error or Ctrl-C)."""


def _refused(err: OSError, what: str, path: Path) -> Exception:
    return resource_error(err, what, path, "output.run_dir") or err


def _cell(value: Any) -> Any:
    """A CSV cell: '' for None, JSON for a list or mapping, the value else (floats by repr)."""
    if value is None:
        return ""
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, sort_keys=True)
    return value


_FIRST = ("epoch", "step")  # the CSV columns that lead; the rest follow sorted


class _CSVFile:
    """One CSV file of entries: columns the entries' keys but ``kind`` (``epoch``, ``step``,
    then the rest sorted); a later entry with a new key rewrites the file, header widened."""

    def __init__(self, path: Path, rows: Iterable[Entry]) -> None:
        self.path = path
        self.columns: list[str] = []
        self._fh: Any = None
        self._rewrite([self._row(r) for r in rows])

    @staticmethod
    def _row(entry: Entry) -> dict[str, Any]:
        return {k: _cell(v) for k, v in entry.items() if k != "kind"}

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        self.close()
        keys = {k for r in rows for k in r} | set(self.columns)
        self.columns = [k for k in _FIRST if k in keys] + sorted(keys - set(_FIRST))
        try:
            with atomic_write(self.path) as tmp, open(tmp, "w", newline="") as fh:
                if self.columns:
                    w = csv.DictWriter(fh, self.columns, lineterminator="\n")
                    w.writeheader()
                    w.writerows(rows)
            self._fh = open(self.path, "a", newline="")  # noqa: SIM115 - closed in close()
        except OSError as err:
            raise _refused(err, "the CSV log", self.path) from None

    def add(self, entry: Entry) -> None:
        row = self._row(entry)
        if not set(row) <= set(self.columns):
            self.close()
            with open(self.path, newline="") as fh:
                old = list(csv.DictReader(fh))
            self._rewrite([*old, row])
            return
        try:
            csv.DictWriter(self._fh, self.columns, lineterminator="\n").writerow(row)
            self._fh.flush()
        except OSError as err:
            raise _refused(err, "the CSV log", self.path) from None

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class CSVLogger(Logger):
    """``<run_dir>/csv/steps.csv``: one row per logged step window, the ``step`` entries'
    keys as columns; ``<run_dir>/csv/epochs.csv``: one row per epoch entry. A cell is empty
    where the record holds null (nan/inf); floats are written exactly (``repr``)."""

    def __init__(self, run_dir: str | Path, history: Sequence[Entry] = ()) -> None:
        super().__init__(run_dir, history)
        folder = self.run_dir / "csv"
        self.files = {
            kind: _CSVFile(folder / f"{kind}s.csv", [e for e in history if e.get("kind") == kind])
            for kind in ("step", "epoch")
        }

    def on_step(self, entry: Entry) -> None:
        self.files["step"].add(entry)

    def on_epoch(self, entry: Entry) -> None:
        self.files["epoch"].add(entry)

    def close(self) -> None:
        for f in self.files.values():
            f.close()


_EVENTS_GLOB = "events.out.tfevents.*.tmpi"  # the files this writer makes (and replaces)
_FILE_IDS = itertools.count()


class TensorBoardLogger(Logger):
    """TensorBoard event files in ``<run_dir>/tb`` (``tensorboard --logdir runs``): the
    scalars of :data:`TB_TAGS` at each entry's global ``step``. Written by
    :mod:`theanompi.io._tfevents`: no TensorBoard, TensorFlow or protobuf needed to train.

    At start a new file replays ``history`` after a restart marker (a live TensorBoard drops
    what it showed), then the earlier files this writer made are deleted.
    """

    def __init__(self, run_dir: str | Path, history: Sequence[Entry] = ()) -> None:
        super().__init__(run_dir, history)
        folder = self.run_dir / "tb"
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
        self.path = folder / f"{name}.{next(_FILE_IDS)}.tmpi"  # a new name: never truncate one
        self._fh: Any = None
        now = time.time()
        head = event(now, 0, file_version=True) + event(now, 0, session_start=True)
        try:
            old = sorted(folder.glob(_EVENTS_GLOB))
            folder.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "wb")  # noqa: SIM115 - closed in close()
            self._fh.write(head + b"".join(self._event(e) for e in history))
            self._fh.flush()
            for p in old:
                if p != self.path:
                    p.unlink(missing_ok=True)
        except OSError as err:
            raise _refused(err, "the TensorBoard log", self.path) from None

    @staticmethod
    def _event(entry: Entry) -> bytes:
        tags = TB_TAGS.get(str(entry.get("kind")))
        if not tags or entry.get("step") is None:
            return b""
        scalars = [
            (tag, entry[k])
            for k, tag in tags.items()
            if isinstance(entry.get(k), (int, float)) and not isinstance(entry.get(k), bool)
        ]
        if not scalars:
            return b""
        return event(entry.get("time") or time.time(), int(entry["step"]), scalars)

    def _write(self, entry: Entry) -> None:
        if self._fh is None:
            return
        try:
            self._fh.write(self._event(entry))
            self._fh.flush()
        except OSError as err:
            raise _refused(err, "the TensorBoard log", self.path) from None

    def on_step(self, entry: Entry) -> None:
        self._write(entry)

    def on_epoch(self, entry: Entry) -> None:
        self._write(entry)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


#: ``output.loggers`` names: a registered name, ``package.module:Class`` or ``path/file.py:Class``
LOGGERS: Registry[Callable[..., Logger]] = Registry(
    "logger", {"csv": CSVLogger, "tensorboard": TensorBoardLogger}
)


def open_loggers(names: Iterable[str], run_dir: str | Path, history: Sequence[Entry]) -> list[Any]:
    """The loggers ``names`` (``output.loggers``), each built as ``Cls(run_dir=, history=)``;
    one ``ConfigError`` line for an object that is no logger. On an error the ones already
    open are closed."""
    out: list[Any] = []
    try:
        for name in names:
            obj = LOGGERS.get(name)(run_dir=Path(run_dir), history=list(history))
            missing = [
                m for m in ("on_step", "on_epoch", "close") if not callable(getattr(obj, m, None))
            ]
            if missing:
                raise ConfigError(
                    f"output.loggers: {name!r} built a {type(obj).__name__} without "
                    f"{', '.join(missing)}; subclass theanompi.io.loggers.Logger"
                )
            out.append(obj)
    except BaseException:
        close_all(out)
        raise
    return out


def close_all(loggers: Iterable[Any]) -> None:
    """``close()`` each logger, every one even if one raises (the first error is raised)."""
    first: BaseException | None = None
    for lg in loggers:
        try:
            lg.close()
        except Exception as err:  # noqa: BLE001 - close the rest, then raise
            first = first or err
    if first is not None:
        raise first
