"""Data integrity: batch digests against the prep manifest (first read, or all with --verify-data),
corrupt mean and labels, each one line naming the file and the prep stage to rerun (exit 3)."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import hickle
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _train_data import tiny_config, write_dataset  # noqa: E402

from theanompi.data import TrainLoader, ValLoader  # noqa: E402
from theanompi.data.loader import DataSet  # noqa: E402
from theanompi.errors import ConfigError, DataError  # noqa: E402
from theanompi.launch.testing import tmpi  # noqa: E402


def _sha(images: np.ndarray, labels: np.ndarray) -> str:
    """The digest written independently of prep: SHA-256 of the C-order bytes, then int32 LE."""
    return hashlib.sha256(
        np.ascontiguousarray(images).tobytes() + labels.astype("<i4").tobytes()
    ).hexdigest()


def _add_digests(root: Path) -> None:
    man = json.loads((root / "misc" / "manifest.json").read_text())
    B = man["batch_size"]
    for split in ("train", "val"):
        labels = np.load(root / "labels" / f"{split}_labels.npy")
        files = sorted((root / man[split]["dir"]).glob("*.hkl"))
        man[split]["digests"] = [
            _sha(hickle.load(str(f)), labels[i * B : (i + 1) * B]) for i, f in enumerate(files)
        ]
    (root / "misc" / "manifest.json").write_text(json.dumps(man))


@pytest.fixture
def data(tmp_path: Path) -> Path:
    root = write_dataset(tmp_path / "data", n_train=5, n_val=2, B=16, S=10)
    _add_digests(root)
    return root


def _corrupt_batch(path: Path) -> None:
    """Zero a few bytes of the images (the file stays a valid hickle file)."""
    arr = hickle.load(str(path))
    arr[..., :2] = 0
    arr[0, 0, 0, 0] = 0
    hickle.dump(arr, str(path), mode="w")


def _epoch(loader: TrainLoader, e: int = 0) -> int:
    with loader.epoch(e) as it:
        return sum(1 for _ in it)


def test_clean_data_passes_and_each_file_is_checked_once(data: Path, tmp_path: Path) -> None:
    ld = TrainLoader(tiny_config(data, tmp_path / "r"), 0, 1)
    assert ld.ds.digests is not None and ld.ds.verify_mode == "first_read"
    assert _epoch(ld) == ld.steps_per_epoch
    assert ld.ds._checked == set(range(5))
    assert _epoch(ld, 1) == ld.steps_per_epoch  # second epoch: nothing re-hashed, still fine


def test_a_corrupt_batch_stops_at_first_read(data: Path, tmp_path: Path) -> None:
    bad = data / "train_hkl_b16" / "0003.hkl"
    _corrupt_batch(bad)
    ld = TrainLoader(tiny_config(data, tmp_path / "r"), 0, 1)
    with pytest.raises(DataError) as info:
        _epoch(ld)
    msg = str(info.value)
    assert "\n" not in msg and str(bad) in msg and "tmpi prep batch" in msg
    # --verify-data: found up front, whichever rank holds the file in its share
    found = []
    for rank in range(2):
        ds = DataSet(tiny_config(data, tmp_path / "r", **{"data.verify": "all"}), "train")
        try:
            ds.verify(rank, 2)
        except DataError as err:
            found.append((rank, str(err)))
    assert [r for r, _ in found] == [1] and str(bad) in found[0][1]  # 3 is in rank 1's share


def test_changed_labels_are_caught_by_the_digest(data: Path, tmp_path: Path) -> None:
    lab = np.load(data / "labels" / "val_labels.npy")
    lab[3] = (lab[3] + 1) % 4  # still a valid class: only the digest can tell
    np.save(data / "labels" / "val_labels.npy", lab)
    ld = ValLoader(tiny_config(data, tmp_path / "r"), 0, 1)
    with pytest.raises(DataError, match=r"val_hkl_b16/0000\.hkl or its labels differ"):
        list(ld.batches())


def test_verify_off_and_manifests_without_digests_read_as_before(
    data: Path, tmp_path: Path
) -> None:
    _corrupt_batch(data / "train_hkl_b16" / "0001.hkl")
    off = TrainLoader(tiny_config(data, tmp_path / "r", **{"data.verify": "off"}), 0, 1)
    assert _epoch(off) == off.steps_per_epoch
    man = json.loads((data / "misc" / "manifest.json").read_text())
    del man["train"]["digests"]
    (data / "misc" / "manifest.json").write_text(json.dumps(man))
    old = TrainLoader(tiny_config(data, tmp_path / "r"), 0, 1)
    assert old.ds.digests is None and _epoch(old) == old.steps_per_epoch


def test_verify_all_checks_every_file_once(data: Path, tmp_path: Path) -> None:
    cfg = tiny_config(data, tmp_path / "r", **{"data.verify": "all"})
    shares = [DataSet(cfg, "train").verify(r, 3) for r in range(3)]
    assert shares == [2, 2, 1]


@pytest.mark.parametrize(
    "content,words",
    [
        (b"garbage" * 50, "not a readable .npy array"),
        (np.full((3, 10, 10), np.nan, np.float32), "holds nan"),
        (np.full((3, 10, 10), 300.0, np.float32), "holds 300.0"),
        (np.zeros((3, 10, 10), np.int64), "dtype int64"),
        (np.zeros((3, 8, 8), np.float32), "has shape (3, 8, 8)"),
    ],
)
def test_corrupt_mean_is_one_line_naming_the_file(
    data: Path, tmp_path: Path, content: object, words: str
) -> None:
    path = data / "misc" / "img_mean.npy"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        np.save(path, content)
    with pytest.raises(DataError) as info:
        TrainLoader(tiny_config(data, tmp_path / "r"), 0, 1)
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg and words in msg and "tmpi prep mean" in msg


@pytest.mark.parametrize(
    "change,words",
    [
        (lambda a: a.astype(np.float32), "dtype float32"),
        (lambda a: a.astype(np.float64) + 0.5, "float labels are not cast"),
        (lambda a: np.where(np.arange(len(a)) == 7, 57, a), "label 57 at position 7"),
        (lambda a: np.where(np.arange(len(a)) == 2, -5, a), "label -5 at position 2"),
        (lambda a: a.reshape(-1, 2), "expected one label per image"),
    ],
)
def test_corrupt_labels_say_rerun_the_labels_stage(
    data: Path, tmp_path: Path, change, words: str
) -> None:
    path = data / "labels" / "train_labels.npy"
    np.save(path, change(np.load(path)))
    with pytest.raises(DataError) as info:
        TrainLoader(tiny_config(data, tmp_path / "r"), 0, 1)
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg and words in msg
    assert "tmpi prep labels" in msg and "n_classes:" not in msg


def test_labels_within_the_manifest_but_not_the_model_name_n_classes(
    data: Path, tmp_path: Path
) -> None:
    cfg = tiny_config(data, tmp_path / "r", **{"model.n_classes": 2})
    with pytest.raises(ConfigError, match=r"model\.n_classes=2; set n_classes: 4"):
        TrainLoader(cfg, 0, 1)


# -- real prep output, real CLI ---------------------------------------------------------------
@pytest.fixture
def prepped(digits_data: Path) -> Path:
    return digits_data


def test_prep_digests_are_the_independent_sha256(prepped: Path) -> None:
    man = json.loads((prepped / "misc" / "manifest.json").read_text())
    labels = np.load(prepped / "labels" / "val_labels.npy")
    B = man["batch_size"]
    first = hickle.load(str(prepped / man["val"]["dir"] / "0000.hkl"))
    assert _sha(first, labels[:B]) == man["val"]["digests"][0]


def _train(data: Path, run: Path, *extra: str):
    return tmpi(
        "train", "--data", str(data), "--run-dir", str(run), "--epochs", "1", *extra, timeout=600
    )


def _one_error_line(proc, code: int = 3) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    lines = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


@pytest.mark.mpi
def test_cli_corrupt_mean_and_labels_exit_3(prepped: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(prepped, data)
    (data / "misc" / "img_mean.npy").write_bytes(b"\x93NUMPY garbage" * 100)
    line = _one_error_line(_train(data, tmp_path / "r1"))
    assert "img_mean.npy" in line and "tmpi prep mean" in line
    shutil.copy(prepped / "misc" / "img_mean.npy", data / "misc" / "img_mean.npy")
    lab = np.load(data / "labels" / "train_labels.npy")
    lab[100] = 57
    np.save(data / "labels" / "train_labels.npy", lab)
    line = _one_error_line(_train(data, tmp_path / "r2"))
    assert "label 57" in line and "tmpi prep labels" in line and "set n_classes" not in line


@pytest.mark.mpi
@pytest.mark.slow
def test_cli_corrupt_batch_exit_3_first_read_and_verify_data(prepped: Path, tmp_path: Path) -> None:
    from theanompi.config import load_config

    data = tmp_path / "data"
    shutil.copytree(prepped, data)
    cfg = load_config(None, None, {"data.dir": str(data)})
    first = TrainLoader(cfg, 0, 1).assignment(0)[0][0]  # the file step 1 reads
    bad = data / "train_hkl_b128" / f"{first:04d}.hkl"
    _corrupt_batch(bad)
    line = _one_error_line(_train(data, tmp_path / "r1", "--verify-data"))
    assert str(bad) in line and "tmpi prep batch" in line
    line = _one_error_line(_train(data, tmp_path / "r2", "--max-steps", "1"))
    assert str(bad) in line and "tmpi prep batch" in line
