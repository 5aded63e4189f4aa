"""batch: pixel content vs independent decodes, layouts, drop/pad, resume, stale plans, dealing.

Two references: Pillow's own ``ImageOps.fit`` (fixed point, uint8 between its passes; we may
differ by 1) and ``fx.float_reference``, the same filter plainly in float64 numpy (exact).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from prep import batch, labels, shuffle
from theanompi.errors import ConfigError
from theanompi.io import dataset as io


def test_batches_match_independent_decode(fx, tree, prepped: Path) -> None:
    root, _ = tree
    man = io.read_manifest(prepped)
    assert man["layout"] == "c01b" and man["batch_size"] == fx.B and man["size"] == fx.S
    order = (prepped / "misc" / "shuffled_train_filenames.txt").read_text().splitlines()
    files = io.batch_files(prepped, "train")
    assert len(files) == man["train"]["n_batches"] == 14 // fx.B
    for k, f in enumerate(files):
        arr = io.load_batch(f)
        assert arr.shape == (3, fx.S, fx.S, fx.B) and arr.dtype == np.uint8
        for j in range(fx.B):
            got, rel = arr[..., j].transpose(1, 2, 0), order[k * fx.B + j]
            _close(got, fx.reference_decode(root / rel), rel)
            np.testing.assert_array_equal(got, fx.float_reference(root / rel), err_msg=rel)


def _close(got: np.ndarray, pillow: np.ndarray, what: str) -> None:
    """Within 1 of Pillow's resize everywhere."""
    diff = np.abs(got.astype(int) - pillow)
    assert got.shape == pillow.shape and diff.max() <= 1, (what, diff.max())


def test_val_is_padded(fx, tree, prepped: Path) -> None:
    root, expect = tree
    man = io.read_manifest(prepped)
    assert man["val"]["n_batches"] == 2 and man["val"]["n_padded"] == 3
    assert man["train"]["n_dropped"] == 14 % fx.B and man["n_skipped"] == 2
    last = io.load_batch(io.batch_files(prepped, "val")[-1])
    assert not last[..., 1:].any()  # padded slots are zero
    val_paths = [p for p, _ in expect["val"]]
    got = last[..., 0].transpose(1, 2, 0)
    _close(got, fx.reference_decode(root / val_paths[-1]), val_paths[-1])
    np.testing.assert_array_equal(got, fx.float_reference(root / val_paths[-1]))


def test_exif_rotation_applied(fx, tree) -> None:
    root, _ = tree
    arr = batch.load_image(root / "train" / "n01000002" / "n01000002_3.JPEG", fx.S)
    with Image.open(root / "train" / "n01000002" / "n01000002_3.JPEG") as im:
        upright = im.convert("RGB").transpose(Image.Transpose.ROTATE_270)
    assert upright.size == (18, 30)  # stored 30x18, displayed 18x30
    from PIL import ImageOps

    assert arr.shape == (fx.S, fx.S, 3) and arr.dtype == np.uint8 and arr.flags.c_contiguous
    _close(arr, np.asarray(ImageOps.fit(upright, (fx.S, fx.S), Image.Resampling.BILINEAR)), "exif")
    np.testing.assert_array_equal(arr, fx.reference_resize(np.asarray(upright), fx.S))


def test_large_jpeg_uses_draft_and_stays_close(fx, tmp_path: Path) -> None:
    path = tmp_path / "big.JPEG"
    fx.photo(640, 480, 3).save(path, quality=90)
    with Image.open(path) as im:
        im.draft("RGB", (64, 64))
        assert im.size == (160, 120)  # DCT-scaled 1/4
    ours = batch.load_image(path, 64)
    ref = fx.reference_decode(path, 64).astype(float)  # full decode: not the same pixels
    assert np.abs(ours - ref).mean() < 4.0
    np.testing.assert_array_equal(ours, fx.float_reference(path, 64))


