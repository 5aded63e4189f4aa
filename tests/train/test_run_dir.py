"""Run-dir safety: a run dir holding a run is refused without --resume/--overwrite, --overwrite
deletes only the run's own files, --resume compares the stored config (breaking keys refuse,
others are named in a note); then the same end to end through ``tmpi train -n 2``."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from theanompi.config import load_config
from theanompi.errors import ConfigError, UserError
from theanompi.io.checkpoint import checkpoint_path, rank_state_path, save_arrays, save_checkpoint
from theanompi.io.record import RecordWriter
from theanompi.launch.testing import tmpi
from theanompi.train.rundir import config_changes, old_run_files, prepare_run_dir

MODEL = {"name": "mlp", "input_size": 28, "channels": 3, "n_classes": 10, "batch_size": 32}


def _cfg(tmp: Path, run: Path, model: dict | None = None, **over: object):
    model_path = tmp / "m.yaml"
    model_path.write_text(yaml.safe_dump(model or MODEL))
    return load_config(None, model_path, {"output.run_dir": str(run), **over})


class _Arrays:
    params = [np.ones((2, 3), np.float32)]
    opt_state = [np.zeros((2, 3), np.float32)]


def _old_run(cfg, epochs: int = 2, world_size: int = 2) -> list[Path]:
    """Files an earlier run leaves: checkpoints + side files, an eval report, a record."""
    files = []
    for e in range(1, epochs + 1):
        path = checkpoint_path(cfg.output.checkpoint_dir, e)
        side = rank_state_path(path, 1)
        save_arrays(side, [], [], {"rank": 1, "world_size": world_size})
        meta = {"epoch": e, "step": 3 * e, "world_size": world_size, "config": cfg.to_dict()}
        files += [side, save_checkpoint(path, _Arrays(), meta)]
    report = Path(cfg.output.checkpoint_dir) / f"epoch_{epochs:04d}.eval.json"
    report.write_text("{}")
    with RecordWriter(cfg.output.record_dir) as rec:
        rec.write("start", config=cfg.to_dict())
        rec.write("epoch", epoch=0)
    return [*files, report, Path(cfg.output.record_dir) / "record.jsonl"]


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_a_new_run_into_an_old_one_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, tmp_path / "run")
    _old_run(cfg)
    before = _digest(tmp_path / "run")
    with pytest.raises(ConfigError) as info:
        prepare_run_dir(cfg, resume=False, overwrite=False, n_workers=2)
    msg = str(info.value)
    assert "\n" not in msg and str(tmp_path / "run") in msg and "epoch_0002.npz" in msg
    assert "--resume" in msg and "--overwrite" in msg and "--run-dir" in msg
    assert _digest(tmp_path / "run") == before


def test_a_record_without_checkpoints_is_no_run_to_keep(tmp_path: Path) -> None:
    """Only checkpoints make a run dir "hold a run" (a crashed first run, or the launcher's
    restart before the first checkpoint, starts over; the new record replaces the old)."""
    cfg = _cfg(tmp_path, tmp_path / "run")
    with RecordWriter(cfg.output.record_dir) as rec:
        rec.write("start")
        rec.write("epoch", epoch=0)
    assert prepare_run_dir(cfg, resume=False, overwrite=False, n_workers=1) == []


def test_overwrite_deletes_only_the_runs_own_files(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, tmp_path / "run")
    ours = _old_run(cfg, epochs=3)
    ck = Path(cfg.output.checkpoint_dir)
    (ck / ".epoch_0004.abcd.tmp.npz").write_bytes(b"torn")  # an interrupted atomic write
    (Path(cfg.output.record_dir) / "curves.png").write_bytes(b"png")
    mine = [
        ck / "notes.txt",
        ck / "epoch_notes.md",
        ck / "best.npz",
        tmp_path / "run" / "README",
        Path(cfg.output.record_dir) / "record.jsonl.bak",
    ]
    for p in mine:
        p.write_text("user file")
    (ck / "keep").mkdir()
    assert len(old_run_files(ck, cfg.output.record_dir)) == len(ours) + 2
    notes = prepare_run_dir(cfg, resume=False, overwrite=True, n_workers=2)
    assert len(notes) == 1 and f"{len(ours) + 2} file(s)" in notes[0]
    assert not any(p.exists() for p in ours)
    assert all(p.read_text() == "user file" for p in mine) and (ck / "keep").is_dir()
    assert not (ck / ".epoch_0004.abcd.tmp.npz").exists()
    # and now the folder is free for a new run
    assert prepare_run_dir(cfg, resume=False, overwrite=False, n_workers=2) == []


def test_resume_and_overwrite_together_are_refused(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, tmp_path / "run")
    with pytest.raises(ConfigError, match="contradict"):
        prepare_run_dir(cfg, resume=True, overwrite=True, n_workers=1)


def test_resume_allows_schedule_and_frequency_changes_with_a_note(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, tmp_path / "run")
    _old_run(cfg, world_size=2)
    new = _cfg(
        tmp_path,
        tmp_path / "run",
        **{
            "model.n_epochs": 20,
            "model.learning_rate": 0.05,
            "model.lr_step": [5],
            "training.print_freq": 3,
            "output.snapshot_freq": 2,
            "weight_exchange.exch_strategy": "asa32",
        },
    )
    notes = prepare_run_dir(new, resume=True, overwrite=False, n_workers=4)
    assert len(notes) == 2, notes
    for text in (
        "model.n_epochs 10 -> 20",
        "model.learning_rate 0.01 -> 0.05",
        "model.lr_step [] -> [5]",
        "training.print_freq 10 -> 3",
        "output.snapshot_freq 1 -> 2",
        "weight_exchange.exch_strategy 'ar' -> 'asa32'",
    ):
        assert text in notes[0], (text, notes[0])
    assert "2 -> 4 worker(s)" in notes[1] and "global batch becomes 128 (was 64)" in notes[1]
    # the same config on the same N: nothing to say
    assert prepare_run_dir(cfg, resume=True, overwrite=False, n_workers=2) == []


@pytest.mark.parametrize(
    "over,model,keys",
    [
        ({"model.batch_size": 16}, None, ["model.batch_size 32 -> 16"]),
        ({"data.layout": "bc01"}, None, ["data.layout 'c01b' -> 'bc01'"]),
        ({"weight_exchange.sync_rule": "GOSGD"}, None, ["weight_exchange.sync_rule"]),
        ({}, MODEL | {"arch": {"hidden": [64]}}, ["model.arch.hidden (none) -> [64]"]),
        (
            {"data.file_batch_size": 64, "data.image_size": 40},
            MODEL | {"n_classes": 5, "input_size": 24},
            [
                "data.file_batch_size 128 -> 64",
                "data.image_size 32 -> 40",
                "model.input_size 28 -> 24",
                "model.n_classes 10 -> 5",
            ],
        ),
    ],
)
def test_resume_refuses_breaking_changes_listing_every_key(
    tmp_path: Path, over: dict, model: dict | None, keys: list[str]
) -> None:
    cfg = _cfg(tmp_path, tmp_path / "run")
    _old_run(cfg)
    new = _cfg(tmp_path, tmp_path / "run", model, **over, **{"model.n_epochs": 30})
    with pytest.raises(ConfigError) as info:
        prepare_run_dir(new, resume=True, overwrite=False, n_workers=2)
    msg = str(info.value)
    assert "\n" not in msg and "epoch_0002.npz" in msg
    for k in keys:
        assert k in msg, (k, msg)
    assert "n_epochs" not in msg  # an allowed change is not listed as breaking


def test_config_changes_against_a_hand_written_pair() -> None:
    old = {"model": {"arch": {"hidden": [5]}, "n_epochs": 2}, "output": {"run_dir": "a"}}
    new = {"model": {"arch": {"hidden": [6]}, "n_epochs": 3}, "output": {"run_dir": "b"}}
    new["training"] = {"stall_timeout": 60}  # a key added to the schema since: allowed, unlisted
    assert config_changes(old, new) == (["model.arch.hidden [5] -> [6]"], ["model.n_epochs 2 -> 3"])


def test_unusable_run_dirs_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    cfg = _cfg(tmp_path, tmp_path / "afile" / "run")
    with pytest.raises(ConfigError, match=r"output\.run_dir .* \(Not a directory\)"):
        prepare_run_dir(cfg, resume=False, overwrite=False, n_workers=1)
    cfg = _cfg(tmp_path, Path("/sys/tmpi-test-run"))
    with pytest.raises(UserError) as info:
        prepare_run_dir(cfg, resume=False, overwrite=False, n_workers=1)
    assert info.value.exit_code == 4 and "output.run_dir" in str(info.value)


# -- end to end: tmpi train -n 2 on the digits ------------------------------------------------
@pytest.fixture
def digits(digits_data: Path) -> Path:
    return digits_data


def _train(data: Path, run: Path, *extra: str):
    args = ["train", "-n", "2", "--data", str(data), "--run-dir", str(run), "--max-steps", "2"]
    return tmpi(*args, *extra, timeout=600)


def _refused(proc) -> str:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("tmpi: error")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


@pytest.mark.mpi
@pytest.mark.slow
def test_cli_rerun_refuse_resume_overwrite(digits: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = _train(digits, run, "--epochs", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    ck = run / "checkpoints"
    assert sorted(p.name for p in ck.glob("epoch_*.npz")) == [
        "epoch_0001.npz",
        "epoch_0001.rank1.npz",
        "epoch_0002.npz",
        "epoch_0002.rank1.npz",
    ]
    stored = json.loads(str(np.load(ck / "epoch_0002.npz")["meta"][()]))["config"]
    assert stored["model"]["batch_size"] == 32 and stored["data"]["dir"] == str(digits)
    (run / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in ck.iterdir()}

    line = _refused(_train(digits, run, "--epochs", "1"))  # a shorter rerun: refused
    assert "already holds a run" in line and "epoch_0002.npz" in line
    line = _refused(_train(digits, run, "--epochs", "3", "--resume", "--batch-size", "16"))
    assert "model.batch_size 32 -> 16" in line
    assert {p.name: p.read_bytes() for p in ck.iterdir()} == before

    resumed = _train(digits, run, "--epochs", "3", "--resume", "--set", "training.print_freq=1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "model.n_epochs 2 -> 3" in resumed.stderr and "training.print_freq 10 -> 1" in (
        resumed.stderr
    )
    assert (ck / "epoch_0003.npz").exists()

    # --overwrite with a shorter run: no stale later epoch is left for eval or --resume
    again = _train(digits, run, "--epochs", "1", "--overwrite")
    assert again.returncode == 0, again.stderr[-3000:]
    assert sorted(p.name for p in ck.iterdir()) == ["epoch_0001.npz", "epoch_0001.rank1.npz"]
    assert (run / "notes.txt").read_text() == "mine"
    epochs = [
        json.loads(ln)["epoch"]
        for ln in (run / "record" / "record.jsonl").read_text().splitlines()
        if '"kind": "epoch"' in ln
    ]
    assert len(epochs) == 1
    shutil.rmtree(run)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
