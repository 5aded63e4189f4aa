"""Atomic file writes: a half-written output never replaces a good one."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["atomic_write", "write_json", "write_npy"]


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temp path beside ``path``; on success rename it onto ``path``, else delete it.

    The temp file keeps ``path``'s suffix (h5py/hickle and numpy look at it)
    and lives in the same folder, so the final ``os.replace`` is atomic.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(
        prefix=f".{path.stem}.", suffix=f".tmp{path.suffix}", dir=path.parent
    )
    os.close(fd)
    tmp_path = Path(tmp)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_path, 0o666 & ~umask)  # mkstemp makes 0600; outputs should look like open()'s
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write ``obj`` as indented JSON, atomically."""
    with atomic_write(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_npy(path: str | os.PathLike[str], array: Any) -> None:
    """``np.save`` atomically (``path`` should end in .npy)."""
    import numpy as np

    with atomic_write(path) as tmp:
        with open(tmp, "wb") as fh:
            np.save(fh, array)
