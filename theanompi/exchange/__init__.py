"""BSP parameter exchangers: ``create_exchanger(name)`` → prepare once, exchange in place."""

from __future__ import annotations

from importlib import import_module
from typing import Any

from theanompi.exchange.base import OPS, Exchanger

__all__ = ["Exchanger", "OPS", "STRATEGIES", "create_exchanger"]

# name -> (module, class); modules are imported only when chosen
STRATEGIES: dict[str, tuple[str, str]] = {
    "ar": ("theanompi.exchange.ar", "ArExchanger"),
    "asa32": ("theanompi.exchange.asa", "Asa32Exchanger"),
    "asa16": ("theanompi.exchange.asa", "Asa16Exchanger"),
    "copper": ("theanompi.exchange.copper", "CopperExchanger"),
    "ar_per_array": ("theanompi.exchange.ar_per_array", "ArPerArrayExchanger"),
}


def create_exchanger(name: str, comm: Any = None, op: str = "mean", **kw: Any) -> Exchanger:
    """The exchanger called ``name`` on ``comm`` (default ``MPI.COMM_WORLD``).

    Parameters
    ----------
    name : {"ar", "asa32", "asa16", "copper", "ar_per_array"}
        ``ar`` works for any N; the others except ``ar_per_array`` need N a power of 2
        (:class:`~theanompi.errors.ConfigError` otherwise). ``ar_per_array`` is the
        unfused baseline of the benchmark.
    comm : mpi4py communicator, optional
    op : {"mean", "sum"}
    **kw
        Strategy options (``fuse_below`` and ``segment`` for ``ar``, ``segment`` for ``copper``).

    Returns
    -------
    Exchanger
        Call ``.prepare(arrays)`` once, then ``.exchange(arrays)`` every step.

    Examples
    --------
    >>> create_exchanger("allreduce")
    Traceback (most recent call last):
    ...
    ValueError: unknown exchanger 'allreduce'; choose from 'ar', 'asa32', 'asa16', 'copper', 'ar_per_array'
    """
    if name not in STRATEGIES:
        choices = ", ".join(map(repr, STRATEGIES))
        raise ValueError(f"unknown exchanger {name!r}; choose from {choices}")
    module, cls = STRATEGIES[name]
    return getattr(import_module(module), cls)(comm=comm, op=op, **kw)
