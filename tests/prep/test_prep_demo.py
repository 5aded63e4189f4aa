"""demo: scikit-learn's digits as an ImageNet-layout tree that scan reads back exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from prep import demo, scan


def test_demo_tree(tmp_path: Path) -> None:
    from sklearn.datasets import load_digits

    res = demo.write_demo(tmp_path, n_val=256, image_size=16)
    assert res == {"train": 1797 - 256, "val": 256, "classes": 10}
    tree = scan.run(tmp_path, tmp_path / "out")
    assert not tree["skipped"]
    assert [c for c in tree["classes"]] == [[demo.wnid(d), f"digit {d}"] for d in range(10)]
    target = load_digits().target
    for rel, label in tree["train"][:50]:
        assert int(rel.rsplit("_", 1)[1].split(".")[0]) in np.flatnonzero(target == label)
    counts = np.bincount([lab for _, lab in tree["val"]], minlength=10)
    assert counts.sum() == 256 and counts.min() >= 20  # stratified
    # deterministic bytes, so `make data` can rerun demo and the stages resume
    first = tmp_path / "val" / "ILSVRC2012_val_00000001.JPEG"
    again = tmp_path / "again.JPEG"
    demo._save_jpeg(load_digits().images[0].astype(np.uint8), again, 16)
    demo._save_jpeg(load_digits().images[0].astype(np.uint8), tmp_path / "again2.JPEG", 16)
    assert again.read_bytes() == (tmp_path / "again2.JPEG").read_bytes()
    assert first.stat().st_size > 0
