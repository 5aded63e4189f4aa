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
