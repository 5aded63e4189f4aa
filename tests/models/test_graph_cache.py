"""Rewritten graphs kept across processes (``theanompi.models.ops._graph_cache``): a process that
finds its graph kept trains bit for bit as one that rewrote it, a graph that differs is never
taken for another, and the values are always the current process's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

from theanompi.models.ops import _graph_cache, c_mode

CHILD = Path(__file__).with_name("graph_cache_child.py")


def _child(cache: str) -> dict:
    env = os.environ | {"THEANOMPI_GRAPH_CACHE": cache}
    proc = subprocess.run(
        [sys.executable, str(CHILD)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_kept_graph_trains_bit_for_bit_in_the_next_process(tmp_path: Path) -> None:
    kept = tmp_path / "graphs"
    rewritten = _child("0")  # no cache: PyTensor's own rewrite
    first = _child(str(kept))
    assert first["stats"] == {"hit": 0, "miss": 2}  # train and eval, rewritten and kept
    assert len(list(kept.glob("*.pkl"))) == 2
    second = _child(str(kept))
    assert second["stats"] == {"hit": 2, "miss": 0}
    for run in (first, second):
        assert run["losses"] == rewritten["losses"]
        assert run["values"] == rewritten["values"]
    # the kept graph's nodes run in the order of the process that rewrote it (PyTensor's own
    # order may differ between processes: its rewrites walk sets of Variables)
    assert second["order"] == first["order"]


@pytest.fixture
def kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("THEANOMPI_GRAPH_CACHE", str(tmp_path))
    monkeypatch.setattr(_graph_cache, "stats", {"hit": 0, "miss": 0})
    return tmp_path


def _scaled(factor: float, dtype: str = "float32", mode=None):
    x = pt.vector("x", dtype=dtype)
    return pytensor.function([x], pt.exp(x) * factor, mode=mode or c_mode())


def test_only_the_same_graph_is_a_hit(kept: Path) -> None:
    v = np.arange(3, dtype="float32")
    assert np.allclose(_scaled(2.0)(v), np.exp(v) * 2)
    assert _graph_cache.stats == {"hit": 0, "miss": 1}
    pt.matrix("unrelated") + 1  # other Variables made in between (process-local names)
    assert np.allclose(_scaled(2.0)(v), np.exp(v) * 2)
    assert _graph_cache.stats == {"hit": 1, "miss": 1}
    assert np.allclose(_scaled(3.0)(v), np.exp(v) * 3)  # another constant
    assert np.allclose(_scaled(2.0, "float64")(v.astype("float64")), np.exp(v) * 2)  # type
    fewer = c_mode().excluding("fusion")  # other rewrites asked for
    assert np.allclose(_scaled(2.0, mode=fewer)(v), np.exp(v) * 2)
    assert _graph_cache.stats == {"hit": 1, "miss": 4}
    assert len(list(kept.glob("*.pkl"))) == 4


def _accumulate(start: float):
    """``s += x`` on a shared ``s`` (an in-place add after rewriting), returning ``s * 2``."""
    s = pytensor.shared(np.full(3, start, dtype="float32"), name="s")
    x = pt.vector("x", dtype="float32")
    return s, pytensor.function([x], s * 2, updates=[(s, s + x)], mode=c_mode())


def test_a_hit_reads_and_updates_this_processs_values(kept: Path) -> None:
    s1, f1 = _accumulate(1.0)
    s2, f2 = _accumulate(10.0)  # the same graph: kept positions, never values
    assert _graph_cache.stats == {"hit": 1, "miss": 1}
    x = np.ones(3, dtype="float32")
    assert np.array_equal(f2(x), np.full(3, 20.0))
    assert np.array_equal(s2.get_value(), np.full(3, 11.0))
    assert np.array_equal(s1.get_value(), np.full(3, 1.0))
    assert np.array_equal(f1(x), np.full(3, 2.0)) and s1.get_value()[0] == 2.0


def test_a_torn_file_is_rewritten_and_replaced(kept: Path) -> None:
    v = np.arange(3, dtype="float32")
    _scaled(2.0)
    (path,) = kept.glob("*.pkl")
    path.write_bytes(b"\x80\x05 not a graph")
    assert np.allclose(_scaled(2.0)(v), np.exp(v) * 2)
    assert _graph_cache.stats == {"hit": 0, "miss": 2}
    assert path.read_bytes() != b"\x80\x05 not a graph"
    _scaled(2.0)
    assert _graph_cache.stats == {"hit": 1, "miss": 2}


def test_off_keeps_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("THEANOMPI_GRAPH_CACHE", "0")
    monkeypatch.setattr(_graph_cache, "stats", {"hit": 0, "miss": 0})
    assert _graph_cache.cache_dir() is None
    _scaled(2.0)
    assert _graph_cache.stats == {"hit": 0, "miss": 0}
    monkeypatch.delenv("THEANOMPI_GRAPH_CACHE")
    assert _graph_cache.cache_dir() == Path(pytensor.config.compiledir) / "theanompi-graphs"
