"""Shared fixtures: PyTensor set-up and a real ``mpirun`` launcher for MPI tests."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from theanompi.launch.restart import RETRY_LOG_ENV
from theanompi.launch.testing import REPO, run_mpi, tmpi
from theanompi.pytensor_env import configure

__all__ = ["REPO", "run_mpi", "tmpi"]

_RETRY_LOG = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """PyTensor set up in each process that runs tests, not in pytest-xdist's controller: the
    workers inherit its environment, and would take its BLAS threads for the user's. The
    first process (controller, or the only one) names the file where every launch that mpirun
    failed to start, and that was launched again, is noted (:func:`pytest_terminal_summary`)."""
    if hasattr(config, "workerinput"):  # an xdist worker
        configure()
        return
    fd, path = tempfile.mkstemp(prefix="tmpi-retries-", suffix=".log")
    os.close(fd)
    os.environ[RETRY_LOG_ENV] = config.stash[_RETRY_LOG] = path
    if not getattr(config.option, "numprocesses", None):  # no workers: this process tests
        configure()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules with a ``slow`` test first (each module kept together, for its fixtures): the
    pytest-xdist workers then start on the long scenarios, rather than one of them running
    the longest last while the other has finished."""
    slow = {item.module for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module not in slow)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """How many launches mpirun failed to start and were launched again (as ``tmpi`` does for
    users): each is a retry, never a silent one."""
    path = config.stash.get(_RETRY_LOG, None)
    if path is None:
        return
    log = Path(path)
    lines = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    terminalreporter.write_line(f"mpirun launches retried (failed to start): {len(lines)}")
    for line in lines:
        terminalreporter.write_line(f"  {line}")


@pytest.fixture
def mpirun() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``mpirun(n, [script, *args], timeout=300, env=None, check=True)``: real MPI ranks."""
    return run_mpi


@pytest.fixture
def cli() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``cli("train", "--help")``: the real ``tmpi`` CLI in a subprocess."""
    return tmpi


def once_per_run(
    tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]
) -> Path:
    """``make(folder)`` once per test run, shared by the pytest-xdist workers: the first worker
    builds it under a file lock, beside the workers' own temp folders; the others wait, then
    use it. Without xdist: once per session. ``folder`` is complete only once ``make`` returns."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # shared by the run's workers
    done = base / f"{name}.done"
    with FileLock(base / f"{name}.lock"):
        if not done.exists():
            make(base / name)
            done.touch()
    return base / name


@pytest.fixture(scope="session")
def digits_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits demo prepped as ``make data`` does (``tmpi prep demo``, then ``tmpi prep all
    -n 2 --size 32``), once per test run; read-only: a test that corrupts files copies it."""

    def make(root: Path) -> None:
        out = tmpi("prep", "demo", "--out", str(root / "tree"))
        assert out.returncode == 0, out.stderr
        prep = ["--src", str(root / "tree"), "--out", str(root / "data"), "--size", "32"]
        out = tmpi("prep", "all", "-n", "2", *prep)
        assert out.returncode == 0, out.stderr

    return once_per_run(tmp_path_factory, "digits", make) / "data"
