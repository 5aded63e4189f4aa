"""Eval with a hand-written model whose predictions are known (run under mpirun, any -n).

Also the helpers the eval tests share: :func:`write_dataset` writes a tiny prep-format
data folder (with padded val slots), :class:`HandModel` is a model written directly in
PyTensor, not derived from ``theanompi.models.base.Model``: logits are
``SCALE * x[:, 0, 0, :K] @ W`` (one row of the centre crop) with ``W`` a permutation matrix loaded from a
checkpoint, so the class ranking of every image is chosen by the test.

Usage: ``mpirun -n N python tests/train/mpi_eval_hand.py DATA CKPT MODEL_YAML OUT_JSON``
(OUT_JSON is written by rank 0 with the eval report).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

K, S, CROP, B, SUB_B = 10, 16, 12, 16, 8
N_IMAGES = 100  # 7 files of 16: 12 padded slots in the last one
MEAN = 10.0
STEP = 20.0  # pixel step between consecutive class scores
SCALE = 0.25  # logit = SCALE * (pixel - MEAN): neighbouring classes 5 apart in logit
OFF = (S - CROP) // 2
PERM = np.array([3, 7, 1, 9, 0, 5, 2, 8, 6, 4])  # W[j, PERM[j]] = 1


def true_params() -> list[np.ndarray]:
    W = np.zeros((K, K), np.float32)
    W[np.arange(K), PERM] = 1.0
    return [W, np.zeros(K, np.float32)]


def dataset_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    """Images (n, 3, S, S) uint8, labels (n,), ranks of the true label, reference logits."""
    rng = np.random.default_rng(seed)
    imgs = rng.integers(0, 256, size=(N_IMAGES, 3, S, S), dtype=np.uint8)
    order = np.stack([rng.permutation(K) for _ in range(N_IMAGES)])  # score level per column
    imgs[:, 0, OFF, OFF : OFF + K] = (MEAN + STEP * order).astype(np.uint8)
    # independent reference: logits from the stored pixels, in float64
    x0 = imgs[:, 0, OFF, OFF : OFF + K].astype(np.float64) - MEAN
    logits = SCALE * x0 @ true_params()[0].astype(np.float64)
    ranks = np.arange(N_IMAGES) % 7  # where the true label sits in each image's ranking
    labels = np.argsort(-logits, axis=1)[np.arange(N_IMAGES), ranks].astype(np.int32)
    return {"images": imgs, "labels": labels, "ranks": ranks, "logits": logits}


def write_dataset(
    root: Path, layout: str = "c01b", val_label_extra: int = 0
) -> dict[str, np.ndarray]:
    """Write a prep-format folder at ``root`` (val = the hand dataset, train = a copy).

    ``val_label_extra`` appends that many labels to val_labels.npy (to test the count check).
    """
    import hickle

    arrs = dataset_arrays()
    imgs, labels = arrs["images"], arrs["labels"]
    n_files = -(-N_IMAGES // B)
    pad = n_files * B - N_IMAGES
    imgs_p = np.concatenate([imgs, np.zeros((pad, 3, S, S), np.uint8)])
    labels_p = np.concatenate([labels, -np.ones(pad, np.int32)])
    root = Path(root)
    for split in ("train", "val"):
        d = root / f"{split}_hkl_b{B}"
        d.mkdir(parents=True, exist_ok=True)
        for f in range(n_files):
            batch = imgs_p[f * B : (f + 1) * B]
            if layout == "c01b":
                batch = np.ascontiguousarray(batch.transpose(1, 2, 3, 0))
            hickle.dump(batch, str(d / f"{f:04d}.hkl"))
    (root / "labels").mkdir(exist_ok=True)
    (root / "misc").mkdir(exist_ok=True)
    np.save(
        root / "labels" / "train_labels.npy", np.where(labels_p < 0, 0, labels_p).astype(np.int32)
    )
    val = np.concatenate([labels_p, np.zeros(val_label_extra, np.int32)])
    np.save(root / "labels" / "val_labels.npy", val.astype(np.int32))
    np.save(root / "misc" / "img_mean.npy", np.full((3, S, S), MEAN, np.float32))
    (root / "misc" / "synsets.txt").write_text(
        "".join(f"{i} n{i:08d} class{i}\n" for i in range(K))
    )
    split_info = {"n_batches": n_files, "n_images": N_IMAGES, "n_padded": pad}
    manifest = {
        "batch_size": B,
        "size": S,
        "layout": layout,
        "n_classes": K,
        "train": {"dir": f"train_hkl_b{B}", **split_info},
        "val": {"dir": f"val_hkl_b{B}", **split_info},
        "seed": 0,
        "skipped": [],
        "checksum": "test",
    }
    (root / "misc" / "manifest.json").write_text(json.dumps(manifest))
    return arrs


def model_yaml(path: Path, name: str = "mlp", **extra: Any) -> Path:
    """A model YAML matching the hand dataset (crop CROP, K classes, sub-batch SUB_B)."""
    import yaml

    body = {
        "name": name,
        "input_size": CROP,
        "channels": 3,
        "n_classes": K,
        "batch_size": SUB_B,
        **extra,
    }
    path.write_text(yaml.safe_dump(body))
    return path


def config(data: Path, run_dir: Path, yaml_path: Path, layout: str = "c01b") -> Any:
    from theanompi.config import load_config

    return load_config(
        None,
        yaml_path,
        {
            "data.dir": str(data),
            "data.file_batch_size": B,
            "data.image_size": S,
            "data.layout": layout,
            "output.run_dir": str(run_dir),
        },
    )


class HandModel:
    """A model written by hand in PyTensor: ``softmax(SCALE * x[:, 0, 0, :K] @ W + b)``.

    Implements just what eval needs of the Model protocol: ``params`` (shared variables),
    ``opt_state``, ``input_shape``, ``n_classes``, ``build``, ``predict``.
    """

    def __init__(self) -> None:
        import pytensor

        self.n_classes = K
        self.input_shape = (3, CROP, CROP)
        self.W = pytensor.shared(np.zeros((K, K), np.float32), name="perm.W")
        self.b = pytensor.shared(np.zeros(K, np.float32), name="perm.b")
        self.params = [self.W, self.b]
        self.opt_state: list[Any] = []
        self._predict = None

    def build(self, batch_size: int | None = None, backend: str = "c") -> HandModel:
        import pytensor
        import pytensor.tensor as pt
        from pytensor.tensor.special import softmax

        x = pt.tensor4("x", dtype="float32")
        row = x[:, 0, 0, :K]  # the crop starts at OFF, so this is the stored row OFF
        logits = np.float32(SCALE) * pt.dot(row, self.W) + self.b
        self._predict = pytensor.function([x], softmax(logits, axis=-1))
        return self

    def predict(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(self._predict(np.asarray(x, np.float32)))


def main(argv: list[str]) -> int:
    from theanompi.pytensor_env import configure

    configure()
    from mpi4py import MPI

    from theanompi.train.evaluate import run

    data, ckpt, yaml_path, out = (Path(a) for a in argv)
    layout = json.loads((data / "misc" / "manifest.json").read_text())["layout"]
    cfg = config(data, ckpt.parent.parent, yaml_path, layout)
    report = run(cfg, checkpoint=ckpt, per_class=True, save_predictions=True, model=HandModel())
    if MPI.COMM_WORLD.Get_rank() == 0:
        out.write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
