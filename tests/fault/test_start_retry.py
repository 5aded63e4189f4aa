"""A launch whose mpirun fails before starting any rank (PMIx listener) is launched again."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from theanompi.launch.mpirun import mpirun_command, mpirun_env
from theanompi.launch.restart import START_TRIES, _launch, run_started

pytestmark = pytest.mark.mpi

BANNER = (
    "--------------------------------------------------------------------------\n"
    "The PMIx server's listener thread failed to start. We cannot\n"
    "continue.\n"
    "--------------------------------------------------------------------------\n"
)


# PRRTE's banner when a daemon it spawned never reported back (once in CI: a bench's launch
# across the simulated nodes); captured output cannot tell it from a node lost mid-run
UNREPORTED = (
    "A daemon failed to report back after being spawned. This may also be caused by a firewall\n"
    "  Remote host: nodeb\n"
)


def _flaky(tmp_path: Path, fails: int, banner: str = BANNER) -> list[str]:
    """A launch line that fails as mpirun did (its banner, exit 213) ``fails`` times, then
    runs a real 2-rank mpirun job that prints the sum of the ranks over ``MPI.Allreduce``."""
    job = mpirun_command(
        2,
        [
            sys.executable,
            "-c",
            "from mpi4py import MPI; s = MPI.COMM_WORLD.allreduce(MPI.COMM_WORLD.rank); "
            "print('sum', s) if MPI.COMM_WORLD.rank == 0 else None",
        ],
    )
    (tmp_path / "banner.txt").write_text(banner)
    script = tmp_path / "flaky.sh"
    script.write_text(
        "#!/bin/sh\n"
        f'n=$(cat "{tmp_path}/count" 2>/dev/null || echo 0); n=$((n + 1)); '
        f'echo $n > "{tmp_path}/count"\n'
        f'if [ $n -le {fails} ]; then cat "{tmp_path}/banner.txt" >&2; exit 213; fi\n'
        'exec "$@"\n'
    )
    script.chmod(0o755)
    return [str(script), *job]


def _launches(folder: Path) -> int:
    return int((folder / "count").read_text())


def _said(err: str) -> int:
    """Launches the retry said it made: the real mpirun after the replayed failures may meet a
    real transient too (once in a suite run), and every launch past the first is announced."""
    return 1 + err.count("launching again")


def test_a_launch_that_did_not_start_is_launched_again(tmp_path: Path, capfd) -> None:
    result = _launch(_flaky(tmp_path, fails=1), mpirun_env())
    out, err = capfd.readouterr()
    assert result.code == 0 and not result.not_started, err
    assert "sum 1" in out
    assert err.count("mpirun failed to start (its PMIx listener); launching again (2/") == 1
    assert _launches(tmp_path) == _said(err), err


def test_it_gives_up_after_the_last_try(tmp_path: Path, capfd) -> None:
    result = _launch(_flaky(tmp_path, fails=START_TRIES), mpirun_env())
    _, err = capfd.readouterr()
    assert result.not_started and result.mpirun_code == 213
    assert err.count("launching again") == START_TRIES - 1
    assert (tmp_path / "count").read_text().strip() == str(START_TRIES)


def test_run_started_runs_a_never_started_line_again_then_gives_up(tmp_path: Path, capfd) -> None:
    """The captured-output retry that ``run_mpi`` and ``prep.bench`` use."""
    (tmp_path / "once").mkdir()
    proc = run_started(_flaky(tmp_path / "once", fails=1), env=mpirun_env())
    assert proc.returncode == 0 and "sum 1" in proc.stdout, proc.stderr
    err = capfd.readouterr().err
    assert _launches(tmp_path / "once") == _said(err) >= 2, err
    (tmp_path / "always").mkdir()
    proc = run_started(_flaky(tmp_path / "always", fails=START_TRIES), env=mpirun_env())
    assert proc.returncode == 213 and "PMIx server's listener" in proc.stderr
    assert (tmp_path / "always" / "count").read_text().strip() == str(START_TRIES)


def test_a_timed_only_run_also_goes_again_after_an_unreported_daemon(tmp_path: Path, capfd) -> None:
    """A bench loses nothing by going again; a job that trains might have lost a node."""
    (tmp_path / "train").mkdir()
    proc = run_started(_flaky(tmp_path / "train", 1, UNREPORTED), env=mpirun_env())
    assert proc.returncode == 213 and "Remote host: nodeb" in proc.stderr
    (tmp_path / "bench").mkdir()
    capfd.readouterr()
    proc = run_started(_flaky(tmp_path / "bench", 1, UNREPORTED), timed_only=True, env=mpirun_env())
    assert proc.returncode == 0 and "sum 1" in proc.stdout, proc.stderr
    err = capfd.readouterr().err
    assert _launches(tmp_path / "bench") == _said(err) >= 2, err


def test_the_fault_harness_starts_a_never_started_job_again(tmp_path: Path) -> None:
    """The fault tests' bare mpirun lines get the same retry (one CI run lost a SIGKILL test
    to this banner), in both ``wait_for`` and ``wait``; after the last try the failure shows."""
    sys.path.insert(0, str(Path(__file__).parent))
    from harness import Job

    def flaky(name: str, fails: int) -> list[str]:
        (tmp_path / name).mkdir()
        return _flaky(tmp_path / name, fails)

    with Job(flaky("wait_for", 1)) as job:
        job.wait_for(r"^sum 1$", timeout=60)
        assert job.wait(timeout=60).returncode == 0
    with Job(flaky("wait", 1)) as job:
        assert job.wait(timeout=60).returncode == 0 and "sum 1" in job.stdout
    with Job(flaky("gives_up", START_TRIES)) as job:
        with pytest.raises(AssertionError, match="job exited 213"):
            job.wait_for("sum", timeout=60)
