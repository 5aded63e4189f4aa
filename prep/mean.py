"""Stage ``mean``: the exact float32 mean image over every train image in the batches.

Each rank sums its batches in float64 (exact: sums of uint8 stay far below 2**53), the sums
are reduced to rank 0 with ``MPI.Reduce``, divided by the image count and stored as float32
(3, S, S), channel-first, in 0..255 units: ``misc/img_mean.npy``. Padded slots are excluded.
The result is bit-identical for any number of ranks.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from prep._common import (
    Comm,
    collective,
    get_comm,
    misc_dir,
    raise_collective,
    write_json,
    write_npy,
)
from theanompi.errors import UserError
from theanompi.io.dataset import MANIFEST, batch_files, load_batch, read_manifest

__all__ = ["batch_sum", "run"]


def batch_sum(arr: np.ndarray, layout: str, n_valid: int) -> np.ndarray:
    """float64 (3, S, S) sum of the first ``n_valid`` images of one batch array."""
    if layout == "c01b":
        return arr[..., :n_valid].sum(axis=3, dtype=np.float64)
    return arr[:n_valid].sum(axis=0, dtype=np.float64)


def run(out: str | os.PathLike[str], comm: Comm | None = None) -> np.ndarray:
    """Compute and write the mean image; returns it (float32 (3, S, S)) on every rank."""
    comm = get_comm(comm)
    out = Path(out)
    rank, nranks = comm.Get_rank(), comm.Get_size()
    man, files = collective(comm, lambda: (read_manifest(out), batch_files(out, "train")))
    b, s, layout = man["batch_size"], man["size"], man["layout"]
    n_images = man["train"]["n_images"]
    local = np.zeros((3, s, s), dtype=np.float64)
    for k in range(rank, len(files), nranks):
        n_valid = min(b, n_images - k * b)
        local += batch_sum(load_batch(files[k]), layout, n_valid)
    total = np.zeros_like(local) if rank == 0 else None
    if nranks > 1:
        from mpi4py import MPI

        comm.Reduce(local, total, op=MPI.SUM, root=0)
    else:
        total = local
    mean = None
    failure: UserError | None = None
    if rank == 0:
        mean = (total / n_images).astype(np.float32)

        def record() -> None:
            write_npy(misc_dir(out) / "img_mean.npy", mean)
            m: dict[str, Any] = read_manifest(out)
            m["mean"] = {"n_images": n_images, "checksum": m["checksum"]}
            write_json(out / MANIFEST, m)

        try:
            record()
        except UserError as err:  # e.g. a full disk: every rank raises it (one line)
            failure = err
    raise_collective(comm, failure)
    return comm.bcast(mean, root=0) if nranks > 1 else mean  # type: ignore[return-value]
