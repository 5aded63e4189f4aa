"""scan: classes, labels, ground-truth formats, skipped files and the clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from prep import scan
from theanompi.errors import DataError


@pytest.mark.parametrize("gt", ["positional1", "positional0", "named", "wnid", "folders"])
def test_ground_truth_formats(fx, tmp_path: Path, gt: str) -> None:
    expect = fx.make_tree(tmp_path / "src", gt)
    res = scan.run(tmp_path / "src", tmp_path / "out")
    assert [c[0] for c in res["classes"]] == fx.WNIDS
    assert sorted(map(tuple, res["val"])) == expect["val"]
    assert len(res["train"]) == expect["n_train"]
    assert {s["path"] for s in res["skipped"]} == expect["skipped"]
    assert all(s["reason"] for s in res["skipped"])


def test_train_labels_follow_folders(fx, tree) -> None:
    root, _ = tree
    res = scan.list_tree(root)
    for rel, label in res["train"]:
        assert rel.split("/")[1] == fx.WNIDS[label]
    assert not any(".DS_Store" in rel for rel, _ in res["train"])


def test_synsets_file(fx, tree, tmp_path: Path) -> None:
    scan.run(tree[0], tmp_path)
    lines = (tmp_path / "misc" / "synsets.txt").read_text().splitlines()
    assert lines == [f"{i} {w} thing {i}, object {i}" for i, w in enumerate(fx.WNIDS)]


def test_check_image(fx, tree) -> None:
    root, _ = tree
    assert scan.check_image(root / "train" / fx.WNIDS[0] / f"{fx.WNIDS[0]}_0.JPEG") is None
    assert "truncated" in scan.check_image(root / "train" / fx.WNIDS[2] / f"{fx.WNIDS[2]}_9.JPEG")


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such folder"):
        scan.list_tree(tmp_path / "nowhere")
    (tmp_path / "train" / "n1").mkdir(parents=True)
    with pytest.raises(DataError, match="missing folder .*val"):
        scan.list_tree(tmp_path)


def test_empty_class_folder(fx, tmp_path: Path) -> None:
    fx.make_tree(tmp_path)
    (tmp_path / "train" / "n01000009").mkdir()
    with pytest.raises(DataError, match="empty class folder .*n01000009"):
        scan.list_tree(tmp_path)


def test_ground_truth_count_mismatch(fx, tmp_path: Path) -> None:
    fx.make_tree(tmp_path)
    gt = tmp_path / "val_ground_truth.txt"
    gt.write_text("\n".join(gt.read_text().split()[:-1]) + "\n")
    with pytest.raises(DataError, match="has 5 labels but val/ has 6 images"):
        scan.list_tree(tmp_path)


def test_ground_truth_unknown_wnid_and_range(fx, tmp_path: Path) -> None:
    fx.make_tree(tmp_path, "wnid")
    gt = tmp_path / "val_ground_truth.txt"
    gt.write_text(gt.read_text().replace(fx.WNIDS[0], "n07777777"))
    with pytest.raises(DataError, match="n07777777"):
        scan.list_tree(tmp_path)
    gt.write_text("1\n2\n3\n4\n5\n9\n")
    with pytest.raises(DataError, match="out of range"):
        scan.list_tree(tmp_path)


def test_devkit_meta_mat_maps_ilsvrc_ids(fx, tmp_path: Path) -> None:
    """Beside a devkit meta.mat, integer labels are ILSVRC2012_IDs, not sorted-wnid ranks."""
    import numpy as np
    from scipy.io import savemat

    fx.make_tree(tmp_path, "positional1")
    ids = {1: fx.WNIDS[2], 2: fx.WNIDS[0], 3: fx.WNIDS[1]}  # ILSVRC2012_ID -> wnid, not sorted
    syn = np.zeros((3,), dtype=[("ILSVRC2012_ID", "O"), ("WNID", "O")])
    for i, (k, w) in enumerate(ids.items()):
        syn[i] = (k, w)
    savemat(tmp_path / "meta.mat", {"synsets": syn})
    gt = [int(x) for x in (tmp_path / "val_ground_truth.txt").read_text().split()]
    res = scan.list_tree(tmp_path)
    assert [lab for _, lab in res["val"]] == [fx.WNIDS.index(ids[g]) for g in gt]
    assert "meta.mat" in res["val_labels_from"]


def test_bad_names_and_links_are_skipped_and_listed(fx, tmp_path: Path) -> None:
    """Symlink loop, broken link, non-UTF-8 and line-break names: skipped, listed, no traceback."""
    import json

    from prep import shuffle

    bad = fx.make_bad_tree(tmp_path / "src")
    res = scan.run(tmp_path / "src", tmp_path / "out")
    got = {s["path"]: s["reason"] for s in res["skipped"]}
    for path, word in bad.items():
        assert word in got.pop(path), (path, got)
    assert set(got) == {
        f"train/{fx.WNIDS[2]}/{fx.WNIDS[2]}_9.JPEG",
        f"val/{fx.WNIDS[1]}/ILSVRC2012_val_00000004.JPEG",
    }
    assert len(res["train"]) == 14 and len(res["val"]) == 5
    text = (tmp_path / "out" / "misc" / "scan.json").read_text(encoding="utf-8")
    assert json.loads(text)["skipped"] == res["skipped"]
    assert shuffle.run(tmp_path / "out", seed=3) == 14
    order, _ = shuffle.read_order(tmp_path / "out")  # the list matches the scan: one name a line
    assert sorted(rel for rel, _ in order) == sorted(rel for rel, _ in res["train"])


def test_named_ground_truth_needs_no_line_for_a_skipped_file(fx, tmp_path: Path) -> None:
    fx.make_tree(tmp_path, "named")
    (tmp_path / "val" / "loop.JPEG").symlink_to("loop.JPEG")
    res = scan.list_tree(tmp_path)
    assert [s["path"] for s in res["skipped"]] == ["val/loop.JPEG"]
    assert len(res["val"]) == 6  # list_tree only lists; run() drops the undecodable one


def test_bad_class_folder_is_one_error(fx, tmp_path: Path) -> None:
    fx.make_tree(tmp_path)
    (tmp_path / "train" / "n0\n1").mkdir()
    with pytest.raises(DataError, match=r"n0\\n1: folder name contains a line break"):
        scan.list_tree(tmp_path)
    (tmp_path / "train" / "n0\n1").rmdir()
    (tmp_path / "train" / "loop").symlink_to("loop")
    with pytest.raises(DataError, match="symlink loop"):
        scan.list_tree(tmp_path)


def test_files_larger_than_the_read_buffer_are_read_by_path(fx, tmp_path: Path, monkeypatch):
    """With a 400-byte buffer most files take the by-path check: the verdicts do not change."""
    fx.make_tree(tmp_path / "src")
    ref = scan.run(tmp_path / "src", tmp_path / "a")
    sizes = [p.stat().st_size for p in (tmp_path / "src").rglob("*.JPEG")]
    assert min(sizes) < 400 < max(sizes)
    monkeypatch.setattr(scan, "_READ_BUFFER", 400)
    assert scan.run(tmp_path / "src", tmp_path / "b") == ref
