"""Mid-epoch checkpoints of the asynchronous rules under real mpirun: a rank SIGKILLed mid-epoch,
then ``--resume`` redoes at most ``output.checkpoint_every_steps`` steps and completes the run.

EASGD at N=2 (the server and one worker: the exchange order is fixed, so the run is
deterministic) also ends bit-identical to an uninterrupted run: the centre and the worker's own
values and momentum came back. GOSGD at N=3 keeps its gossip weights: the workers' saved
weights sum to 1, and every push sent over the whole run is received.
"""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Job, mpirun_argv, tiny_train_args, write_tiny_data  # noqa: E402

from theanompi.io.checkpoint import (  # noqa: E402
    list_checkpoints,
    load_checkpoint,
    rank_state_path,
)
from theanompi.io.record import read_record  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_data(tmp_path_factory.mktemp("rulemid") / "data")


def _args(data: Path, run: Path, rule: str, every: int, epochs: int, *extra: str) -> list[str]:
    sets = [f"weight_exchange.sync_rule={rule}", f"output.checkpoint_every_steps={every}"]
    sets += ["training.print_freq=1", "output.keep_last=4", *extra]
    return tiny_train_args(data, run, *[a for s in sets for a in ("--set", s)], epochs=epochs)


def _train(n: int, argv: list[str]) -> str:
    with Job(mpirun_argv(n, *argv)) as job:
        out = job.wait(timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _last_step_of_failed(out, argv: list[str]) -> int:
    """The last step the record of the run in ``argv`` holds, once its job failed (``out``)."""
    assert out.returncode != 0, out.stdout[-2000:]
    return max(
        r["step"]
        for r in read_record(Path(argv[argv.index("--run-dir") + 1]))
        if r["kind"] == "step"
    )


def _kill_mid_epoch(n: int, argv: list[str], line: str, victim: int) -> int:
    """Run until ``line``, SIGKILL rank ``victim``; the last step the record holds."""
    with Job(mpirun_argv(n, *argv)) as job:
        job.wait_for(line, timeout=180)
        job.kill(job.rank_pid(victim), signal.SIGKILL)
        out = job.wait(timeout=60)
    return _last_step_of_failed(out, argv)


def _self_kill_at(n: int, argv: list[str], victim: int, step: int) -> int:
    """Run with rank ``victim`` SIGKILLing itself at global ``step`` (1-based); the last step
    the record holds. Asynchronous workers run a tiny step in ms: a kill timed by their output
    can land after the run's end, when mpirun's relay lags behind a loaded machine."""
    with Job(mpirun_argv(n, *argv), env={"THEANOMPI_FAIL": f"kill:{victim}:{step - 1}"}) as job:
        out = job.wait(timeout=180)
    return _last_step_of_failed(out, argv)


def _resume(n: int, argv: list[str], every: int, done: int, per_epoch: int) -> tuple[int, str]:
    """``--resume`` the killed run: (steps redone, its output); it restarts mid-epoch, at
    most ``every`` steps behind the last step done, and runs to the end."""
    out = _train(n, [*argv, "--resume"])
    m = re.search(r"resumed from \S+ \(epoch (\d+), step (\d+)\)", out)
    assert m, out[-2000:]
    epoch, step = int(m.group(1)), int(m.group(2))
    assert step % per_epoch, f"resumed at an epoch end (step {step}), not mid-epoch"
    first = re.search(r"epoch (\d+)/\d+ step (\d+)/\d+", out)  # the first step it trains
    assert first and (int(first.group(1)), int(first.group(2))) == (
        epoch + 1,
        step - epoch * per_epoch + 1,
    ), out[-2000:]
    redone = done - step
    assert 0 <= redone <= every, (done, step)
    # the steps lost to the kill, as the record counts them (print_freq 1: each one)
    start = [
        r for r in read_record(Path(argv[argv.index("--run-dir") + 1])) if r["kind"] == "start"
    ]
    assert start[-1]["lost_steps"] == redone, start[-1]
    said = f"{redone} step(s) after that checkpoint were lost" in out
    assert said == (redone > 0), out[-2000:]
    return redone, out


def test_easgd_sigkill_of_the_server_mid_epoch(data: Path, tmp_path: Path) -> None:
    every, per_epoch = 3, 20  # one worker: 20 steps an epoch
    run = tmp_path / "killed"
    argv = _args(data, run, "EASGD", every, 2)
    done = _kill_mid_epoch(2, argv, r"epoch 2/2 step 8/20", victim=0)  # the server
    differ = False
    for p in [p for p in list_checkpoints(run / "checkpoints") if "_step_" in p.name]:
        centre = load_checkpoint(p)
        own = load_checkpoint(rank_state_path(p, 0))  # the worker's own values and momentum
        assert own.meta["rule_state"]["exchanges"] == centre.step // 2  # avg_freq 2
        assert len(own.params) == len(centre.params) + len(centre.opt_state)
        mine = own.params[: len(centre.params)]
        differ |= any(not np.array_equal(a, b) for a, b in zip(mine, centre.params, strict=True))
    assert differ, "no step checkpoint holds the worker's values apart from the centre"

    redone, out = _resume(2, argv, every, done, per_epoch)
    assert "epoch 2/2 done" in out
    straight = tmp_path / "straight"
    _train(2, _args(data, straight, "EASGD", every, 2))
    a = load_checkpoint(run / "checkpoints" / "epoch_0002.npz")
    b = load_checkpoint(straight / "checkpoints" / "epoch_0002.npz")
    for x, y in zip(a.params + a.opt_state, b.params + b.opt_state, strict=True):
        np.testing.assert_array_equal(x, y)  # the centre and the worker's momentum
    print(f"EASGD: last step done {done}, redone {redone} (every {every})")


def test_gosgd_sigkill_of_a_worker_mid_epoch(data: Path, tmp_path: Path) -> None:
    every, per_epoch = 2, 6  # three workers: 20 sub-batches -> 6 steps an epoch each
    run = tmp_path / "killed"
    argv = _args(data, run, "GOSGD", every, 3, "weight_exchange.gossip_p=0.9")
    done = _self_kill_at(3, argv, victim=1, step=per_epoch + 3)  # epoch 2, step 3 of 6
    ckpts = [p for p in list_checkpoints(run / "checkpoints") if "_step_" in p.name]
    assert ckpts
    for p in ckpts:  # the gossip weights of every mid-epoch checkpoint sum to 1
        states = [load_checkpoint(rank_state_path(p, r)).meta["rule_state"] for r in range(3)]
        assert sum(s["weight"] for s in states) == pytest.approx(1.0, abs=1e-12), p.name
        assert sum(s["pushes"] for s in states) == sum(s["received"] for s in states)

    redone, out = _resume(3, argv, every, done, per_epoch)
    assert "epoch 3/3 done" in out
    end = [r for r in read_record(run) if r["kind"] == "end"][-1]
    assert end["epochs"] == 3 and not end["interrupted"]
    pushes = sum(end["pushes"].values())
    assert pushes > 0 and sum(end["received"].values()) == pushes  # counted across the kill
    print(f"GOSGD: last step done {done}, redone {redone} (every {every})")
