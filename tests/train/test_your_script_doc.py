"""The README's "Your own script", run as written: its files written out, its ``tmpi run`` and
``mpirun -n 2 python`` lines run on the digits demo data."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from theanompi.launch.testing import REPO

pytestmark = pytest.mark.mpi

BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def section() -> str:
    text = (REPO / "README.md").read_text()
    return text.split("\n## Your own script\n", 1)[1].split("\n## ", 1)[0]


def write_blocks(text: str, folder: Path) -> list[list[str]]:
    """Each python block whose first line is ``# NAME`` into ``folder/NAME``; the command lines
    of the sh blocks, split, ``data/digits`` as given."""
    commands = []
    for lang, body in BLOCK.findall(text):
        first = body.splitlines()[0]
        if lang == "python" and re.fullmatch(r"# [\w.]+", first):
            (folder / first[2:]).write_text(body)
        elif lang == "sh":
            commands += [shlex.split(ln.split("  #")[0]) for ln in body.splitlines() if ln]
    return commands


def test_the_readme_section_runs_as_written(cli, mpirun, digits_data: Path, tmp_path: Path) -> None:
    commands = write_blocks(section(), tmp_path)
    assert {"fit_digits.py", "own_loop.py"} <= {p.name for p in tmp_path.iterdir()}
    assert [c[:3] for c in commands] == [
        ["tmpi", "run", "-n"],
        ["mpirun", "-n", "2"],
        ["tmpi", "run", "-n"],
    ]
    errors = []
    for argv in commands:
        argv = [str(digits_data) if a == "data/digits" else a for a in argv]
        if argv[0] == "tmpi":
            out = cli(*argv[1:], cwd=tmp_path)
        else:  # mpirun -n 2 python SCRIPT ARGS
            assert argv[3] == "python"
            out = mpirun(int(argv[2]), argv[4:], cwd=tmp_path, timeout=600)
        assert out.returncode == 0, f"{shlex.join(argv)}\n{out.stderr[-3000:]}"
        summary = re.findall(r"^val top-1 error (\S+) %$", out.stdout, re.M)
        if summary:  # the summary's percent is the figure the progress line printed
            assert summary == re.findall(r"top-1 err (\S+)%", out.stdout)[-1:], out.stdout
            errors += summary
        if "own_loop.py" in argv:
            assert re.search(r"^2 ranks: loss \S+, b 0\.500$", out.stdout, re.M), out.stdout
    assert len(errors) == 2 and errors[0] == errors[1]  # either launcher: the same run
    for run in ("fit-digits", "fit-digits-mpirun"):
        assert (tmp_path / "runs" / run / "checkpoints" / "epoch_0002.npz").is_file()
