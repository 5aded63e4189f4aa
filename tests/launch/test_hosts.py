"""Placement of ranks: hostfiles, -H lists, Slurm allocations, and the mpirun line they make."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from theanompi.errors import ConfigError
from theanompi.launch.hosts import (
    PLACEMENT_FLAGS,
    Placement,
    expand_slurm_nodelist,
    parse_host_list,
    read_hostfile,
    slurm_hosts,
    split_placement_flags,
)
from theanompi.launch.mpirun import mpirun_command
from theanompi.launch.slurm import prted_agent_args
from theanompi.launch.testing import REPO


def test_host_list_and_hostfile(tmp_path: Path) -> None:
    assert parse_host_list("a:2,b:3, c") == [("a", 2), ("b", 3), ("c", 1)]
    f = tmp_path / "hosts"
    f.write_text("# two nodes\n198.18.0.1 slots=2\n\n198.18.0.2 slots=4 max_slots=8  # big\n")
    assert read_hostfile(f) == [("198.18.0.1", 2), ("198.18.0.2", 4)]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("a:0", "slots must be"),
        ("a:x", "slots must be"),
        (",", "names no host"),
        ("a b:2", "bad host"),
    ],
)
def test_bad_host_list_is_one_clear_error(text: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        parse_host_list(text)


def test_bad_hostfile_names_file_and_line(tmp_path: Path) -> None:
    f = tmp_path / "hosts"
    f.write_text("nodea slots=2\nnodeb cpus=2\n")
    with pytest.raises(ConfigError, match=r"hosts:2: unknown field 'cpus=2'"):
        read_hostfile(f)
    with pytest.raises(ConfigError, match="cannot read it"):
        read_hostfile(tmp_path / "missing")


def test_slurm_allocation() -> None:
    assert expand_slurm_nodelist("gpu[01-03,07],login") == [
        "gpu01",
        "gpu02",
        "gpu03",
        "gpu07",
        "login",
    ]
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "2(x2),1"}
    assert slurm_hosts(env) == [("n1", 2), ("n2", 2), ("n3", 1)]
    assert slurm_hosts({"SLURM_JOB_NODELIST": "n1"}) == []  # not inside an allocation
    p = Placement.from_env(env)
    assert p.slurm and p.slots == 5
    # mpirun reads the allocation itself; its daemons start through an agent that outlives USR1
    assert p.mpirun_args(8) == prted_agent_args()
    assert "Slurm allocation n1:2, n2:2, n3:1" in p.describe(5)


def test_mpirun_command_with_hosts(tmp_path: Path) -> None:
    f = tmp_path / "hosts"
    f.write_text("198.18.0.1 slots=2\n198.18.0.2 slots=2\n")
    env = {"THEANOMPI_HOSTFILE": str(f), "THEANOMPI_MPI_ARGS": "--mca btl_tcp_if_include 'eth 0'"}
    cmd = mpirun_command(4, ["python", "x.py"], Placement.from_env(env))
    assert cmd[1:] == [
        "-n", "4", "--hostfile", str(f), "--bind-to", "none",
        "--mca", "btl_tcp_if_include", "eth 0", "python", "x.py",
    ]  # fmt: skip
    cmd = mpirun_command(3, ["x"], Placement.from_env({"THEANOMPI_HOSTS": "a:2,b:1"}))
    assert cmd[1:] == ["-n", "3", "--host", "a:2,b:1", "--bind-to", "none", "x"]
    with pytest.raises(ConfigError, match=r"-n 5 but --hostfile .* gives 4 slots"):
        mpirun_command(5, ["x"], Placement.from_env(env))
    with pytest.raises(ConfigError, match="not both"):
        Placement.from_env({"THEANOMPI_HOSTFILE": str(f), "THEANOMPI_HOSTS": "a"})


def test_split_placement_flags() -> None:
    found, rest = split_placement_flags(
        ["train", "-n", "4", "-H", "a:2,b:2", "--mpi-args=--mca x 1", "--set", "a=b"]
    )
    assert found == {"THEANOMPI_HOSTS": "a:2,b:2", "THEANOMPI_MPI_ARGS": "--mca x 1"}
    assert rest == ["train", "-n", "4", "--set", "a=b"]
    with pytest.raises(ConfigError, match="needs a value"):
        split_placement_flags(["train", "--hostfile"])


def test_cli_too_many_ranks_for_the_hosts_is_one_line(cli, tmp_path: Path) -> None:
    f = tmp_path / "hosts"
    f.write_text("nodea slots=1\n")
    out = cli("eval", "-n", "2", "--hostfile", str(f), "--data", str(tmp_path), timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"tmpi: error: -n 2 but --hostfile {f} gives 1 slots (nodea:1); lower -n or add slots"
    ]


def test_placement_from_flags_overrides_the_environment(tmp_path: Path) -> None:
    f = tmp_path / "hosts"
    f.write_text("a slots=2\n")
    env = {"THEANOMPI_HOSTS": "b:1", "THEANOMPI_MPI_ARGS": "--mca x 1"}
    assert Placement.from_flags(env=env).hosts == (("b", 1),)
    p = Placement.from_flags(hostfile=str(f), env={"THEANOMPI_MPI_ARGS": "--mca x 1"})
    assert p.hosts == (("a", 2),) and p.mpi_args == ("--mca", "x", "1")
    assert Placement.from_flags(hosts="c:3", mpi_args="", env=env).mpi_args == ()
    names = {name for flag in PLACEMENT_FLAGS.values() for name in flag.names}
    assert names == {"--hostfile", "-H", "--host", "--mpi-args"}


def test_placement_flags_work_before_the_subcommand_and_parsed_by_typer(
    cli, tmp_path: Path
) -> None:
    """``tmpi --hostfile F eval -n 2`` (taken off the line before typer) and ``python -m
    prep.cli mean -n 2 -H a:1`` (typer's own option, no ``tmpi`` in front) reach mpirun alike."""
    f = tmp_path / "hosts"
    f.write_text("nodea slots=1\n")
    out = cli("--hostfile", str(f), "eval", "-n", "2", "--data", str(tmp_path), timeout=120)
    assert out.returncode == 2, out.stderr
    assert f"-n 2 but --hostfile {f} gives 1 slots" in out.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "prep.cli", "mean", "--out", str(tmp_path), "-n", "2", "-H", "a:1"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "tmpi: error: -n 2 but -H gives 1 slots (a:1); lower -n or add slots"
    ]
