"""Elastic BSP under real ``mpirun --with-ft ulfm`` (``tmpi train -n N --min-np M``): a rank
SIGKILLed mid-epoch leaves, the others shrink their communicator and train on from the last
in-memory commit, with no process started and no file read.

The victim kills itself at a known step (``THEANOMPI_FAIL=kill:<launch rank>:<step>``, a real
SIGKILL): a kill from outside, timed by the job's output, lands steps late."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Job, tiny_train_args, tmpi_argv, write_tiny_data  # noqa: E402

from theanompi.io.record import read_record  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

EPOCHS = 4  # 8, the bar, in tests/cluster/test_elastic_cluster.py and measure_elastic.py
PER_EPOCH = 12  # digits at N=4: 48 sub-batches of 32


def _train(
    n: int, args: list[str], kill: str | None = None, timeout: float = 300
) -> tuple[Any, list[dict[str, Any]], Job]:
    env = {"THEANOMPI_FAIL": kill} if kill else None
    with Job(tmpi_argv("train", "-n", str(n), *args), env=env) as job:
        out = job.wait(timeout=timeout)
        left, _ = job.wait_gone(timeout=10)
        assert not left, f"left behind: {job.describe(left)}"
    run = Path(args[args.index("--run-dir") + 1])
    return out, read_record(run), job


def _killed_mid_run(n: int, args: list[str], rank: int, epochs: int) -> Any:
    """``tmpi train -n n`` of ``args`` (``epochs`` of a few ms a step: time for the kill to land
    mid-run, under load too), with a mid-epoch checkpoint every 2 steps; launch rank ``rank``
    SIGKILLed from outside in epoch 2. Its output, once no process of it is left."""
    args = [*args, "--set", "output.checkpoint_every_steps=2", "--set", "training.print_freq=1"]
    with Job(tmpi_argv("train", "-n", str(n), *args)) as job:
        job.wait_for(rf"epoch 2/{epochs} step 2/", timeout=180)
        job.kill(job.rank_pid(rank), signal.SIGKILL)
        out = job.wait(timeout=180)
        left, _ = job.wait_gone(timeout=10)
        assert not left, f"left behind: {job.describe(left)}"
    return out


def _digits(data: Path, run: Path, *extra: str) -> list[str]:
    return [
        "--model", "digits", "--data", str(data), "--run-dir", str(run),
        "--epochs", str(EPOCHS), "--set", "training.print_freq=1", *extra,
    ]  # fmt: skip


def _final_top1(record: list[dict[str, Any]]) -> float:
    return [r for r in record if r["kind"] == "epoch"][-1]["val_top1_err"]


def test_a_killed_rank_leaves_and_the_others_finish(digits_data: Path, tmp_path: Path) -> None:
    """kill -9 of rank 0 (the record's writer, the watchdog's hub) in epoch 2 of 4: exit 0 on
    3 ranks, asa32 gone on as ar (3 is no power of 2), no step redone with a commit every
    step, the next step within 5 s, top-1 within 2 points of an undisturbed run's."""
    elastic = ("--min-np", "2", "--strategy", "asa32")
    calm, calm_rec, _ = _train(4, _digits(digits_data, tmp_path / "calm", *elastic))
    assert calm.returncode == 0, calm.stderr[-3000:]
    kill_at = PER_EPOCH + 5  # before step 18 of the run: epoch 2, 5 steps of it done
    out, rec, _ = _train(
        4, _digits(digits_data, tmp_path / "hit", *elastic), kill=f"kill:0:{kill_at}"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [ln for ln in out.stdout.splitlines() if "elastic: lost" in ln]
    assert "lost rank 0" in line and f"3 of 4 ranks go on from step {kill_at}" in line, line
    assert "asa32 needs a power of 2: ar on 3" in line, line
    assert "Traceback" not in out.stderr and "NBC_" not in out.stderr, out.stderr[-3000:]
    starts = [r for r in rec if r["kind"] == "start"]
    assert len(starts) == 2 and starts[1]["world_size"] == 3, starts[-1]
    change = starts[1]["elastic"]
    assert change["lost_ranks"] == [0] and change["world_size"] == 3
    assert change["step"] == kill_at  # the commit after the last step done: none redone
    steps = [r for r in rec if r["kind"] == "step"]
    before = [r for r in steps if r["step"] <= change["step"]]
    after = [r for r in steps if r["time"] > starts[1]["time"]]
    assert after[0]["step"] == change["step"] + 1  # the next step, where the commit stood
    assert after[0]["time"] - before[-1]["time"] < 5.0  # the kill fell between them
    assert rec[-1]["kind"] == "end" and rec[-1]["world_size"] == 3
    assert [r["epoch"] for r in rec if r["kind"] == "epoch"] == list(range(EPOCHS))
    hit, undisturbed = _final_top1(rec), _final_top1(calm_rec)  # fractions
    print(f"top-1 error {100 * hit:.2f} % vs {100 * undisturbed:.2f} % undisturbed")
    assert abs(hit - undisturbed) <= 0.02, (hit, undisturbed)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_data(tmp_path_factory.mktemp("elastic") / "data")


def test_below_min_np_the_job_stops_with_one_line(tiny: Path, tmp_path: Path) -> None:
    args = tiny_train_args(tiny, tmp_path / "run", "--min-np", "2", epochs=3)[1:]  # no "train"
    out, _, _ = _train(2, args, kill="kill:1:4")
    assert out.returncode == 1, out.stderr[-3000:]
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("tmpi: error")]
    assert errors == [
        "tmpi: error: elastic: lost rank 1 ("
        + errors[0].split("(", 1)[1].split(")")[0]
        + "); 1 rank(s) left of elastic.min_np=2; last checkpoint: none (continue with --resume)"
    ], out.stderr[-3000:]
    assert "Traceback" not in out.stderr


