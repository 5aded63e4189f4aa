"""Start-up checks across nodes: versions, data and run dir (the cluster tests run them across
two simulated nodes; here the rules on facts as ranks report them)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from theanompi.errors import ConfigError, DataError
from theanompi.train.startup import _check_run_dir, _compare, node_facts

V = {"theanompi": "1.0", "pytensor": "2.30.0", "numpy": "1.26.4"}


def _fact(host: str, data: str | None = "abc", **versions: str) -> dict:
    return {"host": host, "versions": V | versions, "data": data}


def test_same_everywhere_passes_and_node_facts_reads_the_manifest(tmp_path: Path) -> None:
    _compare([_fact("a"), _fact("b")], "d")
    _compare([_fact("a", None), _fact("b", None)], "d")  # nowhere: the loaders report it
    (tmp_path / "misc").mkdir()
    (tmp_path / "misc" / "manifest.json").write_text('{"checksum": "f00"}')
    assert node_facts(tmp_path)["data"] == "f00"
    assert node_facts(tmp_path / "nope")["data"] is None


def test_differences_name_the_node() -> None:
    with pytest.raises(ConfigError, match=r"^pytensor 2.31.0 on b but 2.30.0 on a \(rank 0\)"):
        _compare([_fact("a"), _fact("b", pytensor="2.31.0")], "d")
    with pytest.raises(DataError, match=r"'d' \(its misc/manifest.json\) is missing on b but"):
        _compare([_fact("a"), _fact("b", None)], "d")
    with pytest.raises(DataError, match=r"differs between a and c \(manifest checksum abc vs x"):
        _compare([_fact("a"), _fact("b"), _fact("c", "x")], "d")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_run_dir(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match="is not writable from rank 0's node"):
        _check_run_dir(ro / "run")


def test_run_dir_check_creates_nothing(tmp_path: Path) -> None:
    _check_run_dir(tmp_path / "a" / "b")
    _check_run_dir(tmp_path)
    assert list(tmp_path.iterdir()) == []
