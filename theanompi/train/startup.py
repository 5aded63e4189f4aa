"""Start-up checks across nodes: same versions, same data, a writable run dir; one line each."""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

from theanompi.errors import ConfigError, DataError

__all__ = ["check_nodes", "node_facts"]


def _versions() -> dict[str, str]:
    import numpy
    import pytensor

    from theanompi._version import __version__

    return {
        "theanompi": __version__,
        "pytensor": pytensor.__version__,
        "numpy": numpy.__version__,
    }


def _data_fingerprint(data_dir: Path) -> str | None:
    """The manifest's checksum (``"?"`` when it has none); None when the folder lacks one."""
    from theanompi.io.dataset import MANIFEST

    try:
        manifest = json.loads((data_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return str(manifest.get("checksum", "?")) if isinstance(manifest, dict) else None


def node_facts(data_dir: str | os.PathLike[str] | None) -> dict[str, Any]:
    """What this rank sees: host, package versions, the data manifest's checksum."""
    return {
        "host": socket.gethostname(),
        "versions": _versions(),
        "data": None if data_dir is None else _data_fingerprint(Path(data_dir)),
    }


def _check_run_dir(run_dir: Path) -> None:
    """Write (and remove) a file in ``run_dir``, or check its nearest existing parent is
    writable; creates nothing."""
    try:
        if run_dir.is_dir():
            with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".write-test-"):
                pass
            return
        parent = next((p for p in run_dir.parents if p.exists()), Path("/"))
        if not os.access(parent, os.W_OK | os.X_OK):
            raise PermissionError(13, f"cannot create folders in {parent}")
    except OSError as e:
        raise ConfigError(
            f"run dir {str(run_dir)!r} is not writable from rank 0's node "
            f"({socket.gethostname()}): {e.strerror}; pick another --run-dir"
        ) from None


def _compare(facts: list[dict[str, Any]], data_dir: str | None) -> None:
    """Raise on the first difference between rank 0's node and another node."""
    first = facts[0]
    for f in facts[1:]:
        for pkg, version in first["versions"].items():
            theirs = f["versions"].get(pkg)
            if theirs != version:
                raise ConfigError(
                    f"{pkg} {theirs} on {f['host']} but {version} on {first['host']} (rank 0); "
                    "install the same versions on every node (pip install -c constraints.txt .)"
                )
    if data_dir is None or all(f["data"] is None for f in facts):
        return  # no node has it: the loaders say so, with their own hints
    have = next(f for f in facts if f["data"] is not None)
    for f in facts:
        if f["data"] is None:
            raise DataError(
                f"data folder {data_dir!r} (its misc/manifest.json) is missing on {f['host']} "
                f"but present on {have['host']}; copy it there or use a shared file system"
            )
        if f["data"] != have["data"]:
            raise DataError(
                f"data folder {data_dir!r} differs between {have['host']} and {f['host']} "
                f"(manifest checksum {have['data']} vs {f['data']}); copy the same prep output "
                "to every node"
            )


def check_nodes(comm: Any, data_dir: str | None, run_dir: str | None) -> None:
    """Collective over ``comm``: every node has the same theanompi/pytensor/numpy versions
    and the same data folder (manifest checksum), and the run dir is writable from rank 0.

    Raises the same :class:`~theanompi.errors.UserError` on every rank (one line, naming the
    node that differs), so a caller wrapping it in ``collective`` reports it once.
    """
    per_rank = comm.allgather(node_facts(data_dir))
    facts = list({f["host"]: f for f in reversed(per_rank)}.values())[::-1]  # one per node
    facts.sort(key=lambda f: f["host"] != per_rank[0]["host"])  # rank 0's node first
    _compare(facts, data_dir)
    problem = None
    if comm.Get_rank() == 0 and run_dir is not None:
        try:
            _check_run_dir(Path(run_dir))
        except ConfigError as e:
            problem = str(e)
    problem = comm.bcast(problem, root=0)
    if problem:
        raise ConfigError(problem)
