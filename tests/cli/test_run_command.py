"""``tmpi run -n N script.py [args]``: any script on N ranks under the launcher's supervision, with
``tmpi train``'s one-line errors, exit codes, Ctrl-C and stall watchdog (real mpirun, real
signals)."""

from __future__ import annotations

import json
import re
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from theanompi.launch.testing import REPO

sys.path.insert(0, str(REPO / "tests" / "fault"))
from harness import Job, tmpi_argv  # noqa: E402

pytestmark = pytest.mark.mpi

FIT = REPO / "tests" / "train" / "mpi_fit_digits.py"
GONE_S = 10.0


def _script(folder: Path, name: str, body: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(body))
    return path


def _errors(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("tmpi: error")]


def test_tm_fit_under_tmpi_run(cli, digits_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    proc = cli("run", "-n", "2", str(FIT), str(digits_data), str(tmp_path / "run"), str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    printed = re.findall(r"top-1 err (\S+)% top-5 err (\S+)%", proc.stdout)[-1]
    assert (f"{summary['val_top1_err']:.2f}", f"{summary['val_top5_err']:.2f}") == printed
    assert "tmpi: 2 ranks on 1 host" in proc.stdout and summary["steps"] == 4


def test_the_scripts_arguments_pass_untouched(cli, tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        "args.py",
        """
        import sys, theanompi as tm
        tm.init()
        print(f"rank {tm.rank()}/{tm.size()} argv {sys.argv[1:]} main {__name__}", flush=True)
        """,
    )
    proc = cli("run", "-n", "2", str(script), "--lr", "0.1", "-n", "5", "--help", "--", "x")
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = "argv ['--lr', '0.1', '-n', '5', '--help', '--', 'x'] main __main__"
    assert {f"rank {r}/2 {want}" for r in (0, 1)} <= set(proc.stdout.splitlines()), proc.stdout
    # after "--", a script's own -H/--hostfile is its own too
    proc = cli("run", "-n", "2", "--", str(script), "-H", "a:1", "--hostfile=f")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 1/2 argv ['-H', 'a:1', '--hostfile=f'] main __main__" in proc.stdout


def test_a_missing_script_is_one_line_before_mpirun(cli, tmp_path: Path) -> None:
    proc = cli("run", "-n", "2", str(tmp_path / "nope.py"))
    assert proc.returncode == 2
    assert _errors(proc.stderr) == [proc.stderr.strip()] and "nope.py' not found" in proc.stderr


def test_a_config_error_in_the_script_is_one_line_exit_2(cli, tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        "bad.py",
        """
        import theanompi as tm
        tm.init()
        tm.load_config(model="digits", overrides={"model.n_epochs": 0})
        """,
    )
    proc = cli("run", "-n", "2", str(script))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert _errors(proc.stderr) == ["tmpi: error: command line: model.n_epochs must be >= 1, got 0"]
    assert "Traceback" not in proc.stderr
    assert "-----" not in proc.stderr and "prterun" not in proc.stderr, "no line of mpirun's box"


def test_a_rank_that_raises_ends_the_job_with_one_line(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        "boom.py",
        """
        import time, theanompi as tm
        tm.init()
        print("started", flush=True)
        if tm.rank() == 1:
            raise RuntimeError("boom on one rank")
        time.sleep(120)  # rank 0 waits: the job must end it
        """,
    )
    with Job(tmpi_argv("run", "-n", "2", str(script))) as job:
        end = job.wait(timeout=60)
        left, _ = job.wait_gone(GONE_S)
    assert end.returncode == 1, end.stderr[-3000:]
    assert not left, f"left behind: {job.describe(left)}"
    assert _errors(end.stderr) == ["tmpi: error on rank 1/2: RuntimeError: boom on one rank"]
    tb = end.stderr[end.stderr.index("Traceback") :]
    assert tb.splitlines()[1].startswith(f'  File "{script}"'), tb  # from the script's frame


LOOP = """
import itertools, time
import numpy as np, pytensor, pytensor.tensor as pt
import theanompi as tm

tm.init()
w = pytensor.shared(np.ones(3, "float32"), name="w")
x = pt.vector("x")
opt = tm.DistributedOptimizer(tm.SGD([w], 0.01, momentum=0.0), pt.sum(w * x), [x], stall_timeout=4)
for step in itertools.count():
    if {stall} and step == 3 and tm.rank() == 1:
        time.sleep(600)  # a hung rank: the other waits in the exchange
    opt.step(np.ones(3, "float32"))
    if tm.rank() == 0:
        print(f"step {{step}}", flush=True)
    time.sleep(0.05)
"""


def test_ctrl_c_stops_a_loop_of_your_own_with_130(tmp_path: Path) -> None:
    script = _script(tmp_path, "loop.py", LOOP.format(stall=False))
    with Job(tmpi_argv("run", "-n", "2", str(script))) as job:
        job.wait_for(r"^step 5$", timeout=120)
        job.killpg(signal.SIGINT)  # a terminal's Ctrl-C
        end = job.wait(timeout=30)
        left, _ = job.wait_gone(GONE_S)
    assert end.returncode == 130, end.stderr[-3000:]
    assert not left, f"left behind: {job.describe(left)}"
    assert "Traceback" not in end.stderr


def test_ctrl_c_stops_tm_fit_at_a_step_boundary(digits_data: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    argv = [str(FIT), str(digits_data), str(run), str(tmp_path / "s.json")]
    argv += ["model.n_epochs=1000", "training.print_freq=1"]
    with Job(tmpi_argv("run", "-n", "2", *argv)) as job:
        job.wait_for(r"epoch 2/1000 done", timeout=180)
        job.killpg(signal.SIGINT)
        end = job.wait(timeout=60)
        left, _ = job.wait_gone(GONE_S)
    assert end.returncode == 130, end.stderr[-3000:]
    assert not left, f"left behind: {job.describe(left)}"
    assert "(continue with --resume)" in end.stdout and "Traceback" not in end.stderr
    assert not (tmp_path / "s.json").exists()  # fit raised SystemExit(130): no summary


def test_a_stalled_rank_is_named_by_the_watchdog(tmp_path: Path) -> None:
    script = _script(tmp_path, "stall.py", LOOP.format(stall=True))
    with Job(tmpi_argv("run", "-n", "2", str(script))) as job:
        end = job.wait(timeout=120)
        left, _ = job.wait_gone(GONE_S)
    assert end.returncode == 1, end.stderr[-3000:]
    assert not left, f"left behind: {job.describe(left)}"
    line = next(ln for ln in _errors(end.stderr) if "stall" in ln)
    assert "rank 0 waited" in line and "the gradient exchange" in line and "rank 1" in line
