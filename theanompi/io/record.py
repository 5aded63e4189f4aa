"""The training record: one JSON object per line (``<record_dir>/record.jsonl``).

Each line has a ``kind``: ``"start"`` (run settings), ``"step"`` (a window of
``print_freq`` steps: loss, error, images/s, ms in compute / exchange / data
wait, lr), ``"epoch"`` (train and val metrics of a finished epoch), ``"end"``, or
``"restart"`` (written by the ``tmpi train -n N --max-restarts K`` launcher between two
attempts: :func:`append_entry`).
Lines are flushed as written, so a crashed run keeps everything up to its last
step; :func:`read_record` skips a torn last line.

>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> with RecordWriter(d) as rec:
...     rec.write("epoch", epoch=0, val_top1_err=0.1)
>>> [r["kind"] for r in read_record(d)]
['epoch']
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from theanompi.errors import resource_error
from theanompi.io.atomic import atomic_write

__all__ = ["RECORD_NAME", "RecordWriter", "append_entry", "json_safe", "read_record", "record_file"]

RECORD_NAME = "record.jsonl"


def record_file(path: str | Path) -> Path:
    """The record file for a record dir, a run dir (``<run>/record/record.jsonl``) or a file path."""
    p = Path(path)
    if p.suffix == ".jsonl":
        return p
    if (p / RECORD_NAME).exists() or not (p / "record" / RECORD_NAME).exists():
        return p / RECORD_NAME
    return p / "record" / RECORD_NAME


def read_record(path: str | Path) -> list[dict[str, Any]]:
    """All entries of a record (see :func:`record_file` for ``path``); ``[]`` if none."""
    f = record_file(path)
    if not f.exists():
        return []
    out = []
    for line in f.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a torn last line of a killed run
            continue
    return out


def json_safe(v: Any) -> Any:
    """JSON-safe value: numpy scalars to Python, NaN/inf to None."""
    if hasattr(v, "item") and not isinstance(v, (list, dict, str)):
        try:
            v = v.item()
        except (ValueError, TypeError):
            pass
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    return v


def append_entry(record_dir: str | Path, kind: str, **fields: Any) -> None:
    """Append one entry to ``<record_dir>/record.jsonl`` while no :class:`RecordWriter` has it
    open (the launcher, between two attempts of a job)."""
    path = Path(record_dir) / RECORD_NAME
    entry = {"kind": kind, "time": round(time.time(), 3), **json_safe(fields)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as fh:
            fh.write(json.dumps(entry, sort_keys=True) + "\n")
    except OSError as err:
        raise resource_error(err, "the training record", path) or err from None


class RecordWriter:
    """Append JSON lines to ``<record_dir>/record.jsonl``; a no-op when ``enabled`` is False.

    Parameters
    ----------
    record_dir : folder to write ``record.jsonl`` in (created).
    enabled : write at all (pass ``rank == 0``).
    keep_before_epoch : on resume, first drop entries of epochs ``>=`` this one (they
        belong to the unfinished epoch that is about to be re-run); ``None`` starts
        a fresh record (an existing one is replaced).
    """

    def __init__(
        self, record_dir: str | Path, *, enabled: bool = True, keep_before_epoch: int | None = None
    ) -> None:
        self.path = Path(record_dir) / RECORD_NAME
        self.enabled = enabled
        self._fh = None
        #: the last optimiser step the record held before a resume cut it back (0: none)
        self.last_step = 0
        if not enabled:
            return
        try:
            self._open(keep_before_epoch)
        except OSError as err:
            raise self._refused(err) from None

    def _refused(self, err: OSError) -> Exception:
        return resource_error(err, "the training record", self.path, "output.record_dir") or err

    def _open(self, keep_before_epoch: int | None) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if keep_before_epoch is None:
            kept: list[dict[str, Any]] = []
        else:
            old = read_record(self.path)
            steps = [r["step"] for r in old if isinstance(r.get("step"), int)]
            self.last_step = max(steps, default=0)
            kept = [
                r
                for r in old
                if int(r.get("epoch", -1)) < keep_before_epoch or r.get("kind") == "start"
            ]
        with atomic_write(self.path) as tmp:
            tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
        self._fh = open(self.path, "a", buffering=1)  # noqa: SIM115 - closed in close()

    def write(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Append one entry ``{"kind": kind, "time": <unix s>, **fields}`` and flush; returns
        the entry as written (JSON values: what the loggers are fed), also when disabled."""
        entry = {"kind": kind, "time": round(time.time(), 3), **json_safe(fields)}
        if self._fh is None:
            return entry
        try:
            self._fh.write(json.dumps(entry, sort_keys=True) + "\n")
            self._fh.flush()
        except OSError as err:  # a torn last line is skipped by read_record
            raise self._refused(err) from None
        return entry

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
