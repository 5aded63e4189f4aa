"""``--max-restarts`` is checked before any job starts: one line, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from theanompi.launch.testing import tmpi

MODEL = str(Path(__file__).with_name("model_tiny_mlp.yaml"))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-restarts", "1"], "--max-restarts needs -n N"),
        (["-n", "2", "--max-restarts", "-1"], "--max-restarts must be >= 0, got -1"),
    ],
)
def test_max_restarts_needs_n_and_a_count(tmp_path: Path, flags: list[str], message: str) -> None:
    out = tmpi("train", "--model", MODEL, "--run-dir", str(tmp_path / "r"), *flags, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tmpi: error: ") and message in lines[0]
    assert not (tmp_path / "r").exists()
