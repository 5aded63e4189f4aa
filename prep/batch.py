"""Stage ``batch``: decode, resize and write the shuffled images as uint8 hickle batches, MPI-parallel.

Each image is decoded by :mod:`prep.decode` (simplejpeg/libjpeg-turbo for plain JPEGs, at
Pillow's ``draft`` DCT scale, i.e. 1/2..1/8 only where both sides stay >= S; Pillow for CMYK,
PNG and whatever simplejpeg rejects), turned upright by its EXIF orientation, converted to RGB,
and its centred square is resampled to S x S with Pillow's antialiased bilinear filter
(:mod:`prep.resize`, C or numba) — shorter side to S, then centre crop. The train batches and then
the val batches are dealt round-robin over the ranks as one sequence (rank r of N writes
batches r, r+N, ... of it). Files are written atomically, and each rank appends ``k sha256``
to its ``digests-r<rank>.txt`` journal once batch k is on disk. On resume a batch file is kept
only when its digest equals the recorded one; a corrupt, unreadable, missing or unrecorded
batch is rewritten. Where a rank has a spare core, it decodes on its own thread while a
second one resizes, writes and hashes (:class:`_Pipeline`). Because ``scan`` removed
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
    atomic_write,
    collective,
    combined_checksum,
    get_comm,
    misc_dir,
    raise_collective,
    read_json,
    write_json,
    write_problem,
    wtime,
)
from prep.decode import Scratch, decode
from prep.scan import read_scan
from prep.shuffle import read_order
from theanompi.errors import ConfigError, DataError, UserError
from theanompi.io.dataset import LAYOUTS, MANIFEST, batch_digest, batch_dir, batch_name, batch_shape

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
JOURNAL_PREFIX = "digests-r"  # <batch dir>/digests-r<rank>.txt: "k sha256" per batch written


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
    from prep.resize import resize_into

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
        elif (p.suffix == ".hkl" or p.name.startswith(JOURNAL_PREFIX)) and old != fp:
            p.unlink(missing_ok=True)
    if old != fp:
        write_json(plan_file, fp)


def _recorded(folder: Path) -> dict[int, str]:
    """Batch index -> digest, from every rank's journal in ``folder`` (any earlier N).

    Batch k's content is a function of the plan alone, so journals of runs with other rank
    counts agree; a torn last line (a crash mid-append) is ignored.
    """
    found: dict[int, str] = {}
    for journal in sorted(folder.glob(JOURNAL_PREFIX + "*.txt")):
        for line in journal.read_text(errors="replace").splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0].isdigit() and len(parts[1]) == 64:
                found[int(parts[0])] = parts[1]
    return found


class _Journal:
    """This rank's append-only ``digests-r<rank>.txt``: ``k digest`` once batch k is on disk."""

    def __init__(self, folder: Path, rank: int) -> None:
        self.path = folder / f"{JOURNAL_PREFIX}{rank}.txt"
        self._fh: Any = None

    def add(self, k: int, digest: str) -> None:
        try:
            if self._fh is None:
                self._fh = open(self.path, "a+b")  # noqa: SIM115 - kept open until close()
                if self._fh.tell() > 0:  # end a torn last line (a crash mid-append) first
                    self._fh.seek(-1, os.SEEK_END)
                    if self._fh.read(1) != b"\n":
                        self._fh.write(b"\n")
            self._fh.write(f"{k} {digest}\n".encode())
            self._fh.flush()
        except OSError as err:
            raise (write_problem(err, self.path) or err) from None

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()


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


def _hickle_bytes(arr: np.ndarray) -> bytes:
    """The bytes ``hickle.dump(arr, path)`` would write, built in memory (HDF5 core driver).

    HDF5 writing to a full disk raises from its cache flush, again from destructors, and may
    crash the process; building the file in memory and writing its bytes with plain file I/O
    turns a full disk into one ``OSError`` (ENOSPC) with nothing left behind.
    """
    import h5py
    import hickle

    with h5py.File(f"batch-{id(arr)}.mem", "w", driver="core", backing_store=False) as f:
        hickle.dump(arr, f)
        f.flush()
        return f.id.get_file_image()


