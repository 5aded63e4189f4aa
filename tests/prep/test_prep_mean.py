"""mean: equals numpy's mean over every train image in the batches (independently decoded)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from theanompi.io import dataset as io


def test_mean_matches_numpy(fx, tree, prepped: Path) -> None:
    root, _ = tree
    man = io.read_manifest(prepped)
    order = (prepped / "misc" / "shuffled_train_filenames.txt").read_text().splitlines()
    used = order[: man["train"]["n_images"]]
    assert len(used) == man["train"]["n_batches"] * fx.B
    stack = np.stack([fx.float_reference(root / p) for p in used]).astype(np.float64)
    want = stack.mean(axis=0).transpose(2, 0, 1).astype(np.float32)
    got = io.load_mean(prepped)
    assert got.dtype == np.float32 and got.shape == (3, fx.S, fx.S)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    pillow = np.stack([fx.reference_decode(root / p) for p in used]).astype(np.float64)
    assert np.abs(got - pillow.mean(axis=0).transpose(2, 0, 1)).max() <= 1.0  # images within 1
    assert man["mean"]["n_images"] == len(used)
