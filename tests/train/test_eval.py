"""``tmpi eval``: exact metrics of a hand-set model, identical results for any N, one-line errors."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import mpi_eval_hand as hand  # noqa: E402

from theanompi.models.metrics import batch_metrics  # noqa: E402

HAND = Path(__file__).parent / "mpi_eval_hand.py"
VARYING = ("seconds", "images_per_s", "ranks")  # the only report keys allowed to depend on N


def reference_metrics(logits: np.ndarray, labels: np.ndarray) -> dict:
    """Independent numpy float64 metrics: rank of the true class by counting higher scores."""
    true = logits[np.arange(len(labels)), labels]
    higher = (logits > true[:, None]).sum(axis=1)
    z = logits - logits.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return {
        "top1_error": float(np.mean(higher >= 1)),
        "top5_error": float(np.mean(higher >= 5)),
        "loss": float(-logp[np.arange(len(labels)), labels].mean()),
        "top5": np.argsort(-logits, axis=1)[:, :5],
        "class_top1": np.bincount(labels[higher == 0], minlength=logits.shape[1]),
        "class_images": np.bincount(labels, minlength=logits.shape[1]),
    }


def test_batch_metrics_matches_numpy_and_ignores_padding() -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(40, 12))
    labels = rng.integers(0, 12, size=40).astype(np.int32)
    padded = labels.copy()
    padded[::5] = -1
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    m = batch_metrics(p, padded)
    keep = padded >= 0
    ref = reference_metrics(logits[keep], labels[keep])
    assert m["n"] == keep.sum()
    assert m["top1"] == round((1 - ref["top1_error"]) * m["n"])
    assert m["topk"] == round((1 - ref["top5_error"]) * m["n"])
    assert m["loss"] / m["n"] == pytest.approx(ref["loss"], rel=1e-12)
    np.testing.assert_array_equal(m["topk_idx"], ref["top5"])


@pytest.fixture(scope="module")
def hand_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The hand dataset, its checkpoint (W = a permutation) and the model YAML."""
    from theanompi.io.checkpoint import checkpoint_path, save_checkpoint

    root = tmp_path_factory.mktemp("eval_hand")
    arrs = hand.write_dataset(root / "data")
    model = hand.HandModel()
    for var, value in zip(model.params, hand.true_params(), strict=True):
        var.set_value(value)
    ckpt = save_checkpoint(
        checkpoint_path(root / "run" / "checkpoints", 2), model, {"epoch": 2, "step": 0}
    )
    return {"root": root, "arrs": arrs, "ckpt": ckpt, "yaml": hand.model_yaml(root / "hand.yaml")}


