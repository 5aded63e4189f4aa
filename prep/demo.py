"""``tmpi prep demo``: a small real dataset in ImageNet layout, from scikit-learn's digits.

The 1,797 digit scans (8 x 8, 17 grey levels, 10 classes) are upscaled, saved as RGB JPEG
files and split into train and val (stratified, ``n_val`` images, 256 by default)::

    OUT/train/n0000000<d>/n0000000<d>_<i>.JPEG     d = digit, i = index in sklearn's set
    OUT/val/ILSVRC2012_val_<k>.JPEG                 k = 1, 2, ... (8 digits)
    OUT/val_ground_truth.txt                        1-based class per line, sorted file order
    OUT/synset_words.txt                            "n0000000<d> digit <d>"

The output is deterministic (same bytes on every run), so ``make data`` can rerun it and
the later prep stages resume instead of redoing the work.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from prep._common import atomic_write
from theanompi.errors import ConfigError

__all__ = ["wnid", "write_demo"]


def wnid(digit: int) -> str:
    """The stable fake wnid of a digit class.

    >>> wnid(7)
    'n00000007'
    """
    return f"n{digit:08d}"


def _save_jpeg(arr: np.ndarray, path: Path, image_size: int) -> None:
    from PIL import Image

    im = Image.fromarray(arr).resize((image_size, image_size), Image.Resampling.BICUBIC)
    im = im.convert("RGB")
    with atomic_write(path) as tmp:
        im.save(tmp, format="JPEG", quality=95)


def write_demo(
    out: str | os.PathLike[str], n_val: int = 256, image_size: int = 64, seed: int = 0
) -> dict[str, Any]:
    """Write the digits tree under ``out``; returns ``{"train": n, "val": n, "classes": 10}``.

    Parameters
    ----------
    out
        Folder to create (existing files of the same names are replaced).
    n_val
        Images held out for val (stratified by class).
    image_size
        Side of the saved JPEGs (the 8 x 8 scans are upscaled bicubically).
    seed
        Seed of the train/val split.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    n = len(digits.target)
    if not 10 <= n_val <= n - 10:
        raise ConfigError(f"--n-val must be between 10 and {n - 10}, got {n_val}")
    if image_size < 8:
        raise ConfigError(f"--image-size must be at least 8, got {image_size}")
    images = np.clip(np.rint(digits.images * (255.0 / 16.0)), 0, 255).astype(np.uint8)
    idx = np.arange(n)
    train_idx, val_idx = train_test_split(
        idx, test_size=n_val, stratify=digits.target, random_state=seed
    )
    out = Path(out)
    for i in sorted(train_idx.tolist()):
        d = int(digits.target[i])
        _save_jpeg(images[i], out / "train" / wnid(d) / f"{wnid(d)}_{i}.JPEG", image_size)
    gt = []
    for k, i in enumerate(sorted(val_idx.tolist()), 1):
        _save_jpeg(images[i], out / "val" / f"ILSVRC2012_val_{k:08d}.JPEG", image_size)
        gt.append(int(digits.target[i]) + 1)
    with atomic_write(out / "val_ground_truth.txt") as tmp:
        tmp.write_text("".join(f"{g}\n" for g in gt))
    with atomic_write(out / "synset_words.txt") as tmp:
        tmp.write_text("".join(f"{wnid(d)} digit {d}\n" for d in range(10)))
    return {"train": len(train_idx), "val": len(val_idx), "classes": 10}
