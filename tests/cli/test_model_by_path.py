"""A user's model by path: ``tmpi train --model file.py:Class`` trains it, ``tmpi eval --run-dir``
and ``--resume`` rebuild it from the run alone, a changed or moved file and a bad class get one line."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.mpi

MYNET = '''
import numpy as np
import pytensor  # the user's own imports come first
import pytensor.tensor as pt

from theanompi.models.base import Model


class MyNet(Model):
    """A perceptron written from scratch: plain shared variables, no theanompi layers."""

    def build_network(self):
        c, s, _ = self.input_shape
        rng = np.random.default_rng(0)
        f, h = c * s * s, 32
        init = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[0])).astype("float32")
        self.W1 = pytensor.shared(init(f, h), name="W1")
        self.b1 = pytensor.shared(np.zeros(h, "float32"), name="b1")
        self.W2 = pytensor.shared(init(h, self.n_classes), name="W2")
        self.b2 = pytensor.shared(np.zeros(self.n_classes, "float32"), name="b2")
        self.params = [self.W1, self.b1, self.W2, self.b2]
        return None

    def forward(self, x, train):
        h = pt.maximum(pt.dot(x.flatten(2) / 255.0, self.W1) + self.b1, 0)
        return pt.dot(h, self.W2) + self.b2


class NotAModel:
    pass
'''


def _val_err(stdout: str) -> str:
    return re.findall(r"val loss \S+ top-1 err (\S+)%", stdout)[-1]


def test_a_model_file_trains_evaluates_and_resumes_from_the_run_alone(
    cli, digits_data: Path, tmp_path: Path
) -> None:
    (tmp_path / "mynet.py").write_text(MYNET)
    (tmp_path / "MyNet").mkdir()  # a folder named like the model changes nothing
    args = ["--data", str(digits_data), "--lr", "0.05", "--max-steps", "6"]
    out = cli("train", "-n", "2", "--model", "mynet.py:MyNet", "--epochs", "2", *args, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "runs" / "MyNet"
    assert (run / "config.yaml").is_file() and (run / "checkpoints" / "epoch_0002.npz").is_file()
    err = _val_err(out.stdout)

    ev = cli("eval", "-n", "2", "--run-dir", str(run), cwd=tmp_path)  # no --model, no --config
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert re.search(rf"^\s+{re.escape(err)} %", ev.stdout, re.M), ev.stdout

    more = cli("train", "-n", "2", "--resume", "--run-dir", str(run), "--epochs", "3", cwd=tmp_path)
    assert more.returncode == 0, more.stderr[-3000:]
    assert (run / "checkpoints" / "epoch_0003.npz").is_file()

    # a changed file: one note, and the parameters still load
    (tmp_path / "mynet.py").write_text(MYNET + "\n# tuned\n")
    ev = cli("eval", "--run-dir", str(run), cwd=tmp_path)
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert "note: model source " in ev.stderr and "changed since this checkpoint" in ev.stderr

    # a moved file: one line naming it, exit 2
    shutil.move(tmp_path / "mynet.py", tmp_path / "elsewhere.py")
    ev = cli("eval", "--run-dir", str(run), cwd=tmp_path)
    lines = [ln for ln in ev.stderr.splitlines() if ln.strip()]
    assert ev.returncode == 2 and len(lines) == 1, ev.stderr
    assert "no file" in lines[0] and "mynet.py" in lines[0]


@pytest.mark.parametrize(
    ("ref", "why"),
    [
        ("mynet.py:Nope", "has no 'Nope'"),
        ("mynet.py:NotAModel", "NotAModel is not a model (no build, train_step"),
        ("gone.py:MyNet", "no file"),
        ("no_such_module:MyNet", "no module 'no_such_module'"),
    ],
)
def test_a_bad_model_reference_is_one_line_exit_2(
    cli, digits_data: Path, tmp_path: Path, ref: str, why: str
) -> None:
    (tmp_path / "mynet.py").write_text(MYNET)
    out = cli("train", "-n", "2", "--model", ref, "--data", str(digits_data), cwd=tmp_path)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith("tmpi: error:") and why in lines[0]
