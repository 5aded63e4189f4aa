"""Peak resident memory of this process: the kernel's high-water mark, resettable on Linux."""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable
from typing import Any

__all__ = ["peak_rss_bytes", "reset_peak_rss", "rss_bytes", "param_bytes"]

MB = 1 << 20


def _status_kib(key: str) -> int | None:
    """``key`` (``VmHWM``, ``VmRSS``) of ``/proc/self/status`` in KiB; None off Linux."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """Most resident memory this process has had (``VmHWM``; ``ru_maxrss`` where there is no
    ``/proc``), in bytes: what the kernel counts against the node, page cache excluded.

    >>> peak_rss_bytes() >= rss_bytes() > 0
    True
    """
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS: bytes, Linux: KiB


def rss_bytes() -> int:
    """Resident memory now (``VmRSS``), in bytes; the peak where it cannot be read."""
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else peak_rss_bytes()


def reset_peak_rss() -> bool:
    """Set the high-water mark back to the current resident size (Linux >= 4.0: ``5`` to
    ``/proc/self/clear_refs``); returns False where that is not possible (then
    :func:`peak_rss_bytes` keeps counting from the process start)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return True


def param_bytes(params: Iterable[Any]) -> int:
    """Bytes of the values of shared variables (``get_value(borrow=True)``, no copy)."""
    return int(sum(p.get_value(borrow=True).nbytes for p in params))