class _Writer:
    """Writes uint8 batches of one shape as hickle files, atomically, without HDF5 at write time.

    For a fixed shape the file is the same bytes around the pixels (contiguous storage, no
    timestamps), so those are built once (:func:`_hickle_bytes` of zeros) and each batch is
    ``head + pixels + tail`` in plain file I/O: no 12 MB copies through HDF5's core driver.
    Checked once against :func:`_hickle_bytes` of a patterned array; should this hickle/h5py
    lay the file out otherwise, every batch goes through :func:`_hickle_bytes` instead.
    """

    def __init__(self, shape: tuple[int, ...]) -> None:
        import io

        import h5py

        self.head = self.tail = b""
        self.direct = False
        template = _hickle_bytes(np.zeros(shape, dtype=np.uint8))
        with h5py.File(io.BytesIO(template), "r") as f:
            found: list[Any] = []
            f.visititems(lambda _, o: found.append(o) if isinstance(o, h5py.Dataset) else None)
            big = [d for d in found if d.shape == shape and d.dtype == np.uint8]
            offset = big[0].id.get_offset() if len(big) == 1 else None
        nbytes = int(np.prod(shape))
        if offset is None or offset + nbytes > len(template):
            return
        head, tail = template[:offset], template[offset + nbytes :]
        probe = np.resize(np.arange(251, dtype=np.uint8), shape)  # byte k is k % 251
        got = _hickle_bytes(probe)  # compared in place: no 12 MB concatenations
        same = len(got) == len(template) and got.startswith(head) and got.endswith(tail)
        pixels = np.frombuffer(got, np.uint8, nbytes, offset) if same else None
        if pixels is not None and np.array_equal(pixels, probe.reshape(-1)):
            self.head, self.tail, self.direct = head, tail, True

    def write(self, path: Path, arr: np.ndarray) -> None:
        """Write ``arr`` (C-contiguous, the writer's shape) to ``path`` atomically."""
        with atomic_write(path) as tmp:
            with open(tmp, "wb") as fh:
                if self.direct and arr.flags.c_contiguous:
                    fh.write(self.head)
                    fh.write(memoryview(arr).cast("B"))
                    fh.write(self.tail)
                else:
                    fh.write(_hickle_bytes(arr))


