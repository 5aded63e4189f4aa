"""Stage ``batch``: decode, resize and write the shuffled images as uint8 hickle batches, MPI-parallel.

Each image is decoded with Pillow (:mod:`prep.decode`), using JPEG DCT scaling
(``Image.draft``) to the smallest scale that still leaves both sides >= S, turned upright by
its EXIF orientation, converted to RGB (grayscale, CMYK, palette and PNG-in-a-.JPEG files
alike), and its centred square is resampled to S x S with Pillow's antialiased bilinear
filter (:mod:`prep.resize`, numba) — shorter side to S, then centre crop. The train batches
and then the val batches are dealt round-robin over the ranks as one sequence (rank r of N
writes batches r, r+N, ... of it). Files are written atomically; a batch file that is
already there, readable and of the right shape is kept (resume). Because ``scan`` removed
undecodable files, batch k holds the same images for any N, and the files are byte-identical.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from prep._common import (
    Comm,
    Progress,
    batch_digest,
    collective,
    combined_checksum,
    get_comm,
    misc_dir,
    read_json,
    wtime,
)
from prep.decode import Scratch, decode
from prep.io import LAYOUTS, MANIFEST, batch_dir, batch_name, batch_shape
from prep.scan import read_scan
from prep.shuffle import read_order
from theanompi.errors import ConfigError, DataError
from theanompi.io import atomic_write, write_json

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_SIZE",
    "LAST_POLICIES",
    "RESAMPLE",
    "SplitPlan",
    "load_image",
    "new_batch",
    "put_image",
    "to_layout",
    "make_plans",
    "validate_options",
    "run",
]

DEFAULT_BATCH_SIZE = 128
DEFAULT_SIZE = 256
LAST_POLICIES = ("drop", "pad")
# Pillow's BILINEAR-with-box filter, evaluated in float64 by prep.resize (was "bilinear":
# Pillow itself, with reducing_gap=2.0); part of the plan fingerprint, so older batches are redone
RESAMPLE = "bilinear-aa"


def load_image(path: str | os.PathLike[str], size: int) -> np.ndarray:
    """Decode ``path`` into an upright RGB (S, S, 3) uint8 array: shorter side S, centre crop.

    Parameters
    ----------
    path
        Image file (JPEG, or anything Pillow reads).
    size
        Output side S.

    Returns
    -------
    numpy.ndarray
        (S, S, 3) uint8, C-contiguous.
    """
    from prep.resize import resize_into  # numba: imported when needed (0.3 s)

    out = resize_into(decode(path, size), np.empty((3, size, size), dtype=np.uint8))
    return np.ascontiguousarray(out.transpose(1, 2, 0))


def new_batch(layout: str, batch_size: int, size: int) -> np.ndarray:
    """A zeroed uint8 batch array in the file layout (padded slots stay zero)."""
    return np.zeros(batch_shape(layout, batch_size, size), dtype=np.uint8)


def put_image(batch: np.ndarray, layout: str, j: int, image: np.ndarray) -> None:
    """Write one (S, S, 3) image into slot ``j`` of a batch array, in place.

    Writing each image straight into its slot costs a third of building a (B, S, S, 3)
    stack and transposing it to c01b afterwards (that transpose walks memory B-strided).
    """
    chw = image.transpose(2, 0, 1)
    if layout == "c01b":
        batch[..., j] = chw
    else:
        batch[j] = chw


def to_layout(images: np.ndarray, layout: str) -> np.ndarray:
    """(B, S, S, 3) uint8 -> the file layout: ``c01b`` (3, S, S, B) or ``bc01`` (B, 3, S, S)."""
    if layout not in LAYOUTS:
        raise ConfigError(f"--layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    out = new_batch(layout, images.shape[0], images.shape[1])
    for j, image in enumerate(images):
        put_image(out, layout, j, image)
    return out


@dataclass
class SplitPlan:
    """What goes into each batch file of one split.

    ``items[k]`` lists the ``(relpath, label)`` of batch k; padded slots are ``None``.
    """

    split: str
    batch_size: int
    last: str
    items: list[list[tuple[str, int] | None]] = field(default_factory=list)
    n_images: int = 0
    n_padded: int = 0
    n_dropped: int = 0

    @property
    def n_batches(self) -> int:
        return len(self.items)

    def labels(self) -> np.ndarray:
        """int32 labels of every slot, (n_batches * B,), padding -1."""
        flat = [(-1 if it is None else it[1]) for b in self.items for it in b]
        return np.asarray(flat, dtype=np.int32)

    def batch_labels(self, k: int) -> np.ndarray:
        return np.asarray([-1 if it is None else it[1] for it in self.items[k]], dtype=np.int32)


def validate_options(batch_size: int, size: int, layout: str, last: str, val_last: str) -> None:
    """ConfigError for a bad flag value (before any work starts)."""
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be a positive integer, got {batch_size}")
    if size < 1:
        raise ConfigError(f"--size must be a positive integer, got {size}")
    if layout not in LAYOUTS:
        raise ConfigError(f"--layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    for flag, value in (("--last", last), ("--val-last", val_last)):
        if value not in LAST_POLICIES:
            raise ConfigError(f"{flag} must be drop or pad, got {value!r}")


def _split_plan(split: str, files: list[list[Any]], batch_size: int, last: str) -> SplitPlan:
    n = len(files)
    full, rem = divmod(n, batch_size)
    plan = SplitPlan(split, batch_size, last)
    rows = [(str(rel), int(lab)) for rel, lab in files]
    plan.items = [list(rows[k * batch_size : (k + 1) * batch_size]) for k in range(full)]
    if rem and last == "pad":
        plan.items.append(list(rows[full * batch_size :]) + [None] * (batch_size - rem))
        plan.n_padded = batch_size - rem
    elif rem:
        plan.n_dropped = rem
    plan.n_images = n - plan.n_dropped
    if not plan.items:
        raise DataError(
            f"{split} has {n} images, fewer than one batch of {batch_size}; "
            f"lower --batch-size or use --{'val-' if split == 'val' else ''}last pad"
        )
    return plan


def make_plans(
    out: str | os.PathLike[str], batch_size: int, last: str = "drop", val_last: str = "pad"
) -> tuple[dict[str, SplitPlan], dict[str, Any], int]:
    """Batch plans of train (shuffled order) and val (sorted order), the scan and the seed."""
    scan = read_scan(out)
    train, seed = read_order(out, scan)
    plans = {
        "train": _split_plan("train", train, batch_size, last),
        "val": _split_plan("val", scan["val"], batch_size, val_last),
    }
    return plans, scan, seed


def _fingerprint(plan: SplitPlan, size: int, layout: str) -> dict[str, Any]:
    import hashlib

    h = hashlib.sha256()
    for b in plan.items:
        for it in b:
            h.update(b"-\n" if it is None else f"{it[0]}\t{it[1]}\n".encode())
    return {
        "split": plan.split,
        "batch_size": plan.batch_size,
        "size": size,
        "layout": layout,
        "resample": RESAMPLE,
        "n_batches": plan.n_batches,
        "items_sha256": h.hexdigest(),
    }


def _prepare_dir(folder: Path, fp: dict[str, Any]) -> None:
    """Rank 0: drop stale batches (another plan) and stray temp files, then record the plan."""
    folder.mkdir(parents=True, exist_ok=True)
    plan_file = folder / "plan.json"
    old = read_json(plan_file) if plan_file.exists() else None
    for p in folder.iterdir():
        if p.name.startswith(".") and ".tmp" in p.name:
            p.unlink(missing_ok=True)
        elif p.suffix == ".hkl" and old != fp:
            p.unlink(missing_ok=True)
    if old != fp:
        write_json(plan_file, fp)


def _existing(path: Path, shape: tuple[int, ...]) -> np.ndarray | None:
    """The array in ``path`` when it is a complete batch of ``shape``, else None."""
    if not path.exists():
        return None
    import hickle

    try:
        arr = hickle.load(str(path))
    except Exception:  # noqa: BLE001 - unreadable: redo it
        return None
    if isinstance(arr, np.ndarray) and arr.dtype == np.uint8 and arr.shape == shape:
        return arr
    return None


def _write_batch(path: Path, arr: np.ndarray) -> None:
    import hickle

    with atomic_write(path) as tmp:
        hickle.dump(arr, str(tmp), mode="w")


class _Filler:
    """Decodes batches into arrays reused from batch to batch (no fresh 12 MB per batch).

    c01b puts the image index innermost, so one image written alone would touch every cache
    line of the batch: images are resized into a (B, 3, S, S) stage, one contiguous
    (3, S, S) each, and the stage is transposed into the batch at the end, in 8x8-byte blocks
    (``prep.resize.transpose_into``). bc01 slots are contiguous: no stage.
    """

    def __init__(self, batch_size: int, size: int, layout: str) -> None:
        from prep import resize  # numba: imported when needed (0.3 s)

        self.resize = resize
        self.scratch = Scratch()
        self.layout = layout
        self.buf = new_batch(layout, batch_size, size)
        self.stage = self.buf if layout == "bc01" else new_batch("bc01", batch_size, size)

    def fill(self, items: list[tuple[str, int] | None], root: Path) -> np.ndarray:
        """Batch ``items`` in the file layout; padded slots zero. Valid until the next call."""
        size = self.stage.shape[-1]
        for j, it in enumerate(items):
            if it is None:
                self.stage[j] = 0
                continue
            try:
                self.resize.resize_into(decode(root / it[0], size, self.scratch), self.stage[j])
            except Exception as err:  # noqa: BLE001 - scan passed it, so this is unexpected
                raise DataError(
                    f"cannot decode {root / it[0]} ({type(err).__name__}: {err}) although scan "
                    "passed it; rerun `tmpi prep scan`"
                ) from None
        if self.layout == "c01b":
            self.resize.transpose_into(self.stage, self.buf)
        return self.buf


def _deal(plans: dict[str, SplitPlan], rank: int, nranks: int) -> list[tuple[str, int]]:
    """This rank's ``(split, k)``: all batches, train then val, dealt round-robin as one list.

    Dealing the splits one after the other would give rank 0 the first batch of each split
    (with 9 + 1 batches on 2 ranks: 6 and 4, a 1.2x longer critical path).
    """
    every = [(split, k) for split, plan in plans.items() for k in range(plan.n_batches)]
    return every[rank::nranks]


def run(
    out: str | os.PathLike[str],
    batch_size: int = DEFAULT_BATCH_SIZE,
    size: int = DEFAULT_SIZE,
    layout: str = "c01b",
    last: str = "drop",
    val_last: str = "pad",
    comm: Comm | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Write every train and val batch (this rank's share) and, on rank 0, the manifest.

    Returns
    -------
    dict
        On every rank: ``{"seconds", "images", "written", "reused", "images_per_s",
        "cpu_seconds"}`` summed over ranks; ``seconds`` is ``MPI.Wtime`` between barriers
        around the whole stage, ``cpu_seconds`` the ranks' process CPU time in it.
    """
    validate_options(batch_size, size, layout, last, val_last)
    comm = get_comm(comm)
    out = Path(out)
    rank, nranks = comm.Get_rank(), comm.Get_size()
    plans, scan, seed = collective(comm, lambda: make_plans(out, batch_size, last, val_last))
    root = Path(scan["src"])
    shape = batch_shape(layout, batch_size, size)

    def prepare() -> None:
        for split, plan in plans.items():
            _prepare_dir(batch_dir(out, split, batch_size), _fingerprint(plan, size, layout))

    collective(comm, prepare)
    filler = _Filler(batch_size, size, layout)
    filler.resize.warm_up()  # load the compiled kernels (first run: compile) before the clock
    comm.Barrier()
    t0, c0 = wtime(), time.process_time()
    total = sum(p.n_batches * batch_size for p in plans.values())
    bar = Progress("prep batch", total, comm) if progress else None
    digests: dict[str, dict[int, str]] = {split: {} for split in plans}
    written = reused = images = 0
    for split, k in _deal(plans, rank, nranks):
        plan = plans[split]
        path = batch_dir(out, split, batch_size) / batch_name(k, plan.n_batches)
        labels = plan.batch_labels(k)
        arr = _existing(path, shape)
        if arr is None:
            arr = filler.fill(plan.items[k], root)
            _write_batch(path, arr)
            written += 1
            images += int((labels >= 0).sum())
        else:
            reused += 1
        digests[split][k] = batch_digest(arr, labels)
        if bar:
            bar.update(batch_size)
    if bar:
        bar.close()
    cpu = time.process_time() - c0
    comm.Barrier()
    seconds = wtime() - t0
    mine = (digests, written, reused, images, cpu)
    parts = comm.gather(mine, root=0) if nranks > 1 else [mine]
    stats: dict[str, Any] | None = None
    if rank == 0:
        merged = {s: {} for s in plans}
        for d, *_ in parts:
            for s in d:
                merged[s].update(d[s])
        ordered = {s: [merged[s][k] for k in range(plans[s].n_batches)] for s in plans}
        stats = {
            "seconds": seconds,
            "written": sum(p[1] for p in parts),
            "reused": sum(p[2] for p in parts),
            "images": sum(p[3] for p in parts),
            "cpu_seconds": sum(p[4] for p in parts),
        }
        stats["images_per_s"] = stats["images"] / seconds if seconds > 0 else 0.0
        _write_manifest(out, plans, scan, seed, size, layout, ordered)
    return comm.bcast(stats, root=0) if nranks > 1 else stats  # type: ignore[return-value]