def test_bc01_layout_and_pad_drop(fx, tree, tmp_path: Path, prepped: Path) -> None:
    for sub in ("misc/scan.json", "misc/shuffle.json", "misc/shuffled_train_filenames.txt"):
        (tmp_path / sub).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(prepped / sub, tmp_path / sub)
    batch.run(
        tmp_path,
        batch_size=fx.B,
        size=fx.S,
        layout="bc01",
        last="pad",
        val_last="drop",
        progress=False,
    )
    man = io.read_manifest(tmp_path)
    assert man["train"]["n_batches"] == 4 and man["train"]["n_padded"] == 2
    assert man["val"]["n_batches"] == 1 and man["val"]["n_dropped"] == 1
    for k in range(3):
        a = io.load_batch(io.batch_files(tmp_path, "train")[k])
        c = io.load_batch(io.batch_files(prepped, "train")[k])
        assert a.shape == (fx.B, 3, fx.S, fx.S)
        np.testing.assert_array_equal(a, c.transpose(3, 0, 1, 2))
    lab = labels.run(tmp_path)["train"]
    assert lab.shape == (16,) and (lab[-2:] == -1).all() and (lab[:-2] >= 0).all()


def test_resume_and_stale_plan(fx, prepped: Path, tmp_path: Path) -> None:
    out = tmp_path / "d"
    shutil.copytree(prepped, out)
    files = io.batch_files(out, "train")
    before = {f: f.read_bytes() for f in files}
    mtimes = {f: f.stat().st_mtime_ns for f in files}
    files[1].unlink()
    stats = batch.run(out, batch_size=fx.B, size=fx.S, progress=False)
    assert stats["written"] == 1 and stats["reused"] == 4
    assert {f: f.read_bytes() for f in files} == before
    assert all(files[k].stat().st_mtime_ns == mtimes[files[k]] for k in (0, 2))
    shuffle.run(out, seed=8)  # a new order: every train batch is stale, val ones are not
    stats = batch.run(out, batch_size=fx.B, size=fx.S, progress=False)
    assert stats["written"] == 3 and stats["reused"] == 2


def _zero_pixels(path: Path, n: int = 1000) -> None:
    """Zero ``n`` bytes inside the batch's pixel data, in place (the HDF5 file stays readable)."""
    import h5py

    with h5py.File(path, "r") as f:
        found: list = []
        f.visititems(lambda _, obj: found.append(obj) if isinstance(obj, h5py.Dataset) else None)
        ds = max(found, key=lambda d: d.size or 0)
        offset, nbytes = ds.id.get_offset(), ds.id.get_storage_size()
    assert offset is not None and nbytes >= n + 100
    with open(path, "r+b") as fh:
        fh.seek(offset + 100)
        fh.write(bytes(n))


def test_resume_rewrites_a_corrupt_batch_and_verify_catches_it(fx, prepped: Path, tmp_path: Path):
    """1,000 zeroed bytes: verify names the batch; resume rewrites it (digest != journal)."""
    from prep import verify
    from theanompi.errors import DataError

    out = tmp_path / "d"
    shutil.copytree(prepped, out)
    checksum = io.read_manifest(out)["checksum"]
    files = io.batch_files(out, "train")
    before = files[1].read_bytes()
    _zero_pixels(files[1])
    assert files[1].read_bytes() != before and io.load_batch(files[1]).shape == (
        3,
        fx.S,
        fx.S,
        fx.B,
    )
    with pytest.raises(DataError, match=r"1 of 5 batches bad \(first: .*0001.hkl: content"):
        verify.run(out)
    stats = batch.run(out, batch_size=fx.B, size=fx.S, progress=False)
    assert stats["written"] == 1 and stats["reused"] == 4
    assert files[1].read_bytes() == before
    assert verify.run(out)["checksum"] == checksum == io.read_manifest(out)["checksum"]


def test_unrecorded_batches_are_rewritten(fx, prepped: Path, tmp_path: Path) -> None:
    """A batch with no journal line (e.g. a crash between its rename and the append) is redone."""
    out = tmp_path / "d"
    shutil.copytree(prepped, out)
    journals = sorted(out.glob("*_hkl_b*/digests-r*.txt"))
    assert [j.parent.name for j in journals] == ["train_hkl_b4", "val_hkl_b4"]
    lines = journals[0].read_text().splitlines()
    assert len(lines) == 3 and all(len(ln.split()[1]) == 64 for ln in lines)
    journals[0].write_text("\n".join(lines[1:]) + "\n0 torn-li")  # batch 0's line lost, a torn tail
    stats = batch.run(out, batch_size=fx.B, size=fx.S, progress=False)
    assert stats["written"] == 1 and stats["reused"] == 4
    assert journals[0].read_text().splitlines()[-1] == lines[0]


