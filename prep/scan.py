"""Stage ``scan``: list an ImageNet-layout tree (classes, train/val files, labels) and decode-check it.

Input layout::

    SRC/train/<wnid>/*.JPEG            one folder per class; class index = rank of wnid in sorted order
    SRC/val/*.JPEG + a ground-truth file    or    SRC/val/<wnid>/*.JPEG

Ground truth (looked up in SRC unless ``gt`` is given): ``val_ground_truth.txt``,
``ILSVRC2012_validation_ground_truth.txt``, ``val.txt`` or ``val_labels.txt``, in either form

* one label per line, for the val files in sorted file-name order (ILSVRC2012 devkit style), or
* ``<file name> <label>`` lines (Caffe ``val.txt`` style).

A label is a wnid (``n01440764``) or an integer class number. Integers count classes in
sorted-wnid order, 1-based (ILSVRC convention) or 0-based (Caffe): ``gt_base="auto"`` picks
0-based when a 0 occurs and 1-based otherwise. When a devkit ``meta.mat`` sits beside the
ground-truth file, integers are ILSVRC2012_IDs and are mapped through it to wnids.

Every image is decode-checked (a cheap DCT-scaled decode, spread over the MPI ranks); files
that fail are skipped, counted and listed, so the later stages see only good files and their
batches are full and identical for any number of ranks. So are entries no later stage could
name or open: a symlink loop, a broken link, a file name that is not UTF-8 or holds a line
break (the one-name-per-line shuffle list could not hold it).
"""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path
from typing import Any

from prep._common import (
    Comm,
    atomic_write,
    collective,
    get_comm,
    misc_dir,
    raise_collective,
)
from theanompi.errors import ConfigError, DataError, UserError

__all__ = [
    "IMAGE_EXTENSIONS",
    "GT_NAMES",
    "SYNSET_NAME_FILES",
    "list_tree",
    "check_image",
    "read_scan",
    "run",
]

IMAGE_EXTENSIONS = frozenset({".jpeg", ".jpg", ".png"})
GT_NAMES = (
    "val_ground_truth.txt",
    "ILSVRC2012_validation_ground_truth.txt",
    "val.txt",
    "val_labels.txt",
)
SYNSET_NAME_FILES = ("synset_words.txt", "LOC_synset_mapping.txt", "words.txt")
_WNID = re.compile(r"^n\d+$")
_READ_BUFFER = 4 << 20  # bytes: larger files are read by path (ImageNet's largest is ~15 MB)


_LINE_BREAKS = frozenset("\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029")  # what str.splitlines splits on
_ASCII_BREAKS = frozenset(c for c in _LINE_BREAKS if c.isascii())


def printable(name: str) -> str:
    """``name`` as one line of valid text: undecodable bytes as ``\\xNN``, line breaks escaped.

    >>> printable("a\\u2028b.JPEG"), printable("x\\udcff.JPEG")
    ('a\\\\u2028b.JPEG', 'x\\\\xff.JPEG')
    """
    text = name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return "".join(ascii(c)[1:-1] if c in _LINE_BREAKS else c for c in text)


