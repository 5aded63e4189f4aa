"""bench: the benchmark runs end to end on a few images and prints its table."""

from __future__ import annotations

from pathlib import Path

import pytest

from prep import bench


@pytest.mark.mpi
def test_bench_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--images", "20", "--width", "64", "--height", "48", "--size", "16"]
    args += ["--batch-size", "4", "--repeats", "1", "--ranks", "2", "--work", str(tmp_path)]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    assert "naive PIL" in out and out.count("ours (prep batch)") == 1
    assert "decode only (simplejpeg)" in out and "x bound" in out


def test_link_tree_scans_every_file(tmp_path: Path) -> None:
    """The scale tree (hard links, one JPEG per class) scans clean: every link found, labelled."""
    from prep import scan, shuffle

    made = bench.make_link_tree(tmp_path / "src", 1003, 7, val_per_class=3)
    assert made == 1003 + 21
    res = scan.run(tmp_path / "src", tmp_path / "out")
    assert len(res["train"]) == 1003 and len(res["val"]) == 21 and res["skipped"] == []
    assert {lab for _, lab in res["train"]} == set(range(7))
    assert all(rel.split("/")[1] == f"n{lab:08d}" for rel, lab in res["train"] + res["val"])
    assert shuffle.run(tmp_path / "out", seed=1) == 1003


@pytest.mark.mpi
def test_scan_scale_reports_rate_and_memory(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--scan-tree", "400", "--classes", "4", "--ranks", "2"]) == 0
    out = capsys.readouterr().out
    assert "scan scale: 600 files" in out and "on 2 rank(s)" in out and "peak RSS" in out


@pytest.mark.mpi
def test_bench_times_a_fresh_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With 1 rank, a fresh ``tmpi prep batch -n 1`` gets its own row and ratio."""
    args = ["--images", "20", "--width", "64", "--height", "48", "--size", "16"]
    args += ["--batch-size", "4", "--repeats", "1", "--ranks", "1", "--work", str(tmp_path)]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("ours, fresh process"))
    assert row.split()[3] == "1"  # ranks
    assert "fresh process (tmpi prep batch -n 1, wall) / naive" in out
    assert "; fresh1 " in out  # its runs are listed with the others'