def _write_manifest(
    out: Path,
    plans: dict[str, SplitPlan],
    scan: dict[str, Any],
    seed: int,
    size: int,
    layout: str,
    digests: dict[str, list[str]],
) -> None:
    path = out / MANIFEST
    old = read_json(path) if path.exists() else {}
    checksum = combined_checksum(digests)
    b = next(iter(plans.values())).batch_size
    man: dict[str, Any] = {
        "format": "theanompi-prep/1",
        "batch_size": b,
        "size": size,
        "layout": layout,
        "shape": list(batch_shape(layout, b, size)),
        "dtype": "uint8",
        "channels": "RGB",
        "resample": RESAMPLE,
        "n_classes": len(scan["classes"]),
        "seed": seed,
        "src": scan["src"],
        "val_labels_from": scan["val_labels_from"],
        "skipped": scan.get("skipped", []),
        "n_skipped": len(scan.get("skipped", [])),
        "checksum": checksum,
        "files": {
            "mean": "misc/img_mean.npy",
            "synsets": "misc/synsets.txt",
            "shuffled_train_filenames": "misc/shuffled_train_filenames.txt",
            "train_labels": "labels/train_labels.npy",
            "val_labels": "labels/val_labels.npy",
        },
    }
    for split, plan in plans.items():
        man[split] = {
            "dir": batch_dir(out, split, b).name,
            "n_batches": plan.n_batches,
            "n_images": plan.n_images,
            "n_padded": plan.n_padded,
            "n_dropped": plan.n_dropped,
            "last": plan.last,
            "digests": digests[split],
        }
    if old.get("checksum") == checksum:  # same content: later stages' results still hold
        for key in ("mean", "verified"):
            if key in old:
                man[key] = old[key]
    write_json(path, man)
    misc_dir(out).mkdir(parents=True, exist_ok=True)
