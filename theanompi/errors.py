"""Errors meant for the user: the CLI prints them as one line and exits non-zero."""

from __future__ import annotations

import errno
from pathlib import Path

__all__ = [
    "UserError",
    "ConfigError",
    "DataError",
    "ResourceError",
    "DivergedError",
    "resource_error",
    "EXIT_USAGE",
    "EXIT_DATA",
    "EXIT_FAILURE",
    "EXIT_RESOURCE",
]

EXIT_FAILURE = 1  # an unexpected failure (a bug, a crashed or stalled rank, a nan/inf loss)
EXIT_USAGE = 2  # bad config, flag or argument: fix the command line or the YAML
EXIT_DATA = 3  # bad or missing input data: fix the files
EXIT_RESOURCE = (
    4  # an output could not be written (disk full, no permission): free space or move it
)

# errnos that mean "the machine refused the write", not "the program is wrong"
_RESOURCE_ERRNOS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
    errno.EFBIG: "file too large for that file system",
}


class UserError(Exception):
    """A problem the user can fix; ``str(err)`` says what and how, in one line."""

    exit_code = EXIT_USAGE
    #: every rank raised it alike at the same point (after an agreement): rank 0 reports it
    agreed = False


class ConfigError(UserError):
    """A YAML key, value or flag is wrong."""

    exit_code = EXIT_USAGE


class DataError(UserError):
    """Input data is missing, corrupt or inconsistent."""

    exit_code = EXIT_DATA


class ResourceError(UserError):
    """An output (checkpoint, record, timeline) could not be written: disk full, no permission."""

    exit_code = EXIT_RESOURCE


class DivergedError(UserError):
    """Training produced a nan/inf loss; every rank stops at the same step (exit 1)."""

    exit_code = EXIT_FAILURE
    agreed = True


def resource_error(
    err: OSError, what: str, path: str | Path, key: str = "output.run_dir"
) -> ResourceError | None:
    """A one-line :class:`ResourceError` for an ``OSError`` that is a full disk or a refused
    write of ``what`` (e.g. ``"checkpoint"``) at ``path``, whose folder the config key ``key``
    sets; ``None`` for any other error.

    >>> import errno
    >>> e = OSError(errno.ENOSPC, "x")
    >>> str(resource_error(e, "checkpoint", "/r/epoch_0001.npz", "output.checkpoint_dir"))
    "cannot write checkpoint '/r/epoch_0001.npz': no space left on the device; free space there or set output.checkpoint_dir to a folder on another disk (nothing half-written was kept)"
    """
    why = _RESOURCE_ERRNOS.get(err.errno or -1)
    if why is None:
        return None
    fix = (
        f"free space there or set {key} to a folder on another disk"
        if err.errno in (errno.ENOSPC, errno.EDQUOT)
        else f"make the folder writable or set {key} to a writable one"
    )
    return ResourceError(
        f"cannot write {what} {str(path)!r}: {why}; {fix} (nothing half-written was kept)"
    )
