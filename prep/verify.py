"""Stage ``verify``: re-read every batch (over the ranks) and check shape, dtype, labels, checksum.

Each batch's SHA-256 (image bytes, then its labels from ``labels/<split>_labels.npy``) must equal
the digest recorded by ``batch`` in the manifest, and the digests must give the manifest's
``checksum``. The label files must have one entry per slot, -1 exactly in the padded slots,
and the mean image the right shape. On success the manifest gets ``"verified": <checksum>``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from prep._common import (
    Comm,
    collective,
    combined_checksum,
    get_comm,
    raise_collective,
    write_json,
)
from theanompi.errors import DataError, UserError
from theanompi.io.dataset import (
    MANIFEST,
    batch_digest,
    batch_files,
    batch_shape,
    load_batch,
    load_labels,
    load_mean,
    read_manifest,
)

__all__ = ["run"]


def _static_checks(
    out: Path,
) -> tuple[dict[str, Any], dict[str, list[Path]], dict[str, np.ndarray]]:
    man = read_manifest(out)
    b = man["batch_size"]
    files = {s: batch_files(out, s) for s in ("train", "val")}
    labels = {s: load_labels(out, s) for s in ("train", "val")}
    for s in ("train", "val"):
        info = man[s]
        n = info["n_batches"]
        if labels[s].shape != (n * b,):
            raise DataError(
                f"{s} labels have shape {labels[s].shape}, expected ({n * b},); rerun `tmpi prep labels`"
            )
        pad = labels[s] < 0
        if int(pad.sum()) != info["n_padded"] or (
            info["n_padded"] and not pad[-info["n_padded"] :].all()
        ):
            raise DataError(
                f"{s} labels: -1 entries do not match the {info['n_padded']} padded slots"
            )
        if labels[s].max() >= man["n_classes"]:
            raise DataError(f"{s} labels exceed n_classes={man['n_classes']}")
    if combined_checksum({s: man[s]["digests"] for s in ("train", "val")}) != man["checksum"]:
        raise DataError(
            "manifest checksum does not match its batch digests; rerun `tmpi prep batch`"
        )
    if man.get("mean", {}).get("checksum") != man["checksum"]:
        raise DataError("img_mean.npy was not computed from these batches; rerun `tmpi prep mean`")
    mean = load_mean(out)
    if mean.shape != (3, man["size"], man["size"]):
        raise DataError(
            f"img_mean.npy has shape {mean.shape}, expected (3, {man['size']}, {man['size']})"
        )
    return man, files, labels


def run(out: str | os.PathLike[str], comm: Comm | None = None) -> dict[str, Any]:
    """Verify the data folder ``out``; raises ``DataError`` listing the bad batches.

    Returns
    -------
    dict
        ``{"batches": n_checked, "checksum": str}``.
    """
    comm = get_comm(comm)
    out = Path(out)
    rank, nranks = comm.Get_rank(), comm.Get_size()
    man, files, labels = collective(comm, lambda: _static_checks(out))
    b = man["batch_size"]
    shape = batch_shape(man["layout"], b, man["size"])
    jobs = [(s, k) for s in ("train", "val") for k in range(len(files[s]))]
    bad: list[str] = []
    for s, k in jobs[rank::nranks]:
        try:
            arr = load_batch(files[s][k])
        except UserError as err:
            bad.append(str(err))
            continue
        if arr.shape != shape:
            bad.append(f"{files[s][k]}: shape {arr.shape}, expected {shape}")
        elif batch_digest(arr, labels[s][k * b : (k + 1) * b]) != man[s]["digests"][k]:
            bad.append(f"{files[s][k]}: content or labels differ from the manifest digest")
    found = comm.gather(bad, root=0) if nranks > 1 else [bad]
    message = None
    if rank == 0:
        problems = [p for part in found for p in part]
        if problems:
            message = f"verify: {len(problems)} of {len(jobs)} batches bad (first: {problems[0]}); rerun `tmpi prep batch`"
        else:
            m = read_manifest(out)
            m["verified"] = m["checksum"]
            try:
                write_json(out / MANIFEST, m)
            except UserError as err:  # e.g. a full disk: every rank raises it (one line)
                message = str(err)
    raise_collective(comm, message)
    return {"batches": len(jobs), "checksum": man["checksum"]}
