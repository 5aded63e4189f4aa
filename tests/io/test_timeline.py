"""``Timeline``: a Chrome trace with one process per rank; one process and real ``mpirun``."""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from mpi4py import MPI

from theanompi.errors import ConfigError
from theanompi.io.timeline import Timeline

HERE = Path(__file__).resolve().parent
PER_RANK = HERE / "mpi_timeline.py"
LOOP_SPANS = {"compute", "exchange", "wait", "validate", "checkpoint"}
EPS_US = 0.002  # ts and dur are rounded to 1 ns separately


def _load(path: Path) -> dict[str, Any]:
    trace = json.loads(path.read_text())
    assert trace["displayTimeUnit"] == "ms"
    return trace


def _spans(trace: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
    """``pid -> complete events`` sorted by start, after checking each event's fields."""
    out: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for ev in trace["traceEvents"]:
        if ev["ph"] == "X":
            assert isinstance(ev["ts"], (int, float)) and ev["dur"] >= 0, ev
            out[ev["pid"]].append(ev)
    return {pid: sorted(evs, key=lambda e: e["ts"]) for pid, evs in out.items()}


def _process_names(trace: dict[str, Any]) -> dict[int, str]:
    names = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"]
    assert len({e["pid"] for e in names}) == len(names), "one process_name per pid"
    return {e["pid"]: e["args"]["name"] for e in names}


def _assert_no_overlap(evs: list[dict[str, Any]]) -> None:
    for a, b in zip(evs, evs[1:], strict=False):
        assert a["ts"] + a["dur"] <= b["ts"] + EPS_US, (a, b)


def test_one_process_trace(tmp_path: Path) -> None:
    out = tmp_path / "sub" / "timeline.json"
    tl = Timeline(out, None)
    assert tl.enabled
    for step in range(3):
        with tl.span("compute", {"step": step}):
            time.sleep(0.001)
        t0 = MPI.Wtime()
        tl.add("exchange", t0, MPI.Wtime(), step=step)
    tl.add("wait", 5.0, 4.0, {"a": 1}, b=2)  # end before start: kept, with duration 0
    assert not out.exists()
    assert tl.close() == out and not tl.enabled
    assert tl.close() is None  # a second close does nothing
    trace = _load(out)
    assert _process_names(trace) == {0: "rank 0"}
    spans = _spans(trace)[0]
    assert [e["name"] for e in spans if e["name"] != "wait"] == ["compute", "exchange"] * 3
    assert [e["args"] for e in spans if e["name"] == "compute"] == [{"step": s} for s in range(3)]
    assert all(e["dur"] >= 900 for e in spans if e["name"] == "compute")  # us
    assert [e["args"] for e in spans if e["name"] == "exchange"] == [{"step": s} for s in range(3)]
    assert [(e["dur"], e["args"]) for e in spans if e["name"] == "wait"] == [(0, {"a": 1, "b": 2})]
    _assert_no_overlap([e for e in spans if e["name"] != "wait"])
    assert trace["otherData"]["dropped_events"] == {}
    assert [p.name for p in out.parent.iterdir()] == ["timeline.json"]  # no temp file left


def test_nested_spans_and_threads(tmp_path: Path) -> None:
    tl = Timeline(tmp_path / "t.json", MPI.COMM_SELF)
    with tl.span("validate"), tl.span("compute"):
        pass

    def loader() -> None:
        with tl.span("load"):
            pass

    th = threading.Thread(target=loader, name="prefetch")
    th.start()
    th.join()
    trace = _load(tl.close())
    spans = {e["name"]: e for e in _spans(trace)[0]}
    outer, inner = spans["validate"], spans["compute"]
    assert outer["ts"] <= inner["ts"] + EPS_US
    assert inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + EPS_US
    assert spans["load"]["tid"] != outer["tid"] == inner["tid"] == 0
    threads = {
        e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"
    }
    assert threads[spans["load"]["tid"]] == "prefetch"


def test_disabled_records_nothing(tmp_path: Path) -> None:
    for path in (None, ""):
        tl = Timeline(path, MPI.COMM_SELF)
        assert not tl.enabled
        with tl.span("compute"):
            pass
        tl.add("exchange", 0.0, 1.0)
        assert tl.dropped == 0 and tl.close() is None
    assert list(tmp_path.iterdir()) == []


def test_memory_bound_keeps_first_and_last(tmp_path: Path) -> None:
    tl = Timeline(tmp_path / "t.json", None, max_events=5)
    for i in range(12):
        tl.add("compute", float(i), i + 0.5, {"i": i})
    assert tl.dropped == 7
    trace = _load(tl.close())
    assert [e["args"]["i"] for e in _spans(trace)[0]] == [0, 1, 2, 10, 11]
    assert trace["otherData"]["dropped_events"] == {"0": 7}
    labels = [e for e in trace["traceEvents"] if e["name"] == "process_labels"]
    assert labels and "7 spans dropped" in labels[0]["args"]["labels"]


def test_bad_path_is_a_one_line_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="timeline path .*file/sub/t.json") as err:
        Timeline(blocker / "sub" / "t.json", None)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="is a folder"):
        Timeline(tmp_path, None)
    with pytest.raises(ValueError, match="max_events"):
        Timeline(tmp_path / "t.json", None, max_events=0)


@pytest.mark.mpi
def test_two_ranks_one_trace(mpirun, tmp_path: Path) -> None:
    out = tmp_path / "tl" / "timeline.json"
    mpirun(2, [PER_RANK, out, "--late-rank=1"], timeout=120)
    trace = _load(out)
    assert _process_names(trace) == {0: "rank 0", 1: "rank 1"}
    spans = _spans(trace)
    assert set(spans) == {0, 1}
    for evs in spans.values():
        names = [e["name"] for e in evs]
        assert LOOP_SPANS <= set(names) and names.count("compute") == 5
        assert [e["args"]["step"] for e in evs if e["name"] == "exchange"] == list(range(5))
        _assert_no_overlap(evs)
    assert all(e["dur"] >= 3500 for e in spans[1] if e["name"] == "compute")  # 4 ms sleeps
    # one time axis: rank 1 constructed 0.5 s late, yet the post-barrier marks line up
    marks = [next(e["ts"] for e in spans[r] if e["name"] == "mark") for r in (0, 1)]
    assert abs(marks[0] - marks[1]) < 150_000, marks
    assert [p.name for p in out.parent.iterdir()] == ["timeline.json"]


@pytest.mark.mpi
def test_server_rank_takes_part_by_closing(mpirun, tmp_path: Path) -> None:
    out = tmp_path / "timeline.json"
    mpirun(3, [PER_RANK, out, "--server"], timeout=120)
    trace = _load(out)
    assert _process_names(trace) == {0: "rank 0", 1: "rank 1", 2: "rank 2 (server)"}
    assert set(_spans(trace)) == {0, 1}


@pytest.mark.mpi
def test_bad_path_fails_on_every_rank_with_one_line(mpirun, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = mpirun(2, [PER_RANK, blocker / "t.json"], timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("tmpi: error:")]
    assert len(lines) == 1 and "timeline path" in lines[0] and str(blocker) in lines[0]
