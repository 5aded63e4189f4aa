"""A full disk (a small tmpfs) or a folder turned read-only while training: one line naming the
path and what was being written, exit 4, nothing half-written under a final name, no side file
without its main file. Real mounts (root only), real mpirun."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fault"))
from harness import Job, mpirun_argv, tiny_train_args, write_tiny_data  # noqa: E402

from theanompi.errors import EXIT_RESOURCE, resource_error  # noqa: E402
from theanompi.io.checkpoint import list_checkpoints, load_checkpoint  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.slow]
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_data(tmp_path_factory.mktemp("res") / "data")


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _one_error(stderr: str) -> str:
    # under a bare mpirun, Open MPI's abort banner is written beside our line and may leave a
    # stray space or NUL in front of it (seen in CI): the line itself must be there, once
    errs = [
        ln.lstrip(" \0") for ln in stderr.splitlines() if ln.lstrip(" \0").startswith("tmpi: error")
    ]
    assert len(errs) == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    return errs[0]


def _clean(ckpt_dir: Path) -> None:
    names = [p.name for p in ckpt_dir.iterdir()]
    assert not [n for n in names if n.startswith(".")], f"temp files left: {names}"
    mains = {p.name for p in list_checkpoints(ckpt_dir)}
    for n in names:
        if ".rank" in n:
            assert n.split(".rank")[0] + ".npz" in mains, f"side file without main: {n}"
    for m in mains:
        load_checkpoint(ckpt_dir / m)  # every main file is whole


def test_resource_error_line_for_each_errno() -> None:
    assert resource_error(OSError(errno.EIO, "io"), "checkpoint", "/x") is None
    ro = resource_error(OSError(errno.EROFS, "ro"), "the training record", "/r/record.jsonl")
    assert ro is not None and ro.exit_code == EXIT_RESOURCE == 4
    assert str(ro).startswith("cannot write the training record '/r/record.jsonl': read-only")


@root_only
def test_disk_full_while_checkpointing(data: Path, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", "100k") as small:
        ck = small / "ck"
        argv = mpirun_argv(
            2,
            *tiny_train_args(
                data,
                tmp_path / "run",
                "--set",
                f"output.checkpoint_dir={ck}",
                "--set",
                "output.checkpoint_every_steps=2",
                epochs=50,
            ),
        )
        with Job(argv) as job:
            out = job.wait(timeout=180)
        assert out.returncode == EXIT_RESOURCE, out.stderr[-3000:]
        line = _one_error(out.stderr)
        assert f"cannot write checkpoint '{ck}/epoch_" in line, line
        assert "no space left on the device" in line and "output.checkpoint_dir" in line, line
        _clean(ck)


@root_only
def test_folder_turned_read_only_mid_run(data: Path, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "mnt", "4m") as mnt:
        ck = mnt / "ck"
        argv = mpirun_argv(
            2, *tiny_train_args(data, tmp_path / "run", "--set", f"output.checkpoint_dir={ck}")
        )
        with Job(argv) as job:
            job.wait_for(r"epoch 2/\d+ done", timeout=180)
            subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
            out = job.wait(timeout=60)
        assert out.returncode == EXIT_RESOURCE, out.stderr[-3000:]
        line = _one_error(out.stderr)
        # rank 1's side file is written first: whichever write met the mount first is named
        assert re.search(rf"cannot write (checkpoint|rank 1 checkpoint state) '{ck}/epoch_", line)
        assert "read-only file system" in line, line
        _clean(ck)


@root_only
def test_disk_full_while_writing_the_record(data: Path, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "rec", "12k") as rec:
        argv = mpirun_argv(
            2,
            *tiny_train_args(
                data,
                tmp_path / "run",
                "--set",
                f"output.record_dir={rec}",
                "--set",
                "training.print_freq=1",
                epochs=1000,
            ),
        )
        with Job(argv) as job:
            out = job.wait(timeout=180)
            left, _ = job.wait_gone(timeout=10)
        assert out.returncode == EXIT_RESOURCE, out.stderr[-3000:]
        line = _one_error(out.stderr)
        assert f"cannot write the training record '{rec}/record.jsonl'" in line, line
        assert "no space left on the device" in line and "output.record_dir" in line, line
        assert not left
