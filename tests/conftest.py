"""Shared fixtures: PyTensor set-up and a real ``mpirun`` launcher for MPI tests."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from theanompi.launch.testing import REPO, run_mpi, tmpi
from theanompi.pytensor_env import configure

configure()

__all__ = ["REPO", "run_mpi", "tmpi"]


@pytest.fixture
def mpirun() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``mpirun(n, [script, *args], timeout=300, env=None, check=True)``: real MPI ranks."""
    return run_mpi


@pytest.fixture
def cli() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``cli("train", "--help")``: the real ``tmpi`` CLI in a subprocess."""
    return tmpi


@pytest.fixture(scope="session")
def digits_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits demo prepped as ``make data`` does (``tmpi prep demo``, then ``tmpi prep all
    -n 2 --size 32``), once per session; read-only: a test that corrupts files copies it."""
    root = tmp_path_factory.mktemp("digits")
    out = tmpi("prep", "demo", "--out", str(root / "tree"))
    assert out.returncode == 0, out.stderr
    prep = ["--src", str(root / "tree"), "--out", str(root / "data"), "--size", "32"]
    out = tmpi("prep", "all", "-n", "2", *prep)
    assert out.returncode == 0, out.stderr
    return root / "data"