class _Pipeline:
    """Decodes on the calling thread; resizes, transposes, writes and hashes on one worker thread.

    The worker runs its tasks in order (FIFO). Per image, the caller decodes into one of
    ``DEPTH`` reused buffers (waiting only for the resize that last read that buffer) and
    queues its resize into a (B, 3, S, S) stage, one contiguous (3, S, S) slot each; per
    batch it queues the finish: the stage is transposed into the c01b batch in 8x8-byte
    blocks (``prep.resize.transpose_into``; bc01 slots are contiguous: no stage), written,
    hashed and journalled. The worker's kernels (C or numba, hashlib, file writes) release the
    GIL, so a rank decodes image j + 1 while image j is resized and batch k - 1 is written:
    the same pixels and bytes as one thread, in order. A failed task makes every later
    finish fail, so a batch with a missing image is never written or journalled. Without a
    spare core (``threaded=False``: as many ranks on the machine as cores) each task runs at
    once on the calling thread instead: a second thread would only compete for the cores.
    """

    DEPTH = 16  # decodes the caller may run ahead: about one batch's finish (B=64: ~20 ms)

    def __init__(
        self, batch_size: int, size: int, layout: str, writer: _Writer, threaded: bool = True
    ) -> None:
        from concurrent.futures import Future, ThreadPoolExecutor

        from prep import resize

        self.resize = resize
        self.writer = writer
        self.layout = layout
        self.buf = new_batch(layout, batch_size, size)
        self.stage = self.buf if layout == "bc01" else new_batch("bc01", batch_size, size)
        # inline, each image is resized before the next decode: one buffer to fault in, not 16
        depth = self.DEPTH if threaded else 1
        self.scratch = [Scratch() for _ in range(depth)]
        self.reads: list[Future[None] | None] = [None] * depth
        self.n = 0  # images decoded so far: image n uses scratch[n % depth]
        self.error: BaseException | None = None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="prep-batch") if threaded else None

    def _submit(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` queued on the worker, or run now; a future of its result."""
        if self.pool is not None:
            return self.pool.submit(fn, *args)
        from concurrent.futures import Future

        done: Future[Any] = Future()
        try:
            done.set_result(fn(*args))
        except BaseException as err:  # noqa: BLE001 - delivered by result(), as the pool does
            done.set_exception(err)
        return done

    def _resize(self, image: np.ndarray | None, j: int) -> None:
        try:
            if image is None:
                self.stage[j] = 0
            else:
                self.resize.resize_into(image, self.stage[j])
        except BaseException as err:
            self.error = self.error or err
            raise

    def _finish(self, path: Path, labels: np.ndarray, journal: _Journal, k: int) -> str:
        if self.error is not None:
            raise RuntimeError(f"not writing {path}: an earlier task failed") from self.error
        if self.layout == "c01b":
            self.resize.transpose_into(self.stage, self.buf)
        self.writer.write(path, self.buf)
        digest = batch_digest(self.buf, labels)
        journal.add(k, digest)
        return digest

    def submit(
        self,
        items: list[tuple[str, int] | None],
        root: Path,
        path: Path,
        labels: np.ndarray,
        journal: _Journal,
        k: int,
    ) -> Any:
        """Decode ``items`` here, queue the rest; a future of the batch's digest (once on disk)."""
        size = self.stage.shape[-1]
        for j, it in enumerate(items):
            if it is None:
                self._submit(self._resize, None, j)
                continue
            slot = self.n % len(self.scratch)
            pending = self.reads[slot]
            if pending is not None:
                pending.result()  # that buffer is free again (and a resize error surfaces)
            src = str(root / it[0])
            try:
                image = decode(src, size, self.scratch[slot])
            except Exception as err:  # noqa: BLE001 - scan passed it, so this is unexpected
                raise DataError(
                    f"cannot decode {src} ({type(err).__name__}: {err}) although scan "
                    "passed it; rerun `tmpi prep scan`"
                ) from None
            self.reads[slot] = self._submit(self._resize, image, j)
            self.n += 1
        return self._submit(self._finish, path, labels, journal, k)

    def close(self) -> None:
        """Let the task running finish, drop the queued ones (not written, not journalled)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


THREADS_ENV = "THEANOMPI_PREP_THREADS"  # 1 or 2 threads per rank; unset: 2 with a spare core


def _spare_core(comm: Comm) -> bool:
    """Whether this rank may use a second thread: twice as many usable cores as ranks here,
    unless ``THEANOMPI_PREP_THREADS`` (1 or 2) says otherwise (the bench pins it)."""
    forced = os.environ.get(THREADS_ENV, "").strip()
    if forced in ("1", "2"):
        return forced == "2"
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    local = 1
    if comm.Get_size() > 1:
        try:
            from mpi4py import MPI

            node = comm.Split_type(MPI.COMM_TYPE_SHARED)
            local = node.Get_size()
            node.Free()
        except Exception:  # noqa: BLE001 - no shared-memory split: count every rank as local
            local = comm.Get_size()
    return cores >= 2 * local


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

    def prepare() -> dict[str, dict[int, str]]:
        for split, plan in plans.items():
            _prepare_dir(batch_dir(out, split, batch_size), _fingerprint(plan, size, layout))
        return {split: _recorded(batch_dir(out, split, batch_size)) for split in plans}

    recorded = collective(comm, prepare)
    journals = {split: _Journal(batch_dir(out, split, batch_size), rank) for split in plans}
    pipeline = _Pipeline(batch_size, size, layout, _Writer(shape), _spare_core(comm))
    pipeline.resize.warm_up()  # load the kernels (first run on a machine: build) before the clock
    comm.Barrier()
    t0, c0 = wtime(), time.process_time()
    total = sum(p.n_batches * batch_size for p in plans.values())
    bar = Progress("prep batch", total, comm) if progress else None
    digests: dict[str, dict[int, str]] = {split: {} for split in plans}
    queued: list[tuple[str, int, Any]] = []
    written = reused = images = 0
    failure: UserError | None = None
    try:
        for split, k in _deal(plans, rank, nranks):
            plan = plans[split]
            path = batch_dir(out, split, batch_size) / batch_name(k, plan.n_batches)
            labels = plan.batch_labels(k)
            arr = _existing(path, shape)
            digest = None if arr is None else batch_digest(arr, labels)
            if digest is not None and digest == recorded[split].get(k):
                reused += 1  # kept: the very bytes recorded when it was written
                digests[split][k] = digest
            else:  # missing, unreadable, or not what was recorded (corrupt, or never recorded)
                job = pipeline.submit(plan.items[k], root, path, labels, journals[split], k)
                queued.append((split, k, job))
                written += 1
                images += int((labels >= 0).sum())
            if bar:
                bar.update(batch_size)
        for split, k, job in queued:
            digests[split][k] = job.result()
    except UserError as err:  # reported by every rank together below: one line, no abort
        failure = err
    finally:
        pipeline.close()
        for journal in journals.values():
            journal.close()
        if bar:
            bar.close()
    failures = comm.allgather(failure) if nranks > 1 else [failure]
    raise_collective(comm, next((f for f in failures if f), None) if rank == 0 else None)
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
        try:
            _write_manifest(out, plans, scan, seed, size, layout, ordered)
        except UserError as err:  # e.g. a full disk: every rank raises it (one line)
            failure = err
    raise_collective(comm, failure if rank == 0 else None)
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
