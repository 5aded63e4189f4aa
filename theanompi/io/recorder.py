"""The run's record and the loggers fed from it: opened with the ``start`` entry, one ``step``/``epoch`` entry at a time, closed together."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from theanompi.comm import collective
from theanompi.io.loggers import close_all
from theanompi.io.record import RecordWriter, read_record

__all__ = ["Recorder"]


def _open_loggers(
    names: Sequence[str], run_dir: str | Path, record: RecordWriter, enabled: bool
) -> list[Any]:
    """``output.loggers``, on the rank that writes the record (``enabled``), fed the record
    as it stands now (a resumed run's kept entries, then this start)."""
    if not enabled or not names:
        return []
    from theanompi.io.loggers import open_loggers

    return open_loggers(names, run_dir, read_record(record.path))


class Recorder:
    """Every entry of the run goes to the record first, then, as written, to each logger.

    Parameters
    ----------
    record
        :class:`~theanompi.io.record.RecordWriter` (enabled on rank 0 only).
    loggers
        :class:`~theanompi.io.loggers.Logger` objects fed each ``step`` and ``epoch`` entry
        (on the rank that writes the record only).
    """

    def __init__(self, record: Any, loggers: Sequence[Any] = (), lost_steps: int = 0) -> None:
        self.record = record
        self.loggers = list(loggers)
        self.lost_steps = lost_steps

    @classmethod
    def open(
        cls,
        comm: Any,
        record_dir: str | Path,
        *,
        loggers: Sequence[str],
        run_dir: str | Path,
        start_epoch: int,
        resumed: bool,
        shrunk: bool,
        resumed_step: int,
        start: dict[str, Any],
        epoch_entry: dict[str, Any] | None = None,
    ) -> Recorder:
        """Collective: the record in ``record_dir`` (written by rank 0) opened with the
        ``start`` entry, and the loggers named (``output.loggers``) writing under ``run_dir``.

        The entries kept: after an elastic shrink (``shrunk``) all of them, as the epoch goes
        on; on a resume those before ``start_epoch`` (the unfinished one is trained again);
        else none (a new run).

        The start entry's ``lost_steps`` (also ``lost_steps`` here, on rank 0): the steps the
        record shows done after ``resumed_step``, the checkpoint a resume starts from, i.e.
        the work of a run killed before its next checkpoint (a preemption's grace time too
        short for a step boundary), trained again. A lower bound: the record notes progress
        every ``print_freq`` steps.

        ``epoch_entry``: the entry of the epoch that the checkpoint resumed from closed, which
        the checkpoint carries; written back if the record lacks it (a run killed between
        the checkpoint and its record line)."""
        enabled = comm.Get_rank() == 0
        kept = start_epoch + 1 if shrunk else (start_epoch if resumed else None)
        record = RecordWriter(record_dir, enabled=enabled, keep_before_epoch=kept)
        if enabled and resumed and not shrunk and epoch_entry is not None:
            done = {r.get("epoch") for r in read_record(record.path) if r.get("kind") == "epoch"}
            if epoch_entry.get("epoch") not in done:
                record.write("epoch", **epoch_entry)
        lost = max(0, record.last_step - resumed_step)
        record.write("start", lost_steps=lost, **start)
        opened = collective(comm, _open_loggers, loggers, run_dir, record, enabled)
        return cls(record, opened, lost)

    def add_step(self, entry: dict[str, Any]) -> None:
        """A progress window's ``step`` entry."""
        written = self.record.write("step", **entry)
        for lg in self.loggers:
            lg.on_step(written)

    def add_epoch(self, **fields: Any) -> None:
        """An ``epoch`` entry."""
        written = self.record.write("epoch", **fields)
        for lg in self.loggers:
            lg.on_epoch(written)

    def add_end(self, summary: dict[str, Any]) -> None:
        """The ``end`` entry: the run's summary (the loggers have no use for it)."""
        self.record.write("end", **summary)

    def close(self) -> None:
        """Close the record, then every logger (even if one raises)."""
        try:
            self.record.close()
        finally:
            close_all(self.loggers)
