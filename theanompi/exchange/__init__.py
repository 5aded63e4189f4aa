"""BSP parameter exchangers: ``create_exchanger(name)`` → prepare once, exchange in place.

:data:`STRATEGIES` is the only list of strategy names; everything else (config validation,
CLI help, the benchmark, the tests) reads it and asks ``STRATEGIES.get(name)`` for a
strategy's capabilities instead of listing names again. Any strategy takes any compressor of
:data:`~theanompi.exchange.compression.COMPRESSORS` (what travels on the wire):

============== ============================ ====== ========== ==========================
name           collective                   N      float16    float16 roundings per value
============== ============================ ====== ========== ==========================
``ar``         ``Allreduce`` in segments    any    ``fp16``   N (any order of sums)
``asa32``      ``Alltoall`` + ``Allgather`` 2^k    ``fp16``   2
``asa16``      ``asa32``, always float16    2^k    implied    2
``copper``     binary tree, ``Send/Recv``   2^k    ``fp16``   1 + log2 N
``ar_per_array`` one ``Allreduce`` per array any    ``fp16``   N (benchmark baseline)
============== ============================ ====== ========== ==========================
"""

from __future__ import annotations

from typing import Any

from theanompi.exchange.base import OPS, Exchanger
from theanompi.registry import Registry

__all__ = ["Exchanger", "OPS", "STRATEGIES", "WHEN", "any_n_strategies", "create_exchanger"]

#: ``weight_exchange.exch_strategy``; modules are imported only when chosen. Ask a class its
#: capabilities (``STRATEGIES.get("copper").requires_power_of_two``): ``requires_power_of_two``,
#: ``implied_compression``, ``baseline``, ``reduces_by_chunks`` and ``wire_roundings(n)``
STRATEGIES: Registry[type[Exchanger]] = Registry(
    "exchanger",
    {
        "ar": "theanompi.exchange.ar:ArExchanger",
        "asa32": "theanompi.exchange.asa:Asa32Exchanger",
        "asa16": "theanompi.exchange.asa:Asa16Exchanger",
        "copper": "theanompi.exchange.copper:CopperExchanger",
        "ar_per_array": "theanompi.exchange.ar_per_array:ArPerArrayExchanger",
    },
)


def any_n_strategies() -> list[str]:
    """The strategies for training (not a benchmark's baseline) that take any number of
    ranks, in the registry's order: what a power-of-2 strategy gives way to."""
    return [
        s
        for s in STRATEGIES
        if not (STRATEGIES.get(s).requires_power_of_two or STRATEGIES.get(s).baseline)
    ]


#: ``weight_exchange.overlap`` and ``weight_exchange.hierarchical``: when the exchange runs
#: that way (``auto``: where the ranks' layout makes it pay, see ``BSP``)
WHEN = ("auto", "always", "never")


def create_exchanger(
    name: str,
    comm: Any = None,
    op: str = "mean",
    compression: str = "none",
    hierarchical: bool = False,
    **kw: Any,
) -> Exchanger:
    """The exchanger called ``name`` on ``comm`` (default ``MPI.COMM_WORLD``).

    Parameters
    ----------
    name : str
        A key of :data:`STRATEGIES` (:class:`~theanompi.errors.ConfigError` otherwise).
        ``ar`` and ``ar_per_array`` work for any N, the others need N a power of 2
        (``ConfigError`` otherwise). ``ar_per_array`` is the unfused baseline of the benchmark.
    comm : mpi4py communicator, optional
    op : {"mean", "sum"}
    compression : {"none", "fp16"}
        What travels on the wire (a key of
        :data:`~theanompi.exchange.compression.COMPRESSORS`): ``"fp16"`` sends float16
        (half the bytes; error bound in :meth:`Exchanger.error_bound`). ``asa16`` always
        sends float16; ``asa32`` with ``"fp16"`` is ``asa16``.
    hierarchical : bool
        Reduce inside each node through shared memory and run ``name`` between one leader
        per node (:class:`~theanompi.exchange.hierarchical.HierarchicalExchanger`; collective
        over ``comm``; :func:`~theanompi.exchange.hierarchical.hierarchical_wanted` decides
        ``weight_exchange.hierarchical``). Power-of-2 strategies then need 2^k nodes.
    **kw
        Strategy options (``fuse_below`` and ``segment`` for ``ar``, ``segment`` for ``copper``;
        ``node`` and ``poll_s`` with ``hierarchical``).

    Returns
    -------
    Exchanger
        Call ``.prepare(arrays)`` once, then ``.exchange(arrays)`` every step.

    Examples
    --------
    >>> create_exchanger("allreduce")
    Traceback (most recent call last):
    ...
    theanompi.errors.ConfigError: unknown exchanger 'allreduce'; choose from 'ar', 'asa32', 'asa16', 'copper', 'ar_per_array', or give package.module:Class or path/to/file.py:Class
    """
    if hierarchical:
        from theanompi.exchange.hierarchical import HierarchicalExchanger

        return HierarchicalExchanger(name, comm=comm, op=op, compression=compression, **kw)
    return STRATEGIES.get(name)(comm=comm, op=op, compression=compression, **kw)