def name_problem(name: str) -> str | None:
    """Why file name ``name`` cannot go into the one-name-per-line lists, or None."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return "file name is not valid UTF-8; rename the file"
    if not _LINE_BREAKS.isdisjoint(name):
        return "file name contains a line break; rename the file"
    return None


def _os_reason(err: OSError) -> str:
    if err.errno == errno.ELOOP:
        return "symlink loop (too many levels of symbolic links); fix or remove the link"
    return f"cannot stat: {err.strerror or err}"


def _images_in(folder: Path) -> tuple[list[str], dict[str, str]]:
    """Sorted image file names directly in ``folder`` (hidden files ignored), and the bad ones.

    The list holds every candidate, bad ones included (positional ground truth counts them);
    the dict gives each bad one's reason: a symlink loop, a broken link, a file name that is
    not UTF-8 or holds a line break.
    """
    names: list[str] = []
    bad: dict[str, str] = {}
    with os.scandir(folder) as it:
        for e in it:
            name = e.name
            if name[0] == "." or name[name.rfind(".") :].lower() not in IMAGE_EXTENSIONS:
                continue
            try:
                regular = e.is_file()
            except OSError as err:  # a symlink loop (ELOOP)
                regular, bad[name] = True, _os_reason(err)
            if not regular:
                if not e.is_symlink():
                    continue  # a folder named like an image
                bad[name] = "broken symlink; fix or remove the link"
            names.append(name)
            if not (name.isascii() and _ASCII_BREAKS.isdisjoint(name)) and name not in bad:
                if problem := name_problem(name):
                    bad[name] = problem
    names.sort()
    return names, bad


def _subdirs(folder: Path) -> list[str]:
    """Sorted non-hidden sub-folders; a loop or an unlistable name is a ``DataError``."""
    out = []
    with os.scandir(folder) as it:
        for e in it:
            if e.name.startswith("."):
                continue
            where = printable(os.path.join(folder, e.name))
            try:
                is_dir = e.is_dir()
            except OSError as err:
                if os.path.splitext(e.name)[1].lower() in IMAGE_EXTENSIONS:
                    continue  # an image-named loop: _images_in lists it as skipped
                raise DataError(f"cannot read {where}: {_os_reason(err)}") from None
            if is_dir:
                if problem := name_problem(e.name):
                    raise DataError(f"folder {where}: " + problem.replace("file", "folder"))
                out.append(e.name)
    return sorted(out)


def _synset_names(src: Path, wnids: list[str]) -> dict[str, str]:
    """Human-readable names from ``synset_words.txt``/``LOC_synset_mapping.txt``/``words.txt``."""
    wanted = set(wnids)
    for folder in (src, src.parent):
        for name in SYNSET_NAME_FILES:
            path = folder / name
            if not path.is_file():
                continue
            names: dict[str, str] = {}
            for line in path.read_text(errors="replace").splitlines():
                parts = line.strip().split(maxsplit=1)
                if len(parts) == 2 and parts[0] in wanted:
                    names[parts[0]] = " ".join(parts[1].split())
            if names:
                return names
    return {}


def _find_gt(src: Path) -> Path | None:
    for folder in (src, src / "val", src.parent):
        for name in GT_NAMES:
            if (folder / name).is_file():
                return folder / name
    return None


def _meta_mat_ids(gt: Path) -> dict[int, str] | None:
    """ILSVRC2012_ID -> wnid from a devkit ``meta.mat`` beside ``gt`` (None when absent)."""
    meta = gt.parent / "meta.mat"
    if not meta.is_file():
        return None
    try:
        from scipy.io import loadmat

        synsets = loadmat(str(meta), squeeze_me=True)["synsets"]
        return {int(s["ILSVRC2012_ID"]): str(s["WNID"]) for s in synsets}
    except Exception as err:  # noqa: BLE001 - any unreadable meta.mat
        raise DataError(f"cannot read {meta}: {err}; remove it to use sorted-wnid labels") from None


def _parse_gt(
    gt: Path,
    val_names: list[str],
    wnids: list[str],
    gt_base: str,
    skip: frozenset[str] = frozenset(),
) -> tuple[list[int], str]:
    """Class index of each val file (in ``val_names`` order) and a description of the format.

    Names in ``skip`` (files scan drops) count for the positional form but need no
    ``name label`` line; their index is then a placeholder.
    """
    rows = []
    for no, line in enumerate(gt.read_text(errors="replace").splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        parts = text.split()
        if len(parts) > 2:
            raise DataError(f"{gt}:{no}: expected `label` or `name label`, got {text!r}")
        rows.append((no, parts))
    if not rows:
        raise DataError(f"ground-truth file {gt} is empty; it needs one label per val image")
    kinds = {len(p) for _, p in rows}
    if len(kinds) > 1:
        raise DataError(f"{gt}: mixes `label` and `name label` lines; use one form")
    named = kinds == {2}
    if named:
        by_name: dict[str, str] = {}
        for _, (name, label) in rows:
            by_name[os.path.basename(name)] = label
        stems = {os.path.splitext(k)[0]: v for k, v in by_name.items()}
        tokens = []
        missing = []
        for fname in val_names:
            tok = by_name.get(fname, stems.get(os.path.splitext(fname)[0]))
            if tok is None and fname not in skip:
                missing.append(fname)
            tokens.append(tok)
        if missing:
            raise DataError(
                f"ground truth {gt} has no label for {len(missing)} of {len(val_names)} val "
                f"images (first {missing[0]}); give every val file a `name label` line"
            )
        first = next((x for x in tokens if x is not None), None)
        tokens = [first if x is None else x for x in tokens]
        form = "name label"
    else:
        tokens = [p[0] for _, p in rows]
        if len(tokens) != len(val_names):
            raise DataError(
                f"ground truth {gt} has {len(tokens)} labels but val/ has {len(val_names)} "
                "images; it needs one label per val image, in sorted file-name order"
            )
        form = "one label per line"
    index = {w: i for i, w in enumerate(wnids)}
    if all(_WNID.match(t) for t in tokens):
        out = []
        for t in tokens:
            if t not in index:
                raise DataError(f"ground truth {gt} names class {t!r}, which train/ lacks")
            out.append(index[t])
        return out, f"{form}, wnids"
    try:
        nums = [int(t) for t in tokens]
    except ValueError:
        bad = next(t for t in tokens if not t.lstrip("-").isdigit())
        raise DataError(
            f"ground truth {gt}: label {bad!r} is neither an integer nor a wnid"
        ) from None
    ids = _meta_mat_ids(gt)
    if ids is not None:
        out = []
        for n in nums:
            w = ids.get(n)
            if w not in index:
                raise DataError(f"ground truth {gt}: ILSVRC2012_ID {n} ({w}) not a train class")
            out.append(index[w])
        return out, f"{form}, ILSVRC2012_IDs via {gt.parent / 'meta.mat'}"
    if gt_base == "auto":
        base = 0 if min(nums) == 0 else 1
    elif gt_base in ("0", "1"):
        base = int(gt_base)
    else:
        raise ConfigError(f"--gt-base must be auto, 0 or 1, got {gt_base!r}")
    out = [n - base for n in nums]
    bad = [n for n, o in zip(nums, out, strict=True) if not 0 <= o < len(wnids)]
    if bad:
        raise DataError(
            f"ground truth {gt}: label {bad[0]} out of range for {len(wnids)} classes "
            f"({base}-based); pass --gt-base 0 or 1"
        )
    return out, f"{form}, {base}-based sorted-wnid indices"


def list_tree(
    src: str | os.PathLike[str], gt: str | os.PathLike[str] | None = None, gt_base: str = "auto"
) -> dict[str, Any]:
    """List classes and files of an ImageNet-layout tree (no decoding).

    Parameters
    ----------
    src
        The tree root holding ``train/`` and ``val/``.
    gt
        Val ground-truth file; default: looked up in ``src`` (see the module docstring).
    gt_base
        ``"auto"``, ``"0"`` or ``"1"``: base of integer ground-truth labels.

    Returns
    -------
    dict
        ``{"src", "classes": [[wnid, name], ...], "train": [[relpath, label], ...],
        "val": [[relpath, label], ...], "val_labels_from": str, "skipped": [...]}``;
        ``skipped`` lists the files no later stage could name or open (a symlink loop, a broken
        link, a name that is not UTF-8 or holds a line break) as ``{"split", "path",
        "reason"}``, ``path`` made printable (:func:`printable`).
    """
    src = Path(src).expanduser().resolve()
    if not src.is_dir():
        raise DataError(f"--src {src}: no such folder; point it at a tree with train/ and val/")
    train_dir, val_dir = src / "train", src / "val"
    for d in (train_dir, val_dir):
        if not d.is_dir():
            raise DataError(f"missing folder {d}; --src needs train/<wnid>/*.JPEG and val/")
    wnids = _subdirs(train_dir)
    if not wnids:
        raise DataError(f"{train_dir} has no class folders; expected train/<wnid>/*.JPEG")
    train: list[list[Any]] = []
    skipped: list[dict[str, str]] = []

    def keep(split: str, prefix: str, names: list[str], bad: dict[str, str]) -> list[str]:
        for n in names:
            if n in bad:
                skipped.append({"split": split, "path": printable(prefix + n), "reason": bad[n]})
        return [n for n in names if n not in bad] if bad else names

    for label, wnid in enumerate(wnids):
        names, bad = _images_in(train_dir / wnid)
        if not names:
            raise DataError(
                f"empty class folder {train_dir / wnid}: no .JPEG images; add images or remove it"
            )
        prefix = f"train/{wnid}/"
        train += [[prefix + n, label] for n in keep("train", prefix, names, bad)]
    index = {w: i for i, w in enumerate(wnids)}
    val_sub = [(d, *_images_in(val_dir / d)) for d in _subdirs(val_dir)]
    val_sub = [v for v in val_sub if v[1]]
    loose, loose_bad = _images_in(val_dir)
    val: list[list[Any]] = []
    if val_sub:
        if loose:
            raise DataError(f"{val_dir} mixes images and class folders; use one layout")
        for wnid, names, bad in val_sub:
            if wnid not in index:
                raise DataError(f"val class folder {val_dir / wnid} has no train/{wnid} class")
            prefix = f"val/{wnid}/"
            val += [[prefix + n, index[wnid]] for n in keep("val", prefix, names, bad)]
        source = "val/<wnid>/ folders"
    else:
        if not loose:
            raise DataError(f"{val_dir} has no images; expected val/*.JPEG or val/<wnid>/*.JPEG")
        gt_path = Path(gt).expanduser() if gt else _find_gt(src)
        if gt_path is None:
            raise DataError(
                f"no ground-truth file for {val_dir}; put {GT_NAMES[0]} in {src} or pass --gt"
            )
        if not gt_path.is_file():
            raise DataError(f"--gt {gt_path}: no such file")
        labels, form = _parse_gt(gt_path, loose, wnids, gt_base, frozenset(loose_bad))
        kept = set(keep("val", "val/", loose, loose_bad))
        val = [[f"val/{n}", lab] for n, lab in zip(loose, labels, strict=True) if n in kept]
        source = f"{gt_path.resolve()} ({form})"
    names = _synset_names(src, wnids)
    return {
        "src": str(src),
        "classes": [[w, names.get(w, w)] for w in wnids],
        "train": train,
        "val": val,
        "val_labels_from": source,
        "skipped": skipped,
    }


def check_image(path: str | os.PathLike[str]) -> str | None:
    """None when ``path`` decodes, else a one-line reason (truncated, not an image, ...).

    See :func:`prep.decode.check`: a 1/8-scale decode (every entropy-coded byte is still read),
    simplejpeg first and Pillow for what it does not take.
    """
    from prep.decode import check

    return check(path)


def _check_share(
    root: str, tree: dict[str, Any], rank: int, size: int
) -> list[tuple[str, int, str]]:
    """``(split, index, reason)`` of the bad files among this rank's share (every size-th file).

    Per file this loop is all the Python there is, so it avoids pathlib and path walks: each
    file is opened relative to its folder's descriptor and read into one reused buffer
    (a quarter less CPU than ``open(path).read()``); a file larger than the buffer, or a
    folder that cannot be opened, goes through :func:`prep.decode.check` by path.
    """
    from prep.decode import check, check_bytes

    buf = bytearray(_READ_BUFFER)
    view = memoryview(buf)
    bad = []
    offset = 0  # files are dealt as one sequence, train then val: global index offset + i
    folder, dir_fd = None, -1
    try:
        for split in ("train", "val"):
            rows = tree[split]
            for i in range((rank - offset) % size, len(rows), size):
                rel = rows[i][0]
                cut = rel.rfind("/")
                if rel[:cut] != folder:
                    if dir_fd >= 0:
                        os.close(dir_fd)
                    folder, dir_fd = rel[:cut], -1
                    try:
                        dir_fd = os.open(root + folder, os.O_RDONLY | os.O_DIRECTORY)
                    except OSError:
                        pass
                reason = None
                n = len(buf)
                if dir_fd >= 0:
                    try:
                        fd = os.open(rel[cut + 1 :], os.O_RDONLY, dir_fd=dir_fd)
                        try:
                            n = os.readv(fd, [buf])
                        finally:
                            os.close(fd)
                    except OSError:
                        n = len(buf)  # let check() word the error
                    else:
                        if n < len(buf):
                            reason = check_bytes(view[:n])
                if n >= len(buf):
                    reason = check(root + rel)
                if reason is not None:
                    bad.append((split, i, reason))
            offset += len(rows)
    finally:
        if dir_fd >= 0:
            os.close(dir_fd)
    return bad


def _write_scan(out: Path, tree: dict[str, Any]) -> None:
    """``misc/scan.json`` (compact: 1.3 M rows stay quick) and ``misc/synsets.txt``."""
    misc = misc_dir(out)
    with atomic_write(misc / "scan.json") as tmp:
        tmp.write_text(json.dumps(tree, separators=(",", ":")))
    with atomic_write(misc / "synsets.txt") as tmp:
        tmp.write_text("".join(f"{i} {w} {n}\n" for i, (w, n) in enumerate(tree["classes"])))


def read_scan(out: str | os.PathLike[str]) -> dict[str, Any]:
    """The scan result written by :func:`run` (``misc/scan.json``)."""
    from prep._common import read_json, require

    return read_json(require(misc_dir(Path(out)) / "scan.json", "scan"))


def run(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    gt: str | os.PathLike[str] | None = None,
    gt_base: str = "auto",
    comm: Comm | None = None,
) -> dict[str, Any]:
    """Scan ``src``, decode-check every image over the ranks, write ``misc/scan.json`` and synsets.

    Returns the scan dict (on every rank) with good files only and ``"skipped"`` listing the
    rest as ``{"path", "split", "reason"}``.
    """
    comm = get_comm(comm)
    out = Path(out)
    tree = collective(comm, lambda: list_tree(src, gt, gt_base))
    rank, size = comm.Get_rank(), comm.Get_size()
    root = Path(tree["src"])
    mine = _check_share(str(root) + os.sep, tree, rank, size)
    found = comm.gather(mine, root=0) if size > 1 else [mine]
    message: UserError | str | None = None
    if rank == 0:
        bad = sorted((x for part in found for x in part), key=lambda t: (t[0], t[1]))
        skip = {(s, i) for s, i, _ in bad}
        tree["skipped"] += [{"split": s, "path": tree[s][i][0], "reason": r} for s, i, r in bad]
        for s in ("train", "val"):
            tree[s] = [row for i, row in enumerate(tree[s]) if (s, i) not in skip]
        if not tree["train"]:
            message = f"no train image in {root} could be decoded"
        elif not tree["val"]:
            message = f"no val image in {root} could be decoded"
        else:
            try:  # a full disk here is reported by every rank together (one line, no abort)
                _write_scan(out, tree)
            except UserError as err:
                message = err
    raise_collective(comm, message)
    if size > 1:
        if rank != 0:
            tree = None  # drop the unfiltered copy before the final one arrives (1.3 M rows)
        tree = comm.bcast(tree, root=0)
    return tree
