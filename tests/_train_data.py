"""A tiny dataset in the prep output format (docs/CONTRACTS.md), for the training tests.

Image ``i`` (global index over the split, in file order) has channel 0 filled
with ``i % 256`` and channel 1 with ``i // 256``, so a test can recover which
image a loaded sample is (the mean is written as zeros unless asked). Channel
2 carries the class: ``40 + 20 * label`` plus a little noise, so a linear model
can learn it.
"""

from __future__ import annotations

import json
from pathlib import Path

import hickle
import numpy as np

__all__ = ["write_dataset", "image_ids", "tiny_config", "job_args"]


def write_dataset(
    out: Path,
    *,
    n_train: int = 4,
    n_val: int = 2,
    B: int = 16,
    S: int = 10,
    layout: str = "c01b",
    n_classes: int = 4,
    val_pad: int = 5,
    zero_mean: bool = True,
    seed: int = 0,
) -> Path:
    """Write ``out/{train,val}_hkl_b{B}/NNNN.hkl``, labels, mean, manifest; return ``out``."""
    out = Path(out)
    rng = np.random.default_rng(seed)
    info = {}
    all_imgs = []
    for split, n_files in (("train", n_train), ("val", n_val)):
        d = out / f"{split}_hkl_b{B}"
        d.mkdir(parents=True, exist_ok=True)
        n = n_files * B
        labels = rng.integers(0, n_classes, n).astype(np.int32)
        if split == "val" and val_pad:
            labels[n - val_pad :] = -1
        imgs = np.zeros((n, 3, S, S), np.uint8)
        ids = np.arange(n)
        imgs[:, 0] = (ids % 256)[:, None, None]
        imgs[:, 1] = (ids // 256)[:, None, None]
        cls = np.maximum(labels, 0)
        imgs[:, 2] = np.clip(40 + 20 * cls[:, None, None] + rng.integers(-5, 6, (n, S, S)), 0, 255)
        if split == "train":
            all_imgs.append(imgs)
        for f in range(n_files):
            chunk = imgs[f * B : (f + 1) * B]
            arr = np.ascontiguousarray(chunk.transpose(1, 2, 3, 0) if layout == "c01b" else chunk)
            hickle.dump(arr, str(d / f"{f:04d}.hkl"), mode="w")
        (out / "labels").mkdir(parents=True, exist_ok=True)
        np.save(out / "labels" / f"{split}_labels.npy", labels)
        info[split] = {"dir": d.name, "n_batches": n_files, "n_images": int((labels >= 0).sum())}
    misc = out / "misc"
    misc.mkdir(parents=True, exist_ok=True)
    mean = np.zeros((3, S, S), np.float32)
    if not zero_mean:
        mean = np.concatenate(all_imgs).astype(np.float32).mean(axis=0)
    np.save(misc / "img_mean.npy", mean)
    (misc / "synsets.txt").write_text("".join(f"{k} n{k:08d} class{k}\n" for k in range(n_classes)))
    manifest = {
        "batch_size": B,
        "size": S,
        "layout": layout,
        "n_classes": n_classes,
        **info,
        "seed": seed,
        "skipped": [],
        "checksum": "test",
    }
    (misc / "manifest.json").write_text(json.dumps(manifest))
    return out


def image_ids(x: np.ndarray) -> np.ndarray:
    """Recover the image index of each sample of a loaded batch (zero mean)."""
    return (np.rint(x[:, 0, 0, 0]) + 256 * np.rint(x[:, 1, 0, 0])).astype(int)


def tiny_config(data: Path, run_dir: Path, **over: object):
    """A validated Config on the tiny dataset (model: tests/rules/model_fake.yaml, whose
    ``name: _fake_model.py:FakeModel`` the registry resolves beside the YAML)."""
    from theanompi.config import load_config

    man = json.loads((Path(data) / "misc" / "manifest.json").read_text())
    base = {
        "data.dir": str(data),
        "data.file_batch_size": man["batch_size"],
        "data.image_size": man["size"],
        "data.layout": man["layout"],
        "output.run_dir": str(run_dir),
        "training.print_freq": 2,
    }
    base.update(over)
    model = Path(__file__).parent / "rules" / "model_fake.yaml"
    return load_config(None, model, base)


def job_args(rest: list[str]) -> tuple[set[str], dict[str, object]]:
    """A per-rank test program's trailing arguments: ``--flags`` and ``section.key=value``
    overrides (values parsed as YAML), for :func:`tiny_config`."""
    import yaml

    flags = {a for a in rest if a.startswith("--")}
    over = {}
    for a in rest:
        if not a.startswith("--"):
            k, v = a.split("=", 1)
            over[k] = yaml.safe_load(v)
    return flags, over