@pytest.mark.mpi
def test_hand_model_exact_metrics_identical_for_n_1_2_3(mpirun, hand_run) -> None:
    arrs, ckpt = hand_run["arrs"], hand_run["ckpt"]
    ref = reference_metrics(arrs["logits"], arrs["labels"])
    # what the construction promises: the true label sits at rank i % 7 of image i
    assert ref["top1_error"] == np.mean(arrs["ranks"] != 0) == 0.85
    assert ref["top5_error"] == np.mean(arrs["ranks"] >= 5) == 0.28
    reports = {}
    for n in (1, 2, 3):
        out = hand_run["root"] / f"report{n}.json"
        mpirun(n, [HAND, hand_run["root"] / "data", ckpt, hand_run["yaml"], out], timeout=180)
        rep = json.loads(out.read_text())
        assert rep["ranks"] == n
        assert rep["images"] == hand.N_IMAGES  # the 12 padded slots are ignored
        assert rep["top1_error"] == ref["top1_error"]
        assert rep["top5_error"] == ref["top5_error"]
        assert rep["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        pred = np.load(rep["predictions"])
        np.testing.assert_array_equal(pred, ref["top5"])
        per = rep["per_class"]
        assert [c["top1_correct"] for c in per] == ref["class_top1"].tolist()
        assert [c["images"] for c in per] == ref["class_images"].tolist()
        assert per[3]["wnid"] == "n00000003" and per[3]["name"] == "class3"
        on_disk = json.loads(Path(rep["report"]).read_text())
        assert on_disk["top1_error"] == rep["top1_error"]
        reports[n] = {k: v for k, v in rep.items() if k not in VARYING}
    assert reports[1] == reports[2] == reports[3]  # bit-identical loss included


# -- through the real CLI, with a real model ------------------------------------------------
def _mlp_checkpoint(root: Path, hidden: list[int], epoch: int = 1) -> Path:
    from theanompi.io.checkpoint import checkpoint_path, save_checkpoint
    from theanompi.models import create_model

    section = {
        "name": "mlp",
        "input_size": hand.CROP,
        "channels": 3,
        "n_classes": hand.K,
        "batch_size": hand.SUB_B,
        "arch": {"hidden": hidden, "seed": 5},
    }
    model = create_model(section)
    meta = {"epoch": epoch, "step": 0, "config": {"model": section}}
    return save_checkpoint(checkpoint_path(root / "checkpoints", epoch), model, meta)


def _eval_args(data: Path, run: Path, yaml_path: Path, *extra: str) -> list[str]:
    return [
        "eval",
        "--model",
        str(yaml_path),
        "--data",
        str(data),
        "--run-dir",
        str(run),
        "--set",
        f"data.file_batch_size={hand.B}",
        "--set",
        f"data.image_size={hand.S}",
        *extra,
    ]


@pytest.fixture(scope="module")
def mlp_run(hand_run) -> dict:
    root = hand_run["root"]
    run = root / "mlp_run"
    ckpt = _mlp_checkpoint(run, [32])
    yaml_path = hand.model_yaml(root / "mlp.yaml", arch={"hidden": [32], "seed": 5})
    return {"data": root / "data", "run": run, "ckpt": ckpt, "yaml": yaml_path}


@pytest.mark.mpi
def test_cli_eval_same_report_for_n_1_and_2(cli, mlp_run) -> None:
    reports = {}
    for n in (1, 2):
        out = cli(
            *_eval_args(
                mlp_run["data"],
                mlp_run["run"],
                mlp_run["yaml"],
                "-n",
                str(n),
                "--per-class",
                "--save-predictions",
            ),
            timeout=240,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        assert "top-1 error" in out.stdout and "n00000009" in out.stdout
        rep = json.loads((mlp_run["run"] / "checkpoints" / "epoch_0001.eval.json").read_text())
        assert rep["ranks"] == n and rep["images"] == hand.N_IMAGES
        rep["_pred"] = np.load(rep["predictions"]).tolist()
        reports[n] = {k: v for k, v in rep.items() if k not in VARYING}
    assert reports[1] == reports[2]


def _one_error_line(out, code: int) -> str:
    assert out.returncode == code, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("tmpi: error")]
    assert len(lines) == 1, out.stderr
    return lines[0]


def _only_error_line(out, code: int) -> str:
    """Like :func:`_one_error_line`, and that line is all of stderr (no mpirun box or noise)."""
    line = _one_error_line(out, code)
    assert [ln for ln in out.stderr.splitlines() if ln.strip()] == [line], out.stderr
    return line


def test_cli_eval_checkpoint_of_another_model_names_the_parameter(cli, mlp_run, tmp_path) -> None:
    _mlp_checkpoint(tmp_path, [16])  # trained with hidden [16]; the YAML says [32]
    out = cli(*_eval_args(mlp_run["data"], tmp_path, mlp_run["yaml"]))
    line = _one_error_line(out, 2)
    assert "'fc1.W'" in line and "16)" in line and "32)" in line


def test_cli_eval_missing_val_folder(cli, mlp_run, tmp_path) -> None:
    data = tmp_path / "data"
    shutil.copytree(mlp_run["data"], data)
    shutil.rmtree(data / f"val_hkl_b{hand.B}")
    line = _one_error_line(cli(*_eval_args(data, mlp_run["run"], mlp_run["yaml"])), 3)
    assert "val folder" in line and "not found" in line


@pytest.mark.mpi
def test_cli_eval_labels_count_mismatch_one_line_under_n2(cli, mlp_run, tmp_path) -> None:
    hand.write_dataset(tmp_path / "data", val_label_extra=3)
    out = cli(*_eval_args(tmp_path / "data", mlp_run["run"], mlp_run["yaml"], "-n", "2"))
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("tmpi: error")]
    assert len(lines) == 1, out.stderr  # rank 0 reports; the other rank exits quietly
    assert "labels" in lines[0] and "115" in lines[0]


def test_cli_eval_without_checkpoint(cli, mlp_run, tmp_path) -> None:
    line = _one_error_line(cli(*_eval_args(mlp_run["data"], tmp_path, mlp_run["yaml"])), 3)
    assert "no checkpoint" in line


@pytest.mark.mpi
def test_cli_eval_without_checkpoint_under_n2_is_one_line_before_mpirun(
    cli, mlp_run, tmp_path
) -> None:
    """Nothing to evaluate is found by the launcher: its line alone, and no rank started."""
    out = cli(*_eval_args(mlp_run["data"], tmp_path, mlp_run["yaml"], "-n", "2"))
    line = _only_error_line(out, 3)
    assert "no checkpoint" in line
    assert "ranks on" not in out.stdout, out.stdout  # mpirun never placed a rank


@pytest.mark.mpi
def test_cli_eval_rank_error_under_n2_is_our_line_alone(cli, mlp_run, tmp_path) -> None:
    """A mistake only the ranks find (a checkpoint of another model): their one line is all of
    stderr; mpirun's "exited with non-zero status" box, which only repeats it, is dropped
    (``THEANOMPI_MPI_BANNERS=1`` shows it)."""
    _mlp_checkpoint(tmp_path, [16])  # trained with hidden [16]; the YAML says [32]
    args = _eval_args(mlp_run["data"], tmp_path, mlp_run["yaml"], "-n", "2")
    out = cli(*args)
    line = _only_error_line(out, 2)
    assert "'fc1.W'" in line, line
    shown = cli(*args, env={"THEANOMPI_MPI_BANNERS": "1"})
    assert shown.returncode == 2 and "exited with non-zero status" in shown.stderr, shown.stderr
