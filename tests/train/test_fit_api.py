"""``tm.load_config`` and ``tm.fit`` from a script of your own, started by a bare ``mpirun -n 2
python script.py`` (``tests/cli/test_run_command.py`` starts it with ``tmpi run``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import theanompi as tm
from theanompi.config import load_config as config_load_config
from theanompi.errors import ConfigError
from theanompi.train.api import as_percent

SCRIPT = Path(__file__).with_name("mpi_fit_digits.py")


def test_load_config_is_the_clis_config(digits_data: Path, tmp_path: Path) -> None:
    over = {"data.dir": digits_data, "output.run_dir": tmp_path / "r", "model.n_epochs": 2}
    cfg = tm.load_config(model="digits", overrides=over)
    same = config_load_config(
        None, "digits", {k: str(v) for k, v in over.items()} | {"model.n_epochs": 2}
    )
    assert cfg.to_dict() == same.to_dict()
    assert cfg.model.n_epochs == 2 and cfg.data.dir == str(digits_data)
    with pytest.raises(ConfigError, match="model.n_epochs"):
        tm.load_config("digits", overrides={"model.n_epochs": 0})


def test_fit_gives_percent_and_keeps_none() -> None:
    got = as_percent({"val_top1_err": 0.0575, "val_top5_err": None, "val_loss": 0.5})
    assert got == {"val_top1_err": pytest.approx(5.75), "val_top5_err": None, "val_loss": 0.5}


@pytest.mark.mpi
def test_fit_under_a_bare_mpirun(mpirun, digits_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    proc = mpirun(2, [SCRIPT, digits_data, tmp_path / "run", out], timeout=600)
    summary = json.loads(out.read_text())
    printed = re.findall(r"top-1 err (\S+)% top-5 err (\S+)%", proc.stdout)[-1]
    assert (f"{summary['val_top1_err']:.2f}", f"{summary['val_top5_err']:.2f}") == printed
    assert summary["steps"] == 4 and summary["interrupted"] is False
    assert (tmp_path / "run" / "checkpoints" / "epoch_0001.npz").is_file()
    assert (tmp_path / "run" / "config.yaml").is_file()
