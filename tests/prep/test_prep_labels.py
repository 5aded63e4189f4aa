"""labels: aligned with the batches, equal to the folder names / ground truth, -1 padding."""

from __future__ import annotations

from pathlib import Path

from theanompi.io import dataset as io


def test_train_labels_match_folder_names(fx, prepped: Path) -> None:
    lab = io.load_labels(prepped, "train")
    synsets = io.load_synsets(prepped)
    order = (prepped / "misc" / "shuffled_train_filenames.txt").read_text().splitlines()
    assert (
        lab.dtype.name == "int32"
        and len(lab) == io.read_manifest(prepped)["train"]["n_batches"] * fx.B
    )
    for rel, label in zip(order, lab, strict=False):
        assert rel.split("/")[1] == synsets[label][0]
    assert synsets[0][1] == "thing 0, object 0"


def test_val_labels_match_ground_truth(tree, prepped: Path) -> None:
    _, expect = tree
    lab = io.load_labels(prepped, "val")
    assert lab.tolist() == [lab_ for _, lab_ in expect["val"]] + [-1, -1, -1]
