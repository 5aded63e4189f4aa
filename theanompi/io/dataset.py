"""The prep output format, shared by prep (writer) and training (reader): paths, manifest, batches,
labels, mean, synsets, and the batch digest.

The data folder holds ``train_hkl_b<B>/NNNN.hkl`` and ``val_hkl_b<B>/NNNN.hkl`` (one uint8
array each, layout ``c01b`` = (3, S, S, B) or ``bc01`` = (B, 3, S, S)), ``labels/<split>_labels.npy``
(int32, aligned with the batches, padded slots -1), ``misc/img_mean.npy`` (float32 (3, S, S)),
``misc/synsets.txt`` and ``misc/manifest.json``. See ``docs/prep.md``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from theanompi.errors import DataError

__all__ = [
    "batch_digest",
    "SPLITS",
    "LAYOUTS",
    "MANIFEST",
    "read_manifest",
    "batch_dir",
    "batch_name",
    "batch_files",
    "load_batch",
    "load_labels",
    "load_mean",
    "load_synsets",
    "batch_shape",
]

SPLITS = ("train", "val")
LAYOUTS = ("c01b", "bc01")
MANIFEST = Path("misc") / "manifest.json"

PathLike = str | os.PathLike[str]


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")


def read_manifest(out: PathLike) -> dict[str, Any]:
    """The manifest of the data folder ``out`` (``misc/manifest.json``) as a dict.

    Raises
    ------
    DataError
        When the folder has no manifest (prep has not run there).
    """
    path = Path(out) / MANIFEST
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(
            f"{path} not found; run `tmpi prep all --src IMAGES --out {out}` first"
        ) from None
    except json.JSONDecodeError as err:
        raise DataError(f"{path} is not valid JSON ({err}); rerun `tmpi prep batch`") from None


def batch_dir(out: PathLike, split: str, batch_size: int) -> Path:
    """``<out>/<split>_hkl_b<B>``."""
    _check_split(split)
    return Path(out) / f"{split}_hkl_b{batch_size}"


def batch_name(index: int, n_batches: int) -> str:
    """File name of batch ``index``: zero-padded to 4 digits (more when there are >= 10000)."""
    width = max(4, len(str(max(n_batches - 1, 0))))
    return f"{index:0{width}d}.hkl"


def batch_shape(layout: str, batch_size: int, size: int) -> tuple[int, int, int, int]:
    """Array shape of one batch file: c01b (3, S, S, B) or bc01 (B, 3, S, S)."""
    if layout == "c01b":
        return (3, size, size, batch_size)
    if layout == "bc01":
        return (batch_size, 3, size, size)
    raise ValueError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")


def batch_files(out: PathLike, split: str) -> list[Path]:
    """The batch files of ``split`` in batch order (as many as the manifest lists).

    Raises
    ------
    DataError
        When a file the manifest promises is missing.
    """
    man = read_manifest(out)
    info = man[split]
    folder = Path(out) / info.get("dir", batch_dir(out, split, int(man["batch_size"])).name)
    n = int(info["n_batches"])
    files = [folder / batch_name(i, n) for i in range(n)]
    missing = [f for f in files if not f.exists()]
    if missing:
        raise DataError(
            f"{len(missing)} of {n} {split} batch files missing (first {missing[0]}); "
            "rerun `tmpi prep batch`"
        )
    return files


def load_batch(path: PathLike) -> np.ndarray:
    """One batch file as a uint8 array (layout as in the manifest).

    Raises
    ------
    DataError
        When the file cannot be read or holds something other than a uint8 4-d array.
    """
    import hickle

    try:
        arr = hickle.load(str(path))
    except Exception as err:  # noqa: BLE001 - h5py/hickle raise many kinds
        raise DataError(f"cannot read batch {path}: {err}; rerun `tmpi prep batch`") from None
    if not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 or arr.ndim != 4:
        raise DataError(f"batch {path} is not a uint8 4-d array; rerun `tmpi prep batch`")
    return arr


def load_labels(out: PathLike, split: str) -> np.ndarray:
    """int32 labels of ``split``, (n_batches * B,), aligned with the batch files; padding is -1."""
    _check_split(split)
    path = Path(out) / "labels" / f"{split}_labels.npy"
    if not path.exists():
        raise DataError(f"{path} not found; run `tmpi prep labels --out {out}`")
    return np.load(path).astype(np.int32, copy=False)


def load_mean(out: PathLike) -> np.ndarray:
    """The float32 mean image (3, S, S), channel-first, in 0..255 units."""
    path = Path(out) / "misc" / "img_mean.npy"
    if not path.exists():
        raise DataError(f"{path} not found; run `tmpi prep mean --out {out}`")
    return np.load(path).astype(np.float32, copy=False)


def load_synsets(out: PathLike) -> list[tuple[str, str]]:
    """``[(wnid, name), ...]`` indexed by class label, from ``misc/synsets.txt``."""
    path = Path(out) / "misc" / "synsets.txt"
    if not path.exists():
        raise DataError(f"{path} not found; run `tmpi prep scan --out {out}`")
    rows: list[tuple[str, str]] = []
    for line in path.read_text().splitlines():
        parts = line.split(maxsplit=2)
        if len(parts) >= 2:
            rows.append((parts[1], parts[2] if len(parts) == 3 else parts[1]))
    return rows


def batch_digest(images: np.ndarray, labels: np.ndarray) -> str:
    """SHA-256 of one batch: the C-order uint8 bytes, then the labels as little-endian int32."""
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(images).data)
    h.update(np.asarray(labels, dtype="<i4").tobytes())
    return h.hexdigest()
