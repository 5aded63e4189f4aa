"""The abort hook and launcher under real mpirun: one failing rank stops the job with one line."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from theanompi.comm import is_power_of_two
from theanompi.io import atomic_write, write_json

RAISER = """
import sys, time
from theanompi.comm import install_abort_hook, world
install_abort_hook()
comm = world()
if comm.Get_rank() == int(sys.argv[1]):
    time.sleep(0.5)
    raise RuntimeError("boom from the test")
comm.Barrier()  # the other ranks would wait here forever without the hook
"""


@pytest.mark.mpi
def test_one_rank_raising_aborts_the_job_quickly(mpirun, tmp_path: Path) -> None:
    script = tmp_path / "raiser.py"
    script.write_text(RAISER)
    start = time.monotonic()
    out = mpirun(2, [script, "1"], timeout=60, check=False)
    assert time.monotonic() - start < 30
    assert out.returncode != 0
    assert "tmpi: error on rank 1/2: RuntimeError: boom from the test" in out.stderr


def test_power_of_two() -> None:
    assert [n for n in range(1, 17) if is_power_of_two(n)] == [1, 2, 4, 8, 16]
    assert not is_power_of_two(0)


def test_atomic_write_leaves_nothing_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "out.json"
    write_json(target, {"a": 1})
    with pytest.raises(ValueError), atomic_write(target) as tmp:
        tmp.write_text("half")
        raise ValueError("interrupted")
    assert target.read_text().strip().startswith("{") and '"a": 1' in target.read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]
