"""``tmpi train|eval -n N`` refuses what needs no rank before mpirun starts: the user sees our
one line, never Open MPI's "prterun detected that one or more processes exited" box."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

MODEL_YAML = str(Path(__file__).parents[1] / "model_mlp.yaml")
#: what would show that mpirun ran: rank 0's first line, Open MPI's exit box
STARTED = ("tmpi: 2 ranks on", "prterun", "mpirun detected", "PMIX")


@pytest.fixture(autouse=True)
def _not_under_make(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MAKELEVEL", raising=False)  # `make test` sets it; the wording differs


def only_line(out, code: int) -> str:
    """The one stderr line of a command that exited ``code`` without starting mpirun."""
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == code and len(lines) == 1, (out.returncode, out.stdout, out.stderr)
    assert lines[0].startswith("tmpi: error: ")
    for sign in STARTED:
        assert sign not in out.stdout + out.stderr, (sign, out.stdout, out.stderr)
    return lines[0]


@pytest.fixture
def old_run(tmp_path: Path) -> Path:
    """A run dir holding a run (a checkpoint is all the refusal looks at)."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    np.savez(run / "checkpoints" / "epoch_0003.npz", w=np.zeros(2, np.float32))
    return run


def _train(cli, run: Path, *extra: str, env: dict[str, str] | None = None):
    return cli("train", "-n", "2", "--model", MODEL_YAML, "--run-dir", str(run), *extra, env=env)


def test_a_run_dir_holding_a_run_is_refused_before_mpirun(cli, old_run: Path) -> None:
    line = only_line(_train(cli, old_run), 2)
    assert line == (
        f"tmpi: error: run dir {str(old_run)!r} already holds a run (1 checkpoint(s), latest "
        "epoch_0003.npz); pass --resume to continue it, --overwrite to replace it, or "
        "--run-dir NEW for a new run"
    )
    line = only_line(_train(cli, old_run, "--resume", "--overwrite"), 2)
    assert "--resume and --overwrite contradict each other" in line
    assert sorted(p.name for p in old_run.rglob("*")) == ["checkpoints", "epoch_0003.npz"]


def test_under_make_the_refusal_names_make_variables(cli, old_run: Path) -> None:
    line = only_line(_train(cli, old_run, env={"MAKELEVEL": "1"}), 2)
    assert "already holds a run" in line
    for way in ("RESUME=1", "OVERWRITE=1", "RUN="):
        assert way in line, line
    assert "--resume" not in line and "--overwrite" not in line


def test_missing_data_is_refused_before_mpirun(cli, tmp_path: Path) -> None:
    none = tmp_path / "none"
    for command in (
        ["train", "--run-dir", str(tmp_path / "run")],
        ["eval", "--run-dir", str(tmp_path / "run")],
    ):
        out = cli(*command, "-n", "2", "--model", MODEL_YAML, "--data", str(none))
        assert f"no prep output in {str(none)!r}" in only_line(out, 3)
    assert not (tmp_path / "run").exists(), "the launcher's checks write nothing"


def test_config_that_does_not_fit_the_data_is_refused_before_mpirun(cli, tmp_path: Path) -> None:
    """The loaders' checks of the config against the prep manifest run in the launcher too."""
    data = tmp_path / "data"
    (data / "misc").mkdir(parents=True)
    manifest = {"batch_size": 128, "size": 24, "layout": "c01b"}
    (data / "misc" / "manifest.json").write_text(json.dumps(manifest))
    out = _train(cli, tmp_path / "run", "--data", str(data))
    line = only_line(out, 2)
    assert "data.image_size=32 but" in line and "pass --set data.image_size=24" in line


@pytest.mark.parametrize(
    ("model", "says"),
    [
        (["--model", "alexnet"], "model.input_size=227 exceeds data.image_size=32"),
        (["--model", "digits", "--set", "model.channels=1"], "model.channels=1 but the data has 3"),
        (["--model", "digits", "--set", "model.n_classes=5"], "labels go up to 9 but model.n_cl"),
    ],
    ids=["input-size", "channels", "classes"],
)
def test_a_model_whose_input_does_not_fit_the_data_is_refused_before_mpirun(
    cli, digits_data: Path, tmp_path: Path, model: list[str], says: str
) -> None:
    """Real prep output (the digits): the model's input size, channels and classes are held
    against its manifest, mean image and labels in the launcher."""
    run = tmp_path / "run"
    out = cli("train", "-n", "2", *model, "--data", str(digits_data), "--run-dir", str(run))
    assert says in only_line(out, 2)
    assert not run.exists(), "the launcher's checks write nothing"
