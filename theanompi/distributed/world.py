"""This process in the job: set-up (``init``), its place (``rank``, ``size``, ``local_rank``), and the
collectives a hand-written loop needs (``broadcast_parameters``, ``allreduce``)."""

from __future__ import annotations

import atexit
import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "init",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "broadcast_parameters",
    "allreduce",
    "REDUCE_OPS",
]

#: what :func:`allreduce` computes over the ranks
REDUCE_OPS = ("mean", "sum", "max", "min")

_ready = False
_watchdog: list[Any] = []  # the job's stall watchdog, once made (one per process)


def init() -> None:
    """Set this process up for data-parallel training; call it first, on every rank.

    What ``tmpi train`` does before it trains: PyTensor set up (float32, the C linker, the
    BLAS, this node's compile cache: :func:`theanompi.pytensor_env.configure`, also when
    ``pytensor`` was imported first), MPI started, the abort hook installed (an uncaught
    exception on one rank prints one line naming the rank and ends the whole job, exit 1),
    the launcher watched (a rank started by ``tmpi run -n N`` stops when the launcher is
    gone, and ends with 130 on its Ctrl-C) and BLAS threads set to cores / ranks on this
    node. Works under ``tmpi run -n N``, ``mpirun -n N python script.py`` or alone (one rank).

    Idempotent; collective on its first call (every rank must make it).
    """
    global _ready
    if _ready:
        return
    from theanompi.comm import install_abort_hook, local_size, world
    from theanompi.launch.launcher_watch import watch_launcher
    from theanompi.pytensor_env import configure, fit_threads_to_node

    configure()
    world()  # MPI starts here (mpi4py's import)
    install_abort_hook()
    watch_launcher()
    fit_threads_to_node(local_size())  # collective: this node's ranks, from MPI
    _ready = True


def rank() -> int:
    """This process's rank in the job (0 .. size - 1); starts MPI if nothing has."""
    from theanompi.comm import rank as _rank

    return _rank()


def size() -> int:
    """The number of ranks in the job."""
    from theanompi.comm import size as _size

    return _size()


def local_rank() -> int:
    """This rank's index among the ranks on its node (0 = the node's first): for a
    per-node resource such as a device. Calls :func:`init` first (collective once)."""
    from theanompi.comm import local_rank as _local_rank

    init()
    return _local_rank()


def local_size() -> int:
    """The number of ranks on this node. Calls :func:`init` first (collective once)."""
    from theanompi.comm import local_size as _local_size

    init()
    return _local_size()


def _shared_list(params: Any) -> list[Any]:
    """The shared variables of ``params``: a sequence, a mapping (in its order) or a model
    (its ``params``, ``opt_state`` and ``buffers``)."""
    if isinstance(params, Mapping):
        return list(params.values())
    if hasattr(params, "params") and not isinstance(params, Sequence):
        return [
            *params.params,
            *getattr(params, "opt_state", []),
            *getattr(params, "buffers", []),
        ]
    return list(params)


def broadcast_parameters(params: Any, root: int = 0, comm: Any = None) -> None:
    """Give every rank ``root``'s values of ``params``, in place (the start of training).

    Parameters
    ----------
    params
        PyTensor shared variables: a sequence, a mapping (its values in order), or a
        :class:`~theanompi.models.base.Model` (its parameters, optimiser state and buffers).
    root
        The rank whose values everyone gets.
    comm
        Default: the world.

    Raises
    ------
    ConfigError
        On every rank, when the ranks hold different lists (names, shapes or dtypes): the
        line names the rank and the parameter.
    """
    from theanompi.comm import world
    from theanompi.models.params import bcast_values, check_same_layout

    comm = world() if comm is None else comm
    vars_ = _shared_list(params)
    with _waiting("broadcast_parameters", comm):
        check_same_layout(vars_, comm, "param")
        bcast_values(vars_, comm, root=root)


def allreduce(value: Any, op: str = "mean", comm: Any = None) -> Any:
    """``op`` over the ranks of a number or a numpy array (a metric, a count); every rank
    gets the result.

    Parameters
    ----------
    value
        A Python or numpy number, or a numpy array (the same shape on every rank).
    op : {"mean", "sum", "max", "min"}
        ``mean`` is the sum divided by the number of ranks, in float64 for integers.
    comm
        Default: the world.

    Returns
    -------
    The result as the value came: a Python number for a Python number, a numpy scalar for a
    numpy scalar, a new array for an array (its dtype kept; integers become float64 for
    ``mean``, booleans int64).

    Examples
    --------
    >>> allreduce(0.25), allreduce(np.arange(3), op="sum")
    (0.25, array([0, 1, 2]))
    """
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown op {op!r}; choose from {', '.join(map(repr, REDUCE_OPS))}")
    from mpi4py import MPI

    from theanompi.comm import world

    comm = world() if comm is None else comm
    arr = np.asarray(value)
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"allreduce takes numbers or numeric arrays, got {arr.dtype} ({value!r})")
    if arr.dtype.kind == "b":
        arr = arr.astype(np.int64)
    if op == "mean" and arr.dtype.kind in "iu":
        arr = arr.astype(np.float64)
    send = np.array(arr, order="C")  # 0-d stays 0-d (ascontiguousarray would make it 1-d)
    out = np.empty_like(send)
    mpi_op = {"mean": MPI.SUM, "sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]
    with _waiting("allreduce", comm):
        comm.Allreduce(send, out, op=mpi_op)
    if op == "mean":
        out /= comm.Get_size()
    if isinstance(value, np.ndarray):
        return out
    if isinstance(value, np.generic):
        return out[()]
    return out.item()


def _stall_watchdog(timeout: float) -> Any:
    """The job's stall watchdog (:class:`~theanompi.launch.watchdog.Watchdog` over the world),
    made on the first call (collective) and closed at exit; ``None`` when ``timeout`` is 0 or
    the job has one rank. The first call's ``timeout`` holds for the process."""
    from theanompi.comm import world

    if timeout <= 0 or world().Get_size() == 1:
        return None
    if not _watchdog:
        from theanompi.launch.watchdog import Watchdog

        wd = Watchdog(world(), float(timeout)).start()
        atexit.register(wd.close)  # before mpi4py finalises MPI
        _watchdog.append(wd)
    return _watchdog[0]


@contextlib.contextmanager
def _waiting(phase: str, comm: Any) -> Iterator[None]:
    """A collective the stall watchdog watches, where there is one and ``comm`` spans the world
    (the watchdog names ranks of the world)."""
    from theanompi.comm import world

    if not _watchdog or comm.Get_size() != world().Get_size():
        yield
        return
    with _watchdog[0].waiting(phase):
        yield
