"""Stage ``labels``: ``labels/train_labels.npy`` and ``labels/val_labels.npy``, int32, one per slot.

Aligned with the batch files: entry ``k * B + j`` is the class of image j of batch k; padded
slots are -1. Sub-batches of any divisor of B are slices of this array.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from prep._common import Comm, collective, get_comm, write_npy
from prep.batch import make_plans
from theanompi.errors import DataError
from theanompi.io.dataset import read_manifest

__all__ = ["run"]


def run(out: str | os.PathLike[str], comm: Comm | None = None) -> dict[str, np.ndarray]:
    """Write both label files (rank 0) from the batch plan in the manifest; returns them."""
    comm = get_comm(comm)
    out = Path(out)

    def work() -> dict[str, np.ndarray]:
        man = read_manifest(out)
        plans, _, _ = make_plans(out, man["batch_size"], man["train"]["last"], man["val"]["last"])
        result = {}
        for split, plan in plans.items():
            if plan.n_batches != man[split]["n_batches"]:
                raise DataError(
                    f"{split} plan no longer matches the manifest; rerun `tmpi prep batch`"
                )
            labels = plan.labels()
            write_npy(out / "labels" / f"{split}_labels.npy", labels)
            result[split] = labels
        return result

    return collective(comm, work)
