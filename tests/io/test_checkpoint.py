"""Checkpoints: round trip, atomic replace, latest, and name/shape checks on apply."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytensor
import pytest

from theanompi.errors import ConfigError, DataError
from theanompi.io.checkpoint import (
    apply_checkpoint,
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    rank_state_path,
    save_checkpoint,
)


class Model:
    def __init__(self, shapes: dict[str, tuple[int, ...]], seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.params = [
            pytensor.shared(rng.random(s).astype(np.float32), name=n) for n, s in shapes.items()
        ]
        self.opt_state = [
            pytensor.shared(np.zeros(s, np.float32), name=f"{n}.v") for n, s in shapes.items()
        ]


SHAPES = {"conv1.W": (4, 3, 3, 3), "conv1.b": (4,), "fc.W": (36, 10)}


def test_round_trip_restores_values_and_meta(tmp_path: Path) -> None:
    src = Model(SHAPES, seed=1)
    src.opt_state[0].set_value(np.full((4, 3, 3, 3), 0.5, np.float32))
    meta = {
        "epoch": 3,
        "step": 120,
        "config": {"model": {"name": "x"}},
        "rng": [{"a": 2**70}],
        "val": {"val_top1_err": np.float32(0.25)},
    }
    path = save_checkpoint(checkpoint_path(tmp_path, 3), src, meta)
    assert path.name == "epoch_0003.npz"
    ck = load_checkpoint(path)
    assert (ck.epoch, ck.step) == (3, 120)
    assert ck.meta["param_names"] == list(SHAPES) and ck.meta["rng"] == [{"a": 2**70}]
    assert ck.meta["param_shapes"][0] == [4, 3, 3, 3]
    dst = Model(SHAPES, seed=2)
    apply_checkpoint(dst, ck)
    for a, b in zip(src.params + src.opt_state, dst.params + dst.opt_state, strict=True):
        np.testing.assert_array_equal(a.get_value(), b.get_value())


def test_latest_ignores_temp_and_side_files(tmp_path: Path) -> None:
    m = Model(SHAPES)
    assert latest_checkpoint(tmp_path) is None and latest_checkpoint(tmp_path / "absent") is None
    for e in (2, 10, 1):
        save_checkpoint(checkpoint_path(tmp_path, e), m, {"epoch": e})
    (tmp_path / ".epoch_0011.x.tmp.npz").write_bytes(b"partial")
    rank_state_path(checkpoint_path(tmp_path, 12), 1).write_bytes(b"side")
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "epoch_0001.npz",
        "epoch_0002.npz",
        "epoch_0010.npz",
    ]
    assert latest_checkpoint(tmp_path).name == "epoch_0010.npz"


def test_failed_save_keeps_the_previous_file(tmp_path: Path, monkeypatch) -> None:
    m = Model(SHAPES)
    path = checkpoint_path(tmp_path, 1)
    save_checkpoint(path, m, {"epoch": 1})
    before = path.read_bytes()

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez", boom)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, m, {"epoch": 99})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["epoch_0001.npz"]


def test_shape_mismatch_names_the_parameter(tmp_path: Path) -> None:
    path = save_checkpoint(checkpoint_path(tmp_path, 1), Model(SHAPES), {"epoch": 1})
    other = Model({**SHAPES, "fc.W": (36, 5)})
    with pytest.raises(
        ConfigError, match=r"param 'fc.W' has shape \(36, 10\) in the checkpoint but \(36, 5\)"
    ) as e:
        apply_checkpoint(other, load_checkpoint(path))
    assert "\n" not in str(e.value)


def test_name_and_count_mismatch(tmp_path: Path) -> None:
    path = save_checkpoint(checkpoint_path(tmp_path, 1), Model(SHAPES), {"epoch": 1})
    renamed = Model({"conv1.W": (4, 3, 3, 3), "conv1.bias": (4,), "fc.W": (36, 10)})
    with pytest.raises(ConfigError, match="'conv1.b' in the checkpoint but 'conv1.bias'"):
        apply_checkpoint(renamed, load_checkpoint(path))
    bigger = Model({**SHAPES, "fc.b": (10,)})
    with pytest.raises(ConfigError, match="'fc.b' is missing from the checkpoint"):
        apply_checkpoint(bigger, load_checkpoint(path))
    smaller = Model({"conv1.W": (4, 3, 3, 3)})
    with pytest.raises(ConfigError, match="'conv1.b' does not exist in the model"):
        apply_checkpoint(smaller, load_checkpoint(path))


def test_corrupt_or_missing_file_is_a_data_error(tmp_path: Path) -> None:
    bad = tmp_path / "epoch_0001.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(DataError, match="unreadable"):
        load_checkpoint(bad)
    with pytest.raises(DataError, match="not found"):
        load_checkpoint(tmp_path / "epoch_0002.npz")


def test_mid_epoch_names_sort_between_epochs(tmp_path: Path) -> None:
    m = Model(SHAPES)
    for epoch, k in [(1, 0), (0, 5), (1, 3), (0, 0), (1, 12), (2, 0)]:
        save_checkpoint(checkpoint_path(tmp_path, epoch, k), m, {"epoch": epoch, "step": 0})
    save_checkpoint(rank_state_path(checkpoint_path(tmp_path, 2, 4), 1), m, {})  # a side file
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == [
        "epoch_0000.npz",
        "epoch_0000_step_00005.npz",
        "epoch_0001.npz",
        "epoch_0001_step_00003.npz",
        "epoch_0001_step_00012.npz",
        "epoch_0002.npz",
    ]
    assert latest_checkpoint(tmp_path).name == "epoch_0002.npz"
    save_checkpoint(checkpoint_path(tmp_path, 2, 1), m, {"epoch": 2, "step": 0})
    assert latest_checkpoint(tmp_path).name == "epoch_0002_step_00001.npz"
    assert rank_state_path(checkpoint_path(tmp_path, 2, 1), 1).name == (
        "epoch_0002_step_00001.rank1.npz"
    )


def test_snapshot_freq_zero_means_only_after_the_last_epoch() -> None:
    from theanompi.train.snapshot import Snapshotter

    class Comm:
        def Get_rank(self) -> int:
            return 0

        def Get_size(self) -> int:
            return 1

    due = [Snapshotter(".", f, Comm(), Model(SHAPES), local_opt=False).due for f in (0, 1, 2)]
    assert [e for e in range(1, 6) if due[0](e, 5)] == [5]
    assert [e for e in range(1, 6) if due[1](e, 5)] == [1, 2, 3, 4, 5]
    assert [e for e in range(1, 6) if due[2](e, 5)] == [2, 4, 5]
