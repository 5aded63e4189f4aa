"""Set-up steps that fail alike on every rank, reported once: ``collective(comm, fn, ...)``."""

from __future__ import annotations

from typing import Any

from theanompi.errors import ConfigError, DataError, UserError

__all__ = ["collective"]


def collective(comm: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` on every rank; if it raises a ``UserError`` on any rank,
    rank 0 raises it (one line from the CLI) and the other ranks exit with the same code.

    For set-up steps that fail alike on all ranks (missing files, a wrong checkpoint), so
    that the user sees one error line instead of one per rank.
    """
    try:
        out, err = fn(*args, **kwargs), None
    except UserError as e:
        out, err = None, e
    info = None if err is None else (type(err).__name__, str(err), err.exit_code)
    infos = comm.allgather(info)
    failed = [i for i in infos if i is not None]
    if not failed:
        return out
    if comm.Get_rank() == 0:
        if err is not None:
            raise err
        name, msg, _ = failed[0]
        raise (DataError if name == "DataError" else ConfigError)(msg)
    raise SystemExit(failed[0][2])
