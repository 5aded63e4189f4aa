"""docs/your_model.md and the README's "Your own model", run as written: their files are written
out, their ``tmpi`` commands run on the digits demo data, and the network written from scratch
reaches the demo's accuracy class."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from theanompi.launch.testing import REPO

pytestmark = pytest.mark.mpi

DOC = REPO / "docs" / "your_model.md"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def write_blocks(text: str, folder: Path) -> list[str]:
    """Write each python/yaml block whose first line is ``# NAME`` to ``folder/NAME``; the
    ``tmpi`` lines of the sh blocks, in order."""
    commands = []
    for lang, body in BLOCK.findall(text):
        first = body.splitlines()[0]
        if lang in ("python", "yaml") and re.fullmatch(r"# [\w.]+", first):
            (folder / first[2:]).write_text(body)
        elif lang == "sh":
            commands += [ln for ln in body.splitlines() if ln.startswith("tmpi ")]
    return commands


def run_as_written(cli, commands: list[str], data: Path, cwd: Path) -> list[str]:
    """Each command's stdout, ``data/digits`` read as ``data``; a failure names the command."""
    outs = []
    for line in commands:
        args = [str(data) if a == "data/digits" else a for a in shlex.split(line)[1:]]
        out = cli(*args, cwd=cwd)
        assert out.returncode == 0, f"{line}\n{out.stderr[-3000:]}"
        outs.append(out.stdout)
    return outs


def test_the_readme_section_runs_as_written(cli, digits_data: Path, tmp_path: Path) -> None:
    section = (REPO / "README.md").read_text().split("\n## Your own model", 1)[1]
    commands = write_blocks(section.split("\n## ", 1)[0], tmp_path)
    assert (tmp_path / "softmax.py").is_file() and len(commands) == 2
    train, evaluate = run_as_written(cli, commands, digits_data, tmp_path)
    err = re.findall(r"top-1 err (\S+)%", train)[-1]
    assert re.search(rf"^\s+{re.escape(err)} %", evaluate, re.M), evaluate


def test_the_tutorial_runs_as_written(cli, digits_data: Path, tmp_path: Path) -> None:
    commands = write_blocks(DOC.read_text(), tmp_path)
    assert {"mymlp.py", "mymlp.yaml", "wrapped.py"} <= {p.name for p in tmp_path.iterdir()}
    assert len(commands) == 4
    first = run_as_written(cli, commands, digits_data, tmp_path)[0]  # mymlp.py, 6 epochs
    err = float(re.findall(r"top-1 err (\S+)%", first)[-1])
    assert err <= 10.0, first[-2000:]  # the small CNN's class: ~5 %
    assert (tmp_path / "runs" / "MyMLP" / "checkpoints" / "epoch_0008.npz").is_file()
    assert (tmp_path / "runs" / "mymlp-adamw" / "checkpoints" / "epoch_0006.npz").is_file()
    wrapped = subprocess.run(
        [sys.executable, "wrapped.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert wrapped.returncode == 0, wrapped.stderr[-3000:]