def test_batches_of_the_old_resampler_are_redone(fx, prepped: Path, tmp_path: Path) -> None:
    out = tmp_path / "d"
    shutil.copytree(prepped, out)
    plan_file = io.batch_files(out, "val")[0].parent / "plan.json"
    plan = json.loads(plan_file.read_text())
    assert plan["resample"] == batch.RESAMPLE and "reducing_gap" not in plan
    old = {k: v for k, v in plan.items() if k != "resample"} | {
        "resample": "bilinear",
        "reducing_gap": 2.0,
    }
    plan_file.write_text(json.dumps(old))  # as written before the numba resampler
    stats = batch.run(out, batch_size=fx.B, size=fx.S, progress=False)
    assert stats["written"] == 2 and stats["reused"] == 3  # val redone, train kept
    assert json.loads(plan_file.read_text()) == plan
    man = io.read_manifest(out)
    assert man["resample"] == "bilinear-aa" and "reducing_gap" not in man


@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
def test_batches_are_dealt_evenly_over_splits(nranks: int) -> None:
    plans = {
        "train": batch.SplitPlan("train", 4, "drop", [[None]] * 9),
        "val": batch.SplitPlan("val", 4, "pad", [[None]] * 1),
    }
    shares = [batch._deal(plans, r, nranks) for r in range(nranks)]
    every = sorted(x for share in shares for x in share)
    assert every == sorted([("train", k) for k in range(9)] + [("val", 0)])
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"batch_size": 0}, "--batch-size must be a positive"),
        ({"layout": "01bc"}, "--layout"),
        ({"last": "keep"}, "--last"),
    ],
)
def test_bad_options(fx, prepped: Path, kw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        batch.run(prepped, **({"batch_size": fx.B, "size": fx.S} | kw), progress=False)


@pytest.mark.parametrize("threaded", [True, False])
def test_pipeline_never_writes_a_batch_after_a_failed_resize(
    threaded: bool, tmp_path: Path, monkeypatch
) -> None:
    """A task that fails on the worker thread: that batch and every later one stay unwritten."""
    rng = np.random.default_rng(0)
    items: list[tuple[str, int] | None] = []
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).save(
            tmp_path / f"{i}.jpg", quality=90
        )
        items.append((f"{i}.jpg", 0))
    shape = io.batch_shape("c01b", 4, 8)
    pipe = batch._Pipeline(4, 8, "c01b", batch._Writer(shape), threaded)
    journal = batch._Journal(tmp_path, 0)
    labels_ = np.zeros(4, np.int32)
    ok = pipe.submit([*items, None], tmp_path, tmp_path / "a.hkl", labels_, journal, 0)
    assert len(ok.result()) == 64 and (tmp_path / "a.hkl").exists()
    real, calls = pipe.resize.resize_into, []

    def flaky(src: np.ndarray, out: np.ndarray) -> np.ndarray:
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("boom")
        return real(src, out)

    monkeypatch.setattr(pipe.resize, "resize_into", flaky)
    jobs = []
    with pytest.raises((ValueError, RuntimeError)):  # in submit (buffer reuse) or the finish
        for name, k in (("b.hkl", 1), ("c.hkl", 2)):
            jobs.append(pipe.submit([*items, None], tmp_path, tmp_path / name, labels_, journal, k))
        jobs[0].result()
    for job in jobs:
        with pytest.raises(RuntimeError, match="an earlier task failed"):
            job.result()
    pipe.close()
    journal.close()
    assert not (tmp_path / "b.hkl").exists() and not (tmp_path / "c.hkl").exists()
    assert [ln.split()[0] for ln in (tmp_path / "digests-r0.txt").read_text().splitlines()] == ["0"]


def test_pipeline_batches_equal_one_thread(fx, tree, prepped: Path) -> None:
    """The pipelined batches hold exactly what load_image gives image by image."""
    root, _ = tree
    plans, scan, _ = batch.make_plans(prepped, fx.B)
    plan = plans["train"]
    for k, f in enumerate(io.batch_files(prepped, "train")):
        arr = io.load_batch(f)
        for j, it in enumerate(plan.items[k]):
            want = batch.load_image(Path(scan["src"]) / it[0], fx.S)
            np.testing.assert_array_equal(arr[..., j].transpose(1, 2, 0), want)
