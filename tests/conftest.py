"""Shared fixtures: PyTensor set-up and a real ``mpirun`` launcher for MPI tests."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

import pytest

from theanompi.pytensor_env import configure
from theanompi.testing import REPO, run_mpi, tmpi

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
