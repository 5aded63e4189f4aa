"""Training and validation loaders over the prep output: mean, crop, mirror, layout, rank shares.

An epoch is the list of its *sub-batches*: the (shuffled) batch files, each cut
into ``B / b`` sub-batches of the per-worker batch size ``b``. Step ``k`` of rank
``r`` out of ``N`` takes sub-batch ``k * N + r``, so no image is seen twice in an
epoch and every rank runs the same ``steps_per_epoch = n_sub // N``; the
remainder (``n_sub % N`` sub-batches) is dropped and reported in :attr:`TrainLoader.summary`.

Augmentation draws from ``default_rng([seed, epoch, sub-batch index])``: it
depends neither on N nor on the thread timing, so a resumed run sees exactly
the batches an uninterrupted one would have. The file order is shuffled with
``default_rng([seed, epoch])`` (identical on all ranks).

Integrity (``data.verify``): each batch file's SHA-256 (with its labels, prep's
``batch_digest``) is compared with the manifest's digest the first time this rank reads
it in a run (``first_read``, the default: about 1 ms per MB, once per file and run), all
files up front over the ranks (``all``, ``--verify-data``), or never (``off``). The mean
image and the label files are checked at start-up (dtype, shape, range). Each problem
is one ``DataError`` line naming the file and the ``tmpi prep`` stage to rerun (exit 3).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from theanompi.data._fault import fault_point
from theanompi.errors import ConfigError, DataError
from theanompi.io import dataset as io

__all__ = ["DataSet", "TrainLoader", "ValLoader", "Prefetcher", "prepare_batch"]


def data_manifest(root: Path) -> dict[str, Any]:
    """The prep manifest of the data folder ``root``, or a DataError saying how to make one.

    The training-side wording (``--data``, ``make data``) of :func:`theanompi.io.dataset.read_manifest`.
    """
    if not (root / io.MANIFEST).exists():
        raise DataError(
            f"no prep output in {str(root)!r} ({io.MANIFEST} missing); "
            "run `make data` or `tmpi prep all --src IMAGES --out DIR`, or pass --data DIR"
        )
    return io.read_manifest(root)


def _load_npy(path: Path, stage: str, root: Path) -> np.ndarray:
    """``np.load`` of a prep output file; a missing or unreadable file is one ``DataError``."""
    fix = f"rerun `tmpi prep {stage} --out {root}`"
    if not path.exists():
        raise DataError(f"{path} not found; {fix}")
    try:
        arr = np.load(path, allow_pickle=False)
    except Exception as err:  # noqa: BLE001 - numpy raises many kinds for a garbage file
        why = str(err).split(".")[0][:80]
        raise DataError(f"{path} is not a readable .npy array ({why}); {fix}") from None
    if not isinstance(arr, np.ndarray):
        raise DataError(f"{path} holds no single array; {fix}")
    return arr


def _load_mean(root: Path, size: int) -> np.ndarray:
    """``misc/img_mean.npy`` checked: float (3, S, S), every value finite in [0, 255]."""
    path = root / "misc" / "img_mean.npy"
    mean = _load_npy(path, "mean", root)
    fix = f"rerun `tmpi prep mean --out {root}`"
    if mean.shape != (3, size, size):
        raise DataError(f"{path} has shape {mean.shape}, expected (3, {size}, {size}); {fix}")
    if mean.dtype.kind != "f":
        raise DataError(f"{path} has dtype {mean.dtype}, expected float32; {fix}")
    ok = np.isfinite(mean) & (mean >= 0) & (mean <= 255)
    if not ok.all():
        bad = float(mean.flat[int(np.argmin(ok.ravel()))])
        raise DataError(f"{path} holds {bad!r}, not a mean of 0..255 pixels (corrupt file); {fix}")
    return mean.astype(np.float32, copy=False)


def _load_labels(root: Path, split: str, n_classes: int) -> np.ndarray:
    """``labels/<split>_labels.npy`` checked: 1-d integers in ``-1 .. n_classes - 1``
    (``n_classes`` from the manifest; 0 skips the upper bound)."""
    path = root / "labels" / f"{split}_labels.npy"
    labels = _load_npy(path, "labels", root)
    fix = f"rerun `tmpi prep labels --out {root}`"
    if labels.ndim != 1:
        raise DataError(f"{path} has shape {labels.shape}, expected one label per image; {fix}")
    if labels.dtype.kind not in "iu":
        raise DataError(
            f"{path} has dtype {labels.dtype}, expected integer class indices (corrupt or "
            f"written by another tool; float labels are not cast); {fix}"
        )
    if len(labels):
        top = n_classes - 1 if n_classes > 0 else np.iinfo(np.int32).max
        bad = np.flatnonzero((labels < -1) | (labels > top))
        if len(bad):
            i = int(bad[0])
            raise DataError(
                f"{path} holds label {int(labels[i])} at position {i} (and {len(bad) - 1} more), "
                f"outside -1..{top} for the manifest's n_classes={n_classes}: the labels are "
                f"corrupt; {fix}"
            )
    return labels.astype(np.int32, copy=False)


class DataSet:
    """One split of a prep output folder, checked against the run config.

    Attributes: ``root``, ``split``, ``manifest``, ``files`` (batch files in
    order), ``labels`` (int32, aligned), ``mean`` (float32 (3, S, S)), ``B``,
    ``S``, ``layout``, ``n_classes``.
    """

    def __init__(self, cfg: Any, split: str) -> None:
        #: data.verify: check batch digests on first read ("first_read"), never ("off"), or
        #: all up front ("all": :meth:`verify` is called by the training set-up)
        self.verify_mode = str(cfg.data.get("verify", "first_read"))
        self.root = Path(cfg.data.dir)
        self.split = split
        man = self.manifest = data_manifest(self.root)
        self.B = int(man["batch_size"])
        self.S = int(man["size"])
        self.layout = str(man["layout"])
        self.n_classes = int(man.get("n_classes", 0))
        for key, have in (
            ("file_batch_size", self.B),
            ("image_size", self.S),
            ("layout", self.layout),
        ):
            want = cfg.data[key]
            if want != have:
                raise ConfigError(
                    f"data.{key}={want!r} but {self.root}/misc/manifest.json says {have!r}; "
                    f"pass --set data.{key}={have}"
                )
        self.files = io.batch_files(self.root, split)
        self.labels = _load_labels(self.root, split, self.n_classes)
        if len(self.labels) != len(self.files) * self.B:
            raise DataError(
                f"{self.root}/labels/{split}_labels.npy has {len(self.labels)} labels for "
                f"{len(self.files)} files of {self.B}; rerun `tmpi prep labels --out {self.root}`"
            )
        self.mean = _load_mean(self.root, self.S)
        digests = man.get(split, {}).get("digests")
        #: the manifest's SHA-256 per batch file (None: a manifest without digests)
        self.digests: list[str] | None = (
            list(digests) if isinstance(digests, list) and len(digests) == len(self.files) else None
        )
        self._checked: set[int] = set()  # files whose digest matched in this run
        m = cfg.model
        self.b = int(m.batch_size)
        self.crop = int(m.input_size)
        if self.B % self.b:
            raise ConfigError(
                f"model.batch_size={self.b} does not divide the file batch size {self.B}; "
                f"use one of {[d for d in range(1, self.B + 1) if self.B % d == 0]}"
            )
        if self.crop > self.S:
            raise ConfigError(f"model.input_size={self.crop} exceeds the stored size {self.S}")
        if int(m.channels) != 3:
            raise ConfigError(
                f"model.channels={m.channels} but the data has 3 channels; set channels: 3"
            )
        top = int(self.labels.max()) if len(self.labels) else -1
        if top >= int(m.n_classes):
            raise ConfigError(
                f"{split} labels go up to {top} but model.n_classes={m.n_classes}; "
                f"set n_classes: {max(top + 1, self.n_classes)}"
            )
        self.per_file = self.B // self.b
        lab = self.labels.reshape(len(self.files), self.per_file, self.b)
        #: (n_files, per_file): sub-batch has at least one real label / only real labels
        self.any_valid = (lab >= 0).any(axis=2)
        self.all_valid = (lab >= 0).all(axis=2)
        self._cache: tuple[int, np.ndarray] | None = None

    def load(self, file_index: int) -> np.ndarray:
        """The uint8 array of batch file ``file_index`` (the last one is cached)."""
        if self._cache is not None and self._cache[0] == file_index:
            return self._cache[1]
        arr = io.load_batch(self.files[file_index])
        want = (3, self.S, self.S, self.B) if self.layout == "c01b" else (self.B, 3, self.S, self.S)
        if arr.shape != want:
            raise DataError(
                f"batch {self.files[file_index]} has shape {arr.shape}, expected {want} "
                f"({self.layout}); rerun `tmpi prep batch`"
            )
        if self.verify_mode in ("first_read", "all"):  # "all": unless verify() ran first
            self.check_digest(file_index, arr)
        self._cache = (file_index, arr)
        return arr

    def check_digest(self, file_index: int, arr: np.ndarray | None = None) -> None:
        """Compare batch ``file_index`` (and its labels) with the manifest's digest, once per
        run; a mismatch is a ``DataError`` naming the file and the prep stages to rerun."""
        if self.digests is None or file_index in self._checked:
            return
        if arr is None:
            arr = io.load_batch(self.files[file_index])
        B = self.B
        labels = self.labels[file_index * B : (file_index + 1) * B]
        if io.batch_digest(arr, labels) != self.digests[file_index]:
            raise DataError(
                f"batch {self.files[file_index]} or its labels differ from the digest in "
                f"{self.root}/misc/manifest.json (corrupt or changed since prep); rerun "
                f"`tmpi prep batch --out {self.root}` and `tmpi prep labels --out {self.root}`, "
                f"then `tmpi prep verify --out {self.root}`"
            )
        self._checked.add(file_index)

    def verify(self, rank: int = 0, size: int = 1) -> int:
        """Check this rank's share (files ``rank, rank + size, ...``) against the manifest;
        returns the number checked. Afterwards no file is checked again on read."""
        mine = range(rank, len(self.files), size)
        for f in mine:
            self.check_digest(f)
        self.verify_mode = "done"
        return len(mine)

    def sub_labels(self, file_index: int, slot: int) -> np.ndarray:
        start = file_index * self.B + slot * self.b
        return self.labels[start : start + self.b].copy()


def prepare_batch(
    batch: np.ndarray,
    slot: int,
    b: int,
    layout: str,
    mean: np.ndarray,
    crop: int,
    offsets: np.ndarray | None = None,
    flips: np.ndarray | None = None,
) -> np.ndarray:
    """Sub-batch ``slot`` of a uint8 file batch as float32 (b, 3, crop, crop), mean subtracted.

    ``offsets`` (b, 2) are per-image (row, col) crop corners (default: centre);
    ``flips`` (b,) bool mirrors images left-right.
    """
    S = mean.shape[-1]
    sl = slice(slot * b, (slot + 1) * b)
    sub = batch[..., sl] if layout == "c01b" else batch[sl]
    out = np.empty((b, 3, crop, crop), dtype=np.float32)
    if offsets is None:
        o = (S - crop) // 2
        mc = mean[:, o : o + crop, o : o + crop]
        if layout == "c01b":
            np.subtract(sub[:, o : o + crop, o : o + crop, :].transpose(3, 0, 1, 2), mc, out=out)
        else:
            np.subtract(sub[:, :, o : o + crop, o : o + crop], mc, out=out)
        if flips is not None and flips.any():
            out[flips] = out[flips][..., ::-1]
        return out
    for i in range(b):
        r, c = int(offsets[i, 0]), int(offsets[i, 1])
        img = (
            sub[:, r : r + crop, c : c + crop, i]
            if layout == "c01b"
            else sub[i, :, r : r + crop, c : c + crop]
        )
        np.subtract(img, mean[:, r : r + crop, c : c + crop], out=out[i])
        if flips is not None and flips[i]:
            out[i] = out[i][..., ::-1]
    return out


class Prefetcher:
    """Iterate ``source`` in a background thread, ``depth`` items ahead of the consumer.

    An exception in the thread is re-raised in the consumer at the item where it
    happened (so it reaches the main thread's excepthook and aborts the MPI job).
    ``close()`` (or leaving a ``with`` block) stops the thread early.
    ``enabled=False`` iterates in the caller's thread instead.
    """

    _END = object()

    def __init__(
        self, source: Iterable[Any], depth: int = 2, enabled: bool = True, name: str = "prefetch"
    ) -> None:
        self._source = source
        self._enabled = enabled
        self._it: Iterator[Any] | None = None
        if not enabled:
            self._it = iter(source)
            return
        self._q: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for item in self._source:
                if not self._put(("item", item)):
                    return
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, re-raised there
            self._put(("error", err))
            return
        self._put(("end", None))

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        if not self._enabled:
            assert self._it is not None
            return next(self._it)
        if self._stop.is_set():
            raise StopIteration
        kind, item = self._q.get()
        if kind == "item":
            return item
        self._stop.set()
        if kind == "error":
            raise item
        raise StopIteration

    def close(self) -> None:
        """Stop the background thread (pending items are dropped)."""
        if not self._enabled:
            return
        self._stop.set()
        while True:
            try:
                self._q.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=5)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TrainLoader:
    """Rank ``rank``'s training sub-batches: ``epoch(e)`` iterates ``steps_per_epoch`` ``(x, y)``.

    ``x`` is float32 (b, 3, crop, crop) (mean subtracted, random crop and mirror as
    configured), ``y`` int32 (b,). Sub-batches holding a padding label (-1) are
    skipped for training. ``training.max_steps`` caps the steps per epoch.

    Parameters
    ----------
    cfg : theanompi.config.Config
    rank, size : this rank and the number of ranks sharing the data.
    """

    def __init__(self, cfg: Any, rank: int, size: int) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank={rank!r} must be in [0, size={size})")
        self.cfg = cfg
        self.rank, self.size = rank, size
        self.ds = ds = DataSet(cfg, "train")
        self.batch_size = ds.b
        self.input_shape = (3, ds.crop, ds.crop)
        rnd = cfg.randomness
        self.seed = int(rnd.seed)
        self.shuffle = bool(rnd.shuffle) and not rnd.deterministic
        self.rand_crop = bool(rnd.rand_crop) and not rnd.deterministic
        self.mirror = bool(rnd.mirror) and not rnd.deterministic
        self.prefetch = bool(cfg.data.prefetch)
        self.n_sub = int(ds.all_valid.sum())
        self.skipped_padded = int(ds.all_valid.size - self.n_sub)
        full = self.n_sub // size
        if full == 0:
            raise DataError(
                f"{ds.root}: {self.n_sub} training sub-batches of {ds.b} cannot feed {size} ranks; "
                "use fewer ranks or a smaller --batch-size"
            )
        cap = int(cfg.training.max_steps or 0)
        #: steps each rank runs per epoch (identical on every rank)
        self.steps_per_epoch = min(full, cap) if cap > 0 else full
        #: sub-batches (and images) left out of every epoch because N does not divide them
        self.dropped = self.n_sub - full * size
        self.dropped_images = self.dropped * ds.b
        self.images_per_epoch = self.steps_per_epoch * size * ds.b

    @property
    def summary(self) -> str:
        """One line describing the epoch split (printed by rank 0 at start-up)."""
        ds = self.ds
        text = (
            f"train: {len(ds.files)} files x {ds.per_file} sub-batches of {ds.b} = {self.n_sub} "
            f"sub-batches; {self.size} rank(s) x {self.steps_per_epoch} steps/epoch; "
            f"{self.dropped} sub-batch(es) ({self.dropped_images} images) dropped per epoch"
        )
        if self.steps_per_epoch < self.n_sub // self.size:
            text += f" (capped by max_steps={self.steps_per_epoch})"
        if self.skipped_padded:
            text += f"; {self.skipped_padded} padded sub-batch(es) skipped"
        return text

    def file_order(self, epoch: int) -> np.ndarray:
        """Batch-file order of ``epoch`` (same on every rank)."""
        n = len(self.ds.files)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, int(epoch)]).permutation(n)

    def sub_batches(self, epoch: int) -> list[tuple[int, int]]:
        """All ``(file_index, slot)`` of the epoch, in the order they are dealt to ranks."""
        valid = self.ds.all_valid
        return [
            (int(f), s)
            for f in self.file_order(epoch)
            for s in range(self.ds.per_file)
            if valid[f, s]
        ]

    def assignment(self, epoch: int) -> list[tuple[int, int]]:
        """This rank's ``(file_index, slot)`` for each step of ``epoch``."""
        subs = self.sub_batches(epoch)
        return [subs[k * self.size + self.rank] for k in range(self.steps_per_epoch)]

    def steps_left(self, dealt: int) -> int:
        """This rank's steps of an epoch of which ``dealt`` sub-batches (the first of
        :meth:`sub_batches`, by every rank) are trained: the whole rounds of ``size`` left
        before the epoch's end (``steps_per_epoch * size`` sub-batches)."""
        return max(0, self.steps_per_epoch * self.size - dealt) // self.size

    def _produce(
        self, epoch: int, start: int, dealt: int | None
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        ds = self.ds
        subs = self.sub_batches(epoch)
        S, c, b = ds.S, ds.crop, ds.b
        first = start * self.size if dealt is None else dealt
        for k in range(start, start + self.steps_left(first)):
            g = first + (k - start) * self.size + self.rank
            fault_point("loader", self.rank, epoch * self.steps_per_epoch + k)
            f, slot = subs[g]
            rng = np.random.default_rng([self.seed, int(epoch), g])
            offsets = rng.integers(0, S - c + 1, size=(b, 2)) if self.rand_crop and S > c else None
            flips = rng.random(b) < 0.5 if self.mirror else None
            x = prepare_batch(ds.load(f), slot, b, ds.layout, ds.mean, c, offsets, flips)
            yield x, ds.sub_labels(f, slot)

    def epoch(self, epoch: int, start: int = 0, dealt: int | None = None) -> Prefetcher:
        """Iterator of this rank's ``(x, y)`` for ``epoch`` (0-based), from step ``start``.

        ``dealt``: the sub-batches of the epoch trained before step ``start`` (default
        ``start * size``); after an elastic shrink, a world of another size trained them, and
        the rest are dealt over this one from there.

        Use it as a context manager (or call ``close()``) when leaving early.
        """
        return Prefetcher(
            self._produce(epoch, start, dealt), enabled=self.prefetch, name=f"train-e{epoch}"
        )


class ValLoader:
    """Rank ``rank``'s validation sub-batches (centre crop, no mirror), every image once.

    Rank ``r`` takes sub-batches ``r, r + N, ...`` of the val files in order, so
    ranks may differ by one batch; callers sum their counts over ranks. Padded
    slots carry ``y == -1`` and must be ignored.
    """

    def __init__(self, cfg: Any, rank: int, size: int) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank={rank!r} must be in [0, size={size})")
        self.rank, self.size = rank, size
        self.ds = ds = DataSet(cfg, "val")
        self.batch_size = ds.b
        self.prefetch = bool(cfg.data.prefetch)
        subs = [
            (f, s) for f in range(len(ds.files)) for s in range(ds.per_file) if ds.any_valid[f, s]
        ]
        self.subs = subs[rank::size]
        #: real (non-padded) images in the whole val split
        self.n_images = int((ds.labels >= 0).sum())

    def __len__(self) -> int:
        return len(self.subs)

    def _produce(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        ds = self.ds
        for f, slot in self.subs:
            x = prepare_batch(ds.load(f), slot, ds.b, ds.layout, ds.mean, ds.crop)
            yield x, ds.sub_labels(f, slot)

    def batches(self) -> Prefetcher:
        """Iterator of this rank's ``(x, y)``; padded slots have ``y == -1``."""
        return Prefetcher(self._produce(), enabled=self.prefetch, name="val")