def test_below_min_np_the_launcher_waits_for_the_scripts_slots(tiny: Path, tmp_path: Path) -> None:
    """With a host discovery script, a job whose ranks fell below --min-np is relaunched from
    its last checkpoint once the script offers --min-np slots (here at once: this machine's)."""
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o755)
    run, epochs = tmp_path / "run", 20
    args = tiny_train_args(tiny, run, "--min-np", "2", epochs=epochs)[1:]
    out = _killed_mid_run(2, [*args, "--host-discovery-script", str(script)], 1, epochs)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "1 rank(s) left of elastic.min_np=2" in out.stderr, out.stderr[-3000:]
    assert "tmpi: elastic: going on with the hosts offered: 2 ranks on " in out.stderr
    rec = read_record(run)
    assert rec[-1]["kind"] == "end" and rec[-1]["world_size"] == 2, rec[-1]
    assert [r["epoch"] for r in rec if r["kind"] == "epoch"] == list(range(epochs))
    (entry,) = [r for r in rec if r["kind"] == "elastic"]
    assert entry["change"] == "going on with the hosts offered" and entry["resume_from"]


@pytest.mark.parametrize(
    "flags",
    [["--rule", "GOSGD"], ["--rule", "EASGD"], ["--shard-optimizer", "--sync-type", "cdd"]],
    ids=["GOSGD", "EASGD", "ZeRO-1"],
)
def test_a_rule_that_cannot_shrink_in_place_is_relaunched_a_rank_fewer(
    tiny: Path, tmp_path: Path, flags: list[str]
) -> None:
    """GOSGD, EASGD (its worker rank 2) and BSP with ZeRO-1 (a lost rank takes its part of the
    optimizer state) under --min-np: mpirun ends the job, the launcher relaunches it on 2
    ranks from the last checkpoint (mid-epoch, every 2 steps), exit 0, no process left."""
    run, epochs = tmp_path / "run", 20
    args = tiny_train_args(tiny, run, "--min-np", "2", *flags, epochs=epochs)[1:]
    out = _killed_mid_run(3, args, 2, epochs)
    assert out.returncode == 0, out.stderr[-3000:]
    said = out.stderr
    assert "tmpi: error: rank 2 (pid" in said and "was killed by signal 9" in said, said
    assert "tmpi: elastic: going on with a rank fewer: 2 ranks on this machine, from " in said
    rec = read_record(run)
    assert rec[-1]["kind"] == "end" and rec[-1]["world_size"] == 2, rec[-1]
    assert [r["epoch"] for r in rec if r["kind"] == "epoch"] == list(range(epochs))
    assert [r["change"] for r in rec if r["kind"] == "elastic"] == ["going on with a rank fewer"]


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--set", "elastic.min_np=3"], "elastic.min_np=3 exceeds the 2 rank(s) started"),
        (["--max-np", "4", "--min-np", "0"], "give elastic.min_np (--min-np) too"),
        (["--timeline", "t.json"], "the timeline gathers every rank's spans at the end"),
    ],
)
def test_what_elastic_cannot_take_is_refused_before_any_rank_starts(
    tiny: Path, tmp_path: Path, flags: list[str], says: str
) -> None:
    args = tiny_train_args(tiny, tmp_path / "run", "--min-np", "1", *flags, epochs=1)[1:]
    out, _, _ = _train(2, args)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.startswith("tmpi: error: ") and says in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
