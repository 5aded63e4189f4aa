"""TrainLoader / ValLoader on a tiny prep-format dataset: rank shares, augmentation, layouts, errors."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _train_data import image_ids, tiny_config, write_dataset  # noqa: E402

from theanompi.data import Prefetcher, TrainLoader, ValLoader, prepare_batch  # noqa: E402
from theanompi.data._fault import InjectedFailure  # noqa: E402
from theanompi.errors import ConfigError, DataError  # noqa: E402


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("d") / "data", n_train=5, n_val=2, B=16, S=10)


def _cfg(data: Path, tmp: Path, **over: object):
    return tiny_config(data, tmp / "run", **over)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_no_image_twice_and_same_steps_on_every_rank(data: Path, tmp_path: Path, size: int) -> None:
    cfg = _cfg(data, tmp_path)
    loaders = [TrainLoader(cfg, r, size) for r in range(size)]
    assert len({ld.steps_per_epoch for ld in loaders}) == 1
    n_sub = 5 * 16 // 4
    assert loaders[0].steps_per_epoch == n_sub // size
    assert loaders[0].dropped == n_sub % size
    assert f"{n_sub % size} sub-batch(es)" in loaders[0].summary
    for epoch in (0, 1):
        seen = []
        for ld in loaders:
            steps = 0
            with ld.epoch(epoch) as it:
                for x, y in it:
                    assert x.shape == (4, 3, 8, 8) and x.dtype == np.float32
                    assert y.dtype == np.int32 and y.shape == (4,)
                    seen.extend(image_ids(x))
                    steps += 1
            assert steps == ld.steps_per_epoch
        assert len(seen) == len(set(seen)) == loaders[0].steps_per_epoch * size * 4
        if size == 1:
            assert sorted(seen) == list(range(80))


def test_labels_follow_their_images(data: Path, tmp_path: Path) -> None:
    labels = np.load(data / "labels" / "train_labels.npy")
    ld = TrainLoader(_cfg(data, tmp_path), 1, 2)
    for x, y in ld.epoch(3):
        np.testing.assert_array_equal(labels[image_ids(x)], y)


def test_shuffle_is_seeded_per_epoch_and_same_on_all_ranks(data: Path, tmp_path: Path) -> None:
    cfg = _cfg(data, tmp_path)
    a, b = TrainLoader(cfg, 0, 2), TrainLoader(cfg, 1, 2)
    orders = [tuple(a.file_order(e)) for e in range(4)]
    assert len(set(orders)) > 1, "file order must change between epochs"
    assert all(tuple(b.file_order(e)) == orders[e] for e in range(4))
    other = TrainLoader(_cfg(data, tmp_path, **{"randomness.seed": 99}), 0, 2)
    assert [tuple(other.file_order(e)) for e in range(4)] != orders
    det = TrainLoader(_cfg(data, tmp_path, **{"randomness.deterministic": True}), 0, 1)
    assert all(tuple(det.file_order(e)) == tuple(range(5)) for e in range(3))


def test_augmentation_is_reproducible_and_resumable(data: Path, tmp_path: Path) -> None:
    cfg = _cfg(data, tmp_path)
    one = [x for x, _ in TrainLoader(cfg, 0, 2).epoch(2)]
    two = [x for x, _ in TrainLoader(cfg, 0, 2).epoch(2)]
    tail = [x for x, _ in TrainLoader(cfg, 0, 2).epoch(2, start=3)]
    for p, q in zip(one, two, strict=True):
        np.testing.assert_array_equal(p, q)
    for p, q in zip(one[3:], tail, strict=True):
        np.testing.assert_array_equal(p, q)


def _reference(
    img: np.ndarray, mean: np.ndarray, r: int, c: int, crop: int, flip: bool
) -> np.ndarray:
    out = (
        img[:, r : r + crop, c : c + crop].astype(np.float32) - mean[:, r : r + crop, c : c + crop]
    )
    return out[..., ::-1] if flip else out


@pytest.mark.parametrize("layout", ["c01b", "bc01"])
def test_prepare_batch_matches_reference(layout: str) -> None:
    rng = np.random.default_rng(3)
    B, b, S, crop = 8, 4, 12, 9
    imgs = rng.integers(0, 256, (B, 3, S, S)).astype(np.uint8)
    mean = rng.random((3, S, S)).astype(np.float32) * 255
    batch = imgs.transpose(1, 2, 3, 0).copy() if layout == "c01b" else imgs
    offsets = rng.integers(0, S - crop + 1, (b, 2))
    flips = np.array([True, False, True, False])
    got = prepare_batch(batch, 1, b, layout, mean, crop, offsets, flips)
    for i in range(b):
        want = _reference(imgs[4 + i], mean, *offsets[i], crop, bool(flips[i]))
        np.testing.assert_array_equal(got[i], want)
    centre = prepare_batch(batch, 0, b, layout, mean, crop)
    o = (S - crop) // 2
    for i in range(b):
        np.testing.assert_array_equal(centre[i], _reference(imgs[i], mean, o, o, crop, False))


def test_both_layouts_load_identically(tmp_path: Path) -> None:
    xs = {}
    for layout in ("c01b", "bc01"):
        d = write_dataset(tmp_path / layout, layout=layout, zero_mean=False)
        cfg = tiny_config(d, tmp_path / "run", **{"data.layout": layout})
        xs[layout] = [x for x, _ in TrainLoader(cfg, 0, 1).epoch(1)]
    for p, q in zip(xs["c01b"], xs["bc01"], strict=True):
        np.testing.assert_array_equal(p, q)


def test_mean_is_subtracted_and_deterministic_mode_centre_crops(tmp_path: Path) -> None:
    d = write_dataset(tmp_path / "d", zero_mean=False, B=8, n_train=2)
    mean = np.load(d / "misc" / "img_mean.npy")
    cfg = tiny_config(d, tmp_path / "run", **{"randomness.deterministic": True})
    ld = TrainLoader(cfg, 0, 1)
    x, _ = next(iter(ld.epoch(0)))
    from theanompi.io.dataset import load_batch

    raw = load_batch(d / "train_hkl_b8" / "0000.hkl")  # c01b
    want = raw[:, 1:9, 1:9, :4].transpose(3, 0, 1, 2).astype(np.float32) - mean[:, 1:9, 1:9]
    np.testing.assert_array_equal(x, want)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_val_covers_every_real_image_once(data: Path, tmp_path: Path, size: int) -> None:
    cfg = _cfg(data, tmp_path)
    labels = np.load(data / "labels" / "val_labels.npy")
    ids, ys = [], []
    for r in range(size):
        vl = ValLoader(cfg, r, size)
        for x, y in vl.batches():
            ids.extend(image_ids(x)[y >= 0])
            ys.extend(y)
    assert sorted(ids) == list(np.flatnonzero(labels >= 0))
    assert -1 in ys  # the padded tail reaches the caller as -1
    assert ValLoader(cfg, 0, size).n_images == int((labels >= 0).sum())


def test_max_steps_caps_the_epoch(data: Path, tmp_path: Path) -> None:
    ld = TrainLoader(_cfg(data, tmp_path, **{"training.max_steps": 3}), 0, 2)
    assert ld.steps_per_epoch == 3
    assert len(list(ld.epoch(0))) == 3
    assert "capped" in ld.summary


def test_loader_thread_error_reaches_the_consumer(data: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("THEANOMPI_FAIL", "loader:0:1")
    it = TrainLoader(_cfg(data, tmp_path), 0, 1).epoch(0)
    next(it)
    with pytest.raises(InjectedFailure, match="loader at step 1"):
        next(it)


def test_prefetcher_runs_ahead_and_closes_early() -> None:
    produced = []

    def source():
        for i in range(1000):
            produced.append(i)
            yield i

    before = threading.active_count()
    pf = Prefetcher(source(), depth=2)
    assert next(pf) == 0
    time.sleep(0.2)
    assert 2 <= len(produced) <= 5  # bounded read-ahead
    pf.close()
    assert threading.active_count() == before
    assert list(Prefetcher(iter(range(5)), enabled=False)) == list(range(5))


def test_manifest_mismatch_is_one_line_config_error(data: Path, tmp_path: Path) -> None:
    cfg = _cfg(data, tmp_path, **{"data.file_batch_size": 32})
    with pytest.raises(
        ConfigError, match=r"data.file_batch_size=32 .* says 16; pass --set data.file_batch_size=16"
    ):
        TrainLoader(cfg, 0, 1)


def test_missing_data_dir_is_a_data_error(tmp_path: Path, data: Path) -> None:
    cfg = _cfg(data, tmp_path, **{"data.dir": str(tmp_path / "nothing")})
    with pytest.raises(DataError, match="no prep output"):
        TrainLoader(cfg, 0, 1)


def test_too_many_ranks_is_a_data_error(data: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match="cannot feed 40 ranks"):
        TrainLoader(_cfg(data, tmp_path), 0, 40)
