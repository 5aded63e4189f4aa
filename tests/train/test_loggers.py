"""Loggers on the training loop (``output.loggers``) under a real 2-rank ``tmpi train -n 2``: the
TensorBoard event file read back by TensorBoard's own reader and the CSV files equal the record's
entries, only rank 0 writes, a user's ``file.py:Class`` is called, ``--resume`` rebuilds them from
the record; and the run dir's ``config.yaml`` loads back to the same config."""

from __future__ import annotations

import csv
import doctest
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _train_data import write_dataset  # noqa: E402

import theanompi.io._tfevents  # noqa: E402
import theanompi.io.loggers  # noqa: E402
from theanompi.config import load_config  # noqa: E402
from theanompi.io.loggers import TB_TAGS  # noqa: E402
from theanompi.io.record import read_record  # noqa: E402

MODEL = Path(__file__).resolve().parents[1] / "rules" / "model_fake.yaml"  # numpy: no compile

USER_LOGGER = '''
import json
from theanompi.io.loggers import Logger


class Spy(Logger):
    """Appends what it is fed to <run_dir>/spy.jsonl."""

    def __init__(self, run_dir, history=()):
        super().__init__(run_dir, history)
        self.fh = open(self.run_dir / "spy.jsonl", "a")
        self.fh.write(json.dumps({"kind": "opened", "history": len(history)}) + "\\n")

    def on_step(self, entry):
        self.fh.write(json.dumps({"kind": "on_step", "step": entry["step"]}) + "\\n")

    def on_epoch(self, entry):
        self.fh.write(json.dumps({"kind": "on_epoch", "epoch": entry["epoch"]}) + "\\n")

    def close(self):
        self.fh.write(json.dumps({"kind": "closed"}) + "\\n")
        self.fh.close()
'''


def test_doctests() -> None:
    for module in (theanompi.io.loggers, theanompi.io._tfevents):
        assert doctest.testmod(module).failed == 0


