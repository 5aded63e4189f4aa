"""The JSON-lines record: write, read back, torn lines, resume truncation."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from theanompi.io.record import RecordWriter, read_record, record_file


def test_write_and_read_back(tmp_path: Path) -> None:
    with RecordWriter(tmp_path / "record") as rec:
        rec.write("start", world_size=2)
        rec.write("step", epoch=0, step=10, loss=np.float32(1.5), error=float("nan"))
        rec.write("epoch", epoch=0, val_top1_err=0.1)
    rows = read_record(tmp_path)  # a run dir finds record/record.jsonl
    assert [r["kind"] for r in rows] == ["start", "step", "epoch"]
    assert rows[1]["loss"] == 1.5 and rows[1]["error"] is None
    assert all(isinstance(r["time"], float) for r in rows)
    assert record_file(tmp_path) == tmp_path / "record" / "record.jsonl"
    assert read_record(tmp_path / "record" / "record.jsonl") == rows


def test_torn_last_line_is_skipped(tmp_path: Path) -> None:
    with RecordWriter(tmp_path) as rec:
        rec.write("epoch", epoch=0)
    with open(tmp_path / "record.jsonl", "a") as fh:
        fh.write('{"kind": "step", "epo')
    assert [r["kind"] for r in read_record(tmp_path)] == ["epoch"]


def test_resume_drops_entries_of_rerun_epochs(tmp_path: Path) -> None:
    with RecordWriter(tmp_path) as rec:
        rec.write("start")
        for e in range(3):
            rec.write("step", epoch=e)
            rec.write("epoch", epoch=e)
    with RecordWriter(tmp_path, keep_before_epoch=2) as rec:
        rec.write("step", epoch=2, loss=0.5)
    rows = read_record(tmp_path)
    assert [(r["kind"], r.get("epoch")) for r in rows] == [
        ("start", None),
        ("step", 0),
        ("epoch", 0),
        ("step", 1),
        ("epoch", 1),
        ("step", 2),
    ]
    assert math.isclose(rows[-1]["loss"], 0.5)


def test_disabled_writer_writes_nothing(tmp_path: Path) -> None:
    rec = RecordWriter(tmp_path / "r", enabled=False)
    rec.write("epoch", epoch=0)
    rec.close()
    assert not (tmp_path / "r").exists()


def test_fresh_writer_replaces_an_old_record(tmp_path: Path) -> None:
    with RecordWriter(tmp_path) as rec:
        rec.write("epoch", epoch=5)
    with RecordWriter(tmp_path) as rec:
        rec.write("epoch", epoch=0)
    assert [r["epoch"] for r in read_record(tmp_path)] == [0]
