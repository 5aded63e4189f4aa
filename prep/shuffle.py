"""Stage ``shuffle``: a seeded, reproducible order of the train files (``misc/shuffled_train_filenames.txt``).

The order is ``numpy.random.default_rng(seed).permutation`` of the scanned (sorted, good) train
files, so the same tree and seed give the same order on any machine and any number of ranks.
Val keeps the scan's sorted order.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from prep._common import (
    Comm,
    atomic_write,
    collective,
    get_comm,
    misc_dir,
    read_json,
    require,
    write_json,
)
from prep.scan import read_scan
from theanompi.errors import DataError

__all__ = ["DEFAULT_SEED", "shuffled_order", "read_order", "run"]

DEFAULT_SEED = 1234
FILENAME = "shuffled_train_filenames.txt"


def shuffled_order(n: int, seed: int) -> np.ndarray:
    """The permutation of ``range(n)`` used for ``seed``.

    >>> shuffled_order(5, 0).tolist() == shuffled_order(5, 0).tolist()
    True
    """
    return np.random.default_rng(seed).permutation(n)


def read_order(
    out: str | os.PathLike[str], scan: dict[str, Any] | None = None
) -> tuple[list[list[Any]], int]:
    """The train ``[[relpath, label], ...]`` in shuffled order, and the seed used.

    Raises
    ------
    DataError
        When the shuffle is missing or no longer matches the scan.
    """
    misc = misc_dir(Path(out))
    scan = scan if scan is not None else read_scan(out)
    meta = read_json(require(misc / "shuffle.json", "shuffle"))
    names = require(misc / FILENAME, "shuffle").read_text().splitlines()
    labels = {rel: lab for rel, lab in scan["train"]}
    if len(names) != len(labels) or any(n not in labels for n in names):
        raise DataError(f"{misc / FILENAME} does not match the scan; rerun `tmpi prep shuffle`")
    return [[n, labels[n]] for n in names], int(meta["seed"])


def run(out: str | os.PathLike[str], seed: int = DEFAULT_SEED, comm: Comm | None = None) -> int:
    """Write the shuffled train list for ``seed`` (rank 0); returns the number of files."""
    comm = get_comm(comm)

    def work() -> int:
        scan = read_scan(out)
        train = scan["train"]
        order = shuffled_order(len(train), seed)
        misc = misc_dir(Path(out))
        with atomic_write(misc / FILENAME) as tmp:
            tmp.write_text("".join(train[i][0] + "\n" for i in order))
        write_json(misc / "shuffle.json", {"seed": int(seed), "n": len(train)})
        return len(train)

    return collective(comm, work)