def _entries(n: int, t0: float = 1000.0) -> list[dict]:
    """A record's entries: ``start``, then ``n`` step windows of 2 steps, an epoch per 2."""
    out: list[dict] = [{"kind": "start", "time": t0, "config": {"a": 1}}]
    for k in range(1, n + 1):
        out.append({"kind": "step", "time": t0 + k, "epoch": (k - 1) // 2, "step": 2 * k})
        out[-1] |= {"loss": 1.0 / k, "error": 0.5, "images_per_s": 100.0 * k, "lr": 0.1}
        if k % 2 == 0:
            out.append({"kind": "epoch", "time": t0 + k, "epoch": k // 2 - 1, "step": 2 * k})
            out[-1] |= {"val_loss": 0.1 * k, "val_top1_err": None, "checkpoint": f"e{k}.npz"}
    return out


def test_tensorboard_replays_the_record_and_marks_a_restart(tmp_path: Path) -> None:
    from theanompi.io.loggers import TensorBoardLogger

    first = _entries(6)
    log = TensorBoardLogger(run_dir=tmp_path, history=first[:3])
    for e in first[3:]:
        (log.on_step if e["kind"] == "step" else log.on_epoch)(e)
    log.close()
    assert _scalars(tmp_path) == {k: v for k, v in _expected(first, "step").items() if v} | {
        k: v for k, v in _expected(first, "epoch").items() if v
    }
    (old,) = (tmp_path / "tb").iterdir()
    shown = tmp_path / "live" / "tb"  # what a live TensorBoard read before the resume
    shown.mkdir(parents=True)
    (shown / old.name).write_bytes(old.read_bytes())
    kept = [e for e in first if e["kind"] == "start" or e["epoch"] < 1]  # a resume from epoch 1
    TensorBoardLogger(run_dir=tmp_path, history=kept).close()
    (new,) = (tmp_path / "tb").iterdir()  # the earlier file replaced
    assert new != old
    want = {k: v for k, v in _expected(kept, "step").items() if v}
    assert _scalars(tmp_path) == want | {k: v for k, v in _expected(kept, "epoch").items() if v}
    (shown / new.name).write_bytes(new.read_bytes())
    assert _scalars(shown.parent)["train/loss"] == want["train/loss"]  # the old points dropped


def test_csv_rebuilds_from_the_record_and_widens_for_a_new_key(tmp_path: Path) -> None:
    from theanompi.io.loggers import CSVLogger

    rec = _entries(4)  # start, step, step, epoch, step, step, epoch
    log = CSVLogger(run_dir=tmp_path, history=rec[:3])
    log.on_epoch(rec[3])
    log.on_step(rec[4])
    log.on_step({**rec[5], "extra": [1, 2]})
    log.close()
    rows = _csv(tmp_path / "csv" / "steps.csv")
    assert list(rows[0])[:2] == ["epoch", "step"] and len(rows) == 4
    assert rows[:3] == [r | {"extra": ""} for r in _as_csv(rec, "step")[:3]]
    assert rows[3]["extra"] == "[1, 2]" and float(rows[1]["loss"]) == rec[2]["loss"]
    assert _csv(tmp_path / "csv" / "epochs.csv") == _as_csv(rec[:4], "epoch")
    CSVLogger(run_dir=tmp_path, history=rec[:2]).close()  # a resume: the record's rows only
    assert _csv(tmp_path / "csv" / "steps.csv") == _as_csv(rec[:2], "step")
    assert _csv(tmp_path / "csv" / "epochs.csv") == []


def test_an_object_that_is_no_logger_is_one_line(tmp_path: Path) -> None:
    from theanompi.errors import ConfigError
    from theanompi.io.loggers import open_loggers

    (tmp_path / "bad.py").write_text("class NoLog:\n    def __init__(self, **kw):\n        pass\n")
    with pytest.raises(ConfigError, match="without on_step, on_epoch, close; subclass"):
        open_loggers(["csv", f"{tmp_path}/bad.py:NoLog"], tmp_path, [])


def test_a_bad_logger_name_is_one_line_exit_2(cli) -> None:
    out = cli("train", "--set", "output.loggers=[tensorbord]", timeout=120)
    assert out.returncode == 2, out.stderr
    line = "output.loggers is 'tensorbord'; it must be one of 'csv', 'tensorboard'"
    assert out.stderr.count("\n") == 1 and line in out.stderr


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("loggers") / "data", n_train=5, n_val=2, B=16)


def _train(cli, data: Path, run: Path, *extra: str, epochs: int = 2):
    out = cli(
        "train",
        "-n",
        "2",
        "--model",
        str(MODEL),
        "--data",
        str(data),
        "--run-dir",
        str(run),
        "--epochs",
        str(epochs),
        "--set",
        "data.file_batch_size=16",
        "--set",
        "data.image_size=10",
        "--set",
        "training.print_freq=3",
        *extra,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of ``<run>/tb``, read by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _expected(entries: list[dict], kind: str) -> dict[str, list[tuple[int, float]]]:
    """The record's values of ``kind`` entries per TensorBoard tag (float32, as stored)."""
    import numpy as np

    rows = [e for e in entries if e["kind"] == kind]
    return {
        tag: [(r["step"], float(np.float32(r[k]))) for r in rows if r.get(k) is not None]
        for k, tag in TB_TAGS[kind].items()
    }


def _csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _as_csv(entries: list[dict], kind: str) -> list[dict[str, str]]:
    """The record's ``kind`` entries as the CSV writes them (None as '', floats by repr)."""
    return [
        {k: "" if v is None else str(v) for k, v in e.items() if k != "kind"}
        for e in entries
        if e["kind"] == kind
    ]


@pytest.mark.mpi
def test_tensorboard_and_csv_hold_the_record_and_a_user_logger_is_called(
    cli, data: Path, tmp_path: Path
) -> None:
    (tmp_path / "mine.py").write_text(USER_LOGGER)
    run = tmp_path / "run"
    loggers = f"output.loggers=[tensorboard, csv, {tmp_path / 'mine.py'}:Spy]"
    _train(cli, data, run, "--max-steps", "7", "--set", loggers)
    rec = read_record(run)
    steps = [e for e in rec if e["kind"] == "step"]
    epochs = [e for e in rec if e["kind"] == "epoch"]
    assert len(steps) == 6 and len(epochs) == 2  # 7 steps an epoch, print_freq 3: 3, 6, 7

    got = _scalars(run)
    for kind in ("step", "epoch"):
        for tag, series in _expected(rec, kind).items():
            assert got.get(tag) == series, tag
    for tag in ("train/loss", "train/error", "train/images_per_s", "train/lr", "time/wait_s"):
        assert len(got[tag]) == 6, tag
    for tag in ("val/loss", "val/top1_error", "epoch/train_loss", "epoch/images_per_s"):
        assert len(got[tag]) == 2, tag
    assert len(list((run / "tb").iterdir())) == 1  # one event file: rank 0's alone

    assert _csv(run / "csv" / "steps.csv") == _as_csv(rec, "step")
    assert _csv(run / "csv" / "epochs.csv") == _as_csv(rec, "epoch")

    import json

    spy = [json.loads(line) for line in (run / "spy.jsonl").read_text().splitlines()]
    assert [s["kind"] for s in spy] == ["opened"] + ["on_step"] * 3 + ["on_epoch"] + [
        "on_step"
    ] * 3 + ["on_epoch", "closed"]  # once, on rank 0 only
    assert [s["step"] for s in spy if s["kind"] == "on_step"] == [e["step"] for e in steps]

    # --resume for one more epoch: the loggers are rebuilt from the record, then go on
    _train(cli, data, run, "--max-steps", "7", "--set", loggers, "--resume", epochs=3)
    rec = read_record(run)
    assert [e["epoch"] for e in rec if e["kind"] == "epoch"] == [0, 1, 2]
    got = _scalars(run)
    for kind in ("step", "epoch"):
        for tag, series in _expected(rec, kind).items():
            assert got.get(tag) == series, tag
    assert len(list((run / "tb").iterdir())) == 1  # the earlier file was replaced
    assert _csv(run / "csv" / "steps.csv") == _as_csv(rec, "step")


@pytest.mark.mpi
def test_run_dir_config_yaml_loads_back_unchanged(cli, data: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    over = ("--set", "output.loggers=[csv]", "--set", "weight_exchange.check_every=2")
    _train(cli, data, run, "--max-steps", "2", *over, epochs=1)
    saved = run / "config.yaml"
    assert saved.read_text().startswith("# theanompi run config, resolved")
    expected = load_config(
        None,
        MODEL,
        {
            "data.dir": str(data),
            "data.file_batch_size": 16,
            "data.image_size": 10,
            "output.run_dir": str(run),
            "output.loggers": ["csv"],
            "weight_exchange.check_every": 2,
            "training.print_freq": 3,
            "training.max_steps": 2,
            "model.n_epochs": 1,
        },
    )
    assert load_config(saved).to_dict() == expected.to_dict()
    before = saved.stat().st_mtime_ns
    # a refused run dir (it holds a run; no --resume/--overwrite) is not touched
    out = cli("train", "--config", str(saved), "--run-dir", str(run), timeout=120)
    assert out.returncode == 2 and "already holds a run" in out.stderr
    assert saved.stat().st_mtime_ns == before
