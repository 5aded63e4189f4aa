"""MPI helpers: rank-0 logging, abort-on-exception, set-up errors reported once, this rank's node, the rank before MPI starts."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

ALIKE_ERROR_GRACE_S = 10.0  # see let_rank0_report
#: Open MPI settings for a quick start, unless set: the wheel's libfabric BTL sleeps 1 s in
#: ``MPI_Init`` on a machine without a fabric (strace: ``clock_nanosleep`` of 1 s after its
#: provider scan; ``MPI_Init`` 1.08 -> 0.08 s). The shared-memory and TCP BTLs carry every
#: message of ours; set ``OMPI_MCA_btl`` where libfabric's BTL is your network
MPI_START_ENV = {"OMPI_MCA_btl": "^ofi"}

__all__ = [
    "world",
    "rank",
    "size",
    "is_root",
    "log",
    "local_rank_from_env",
    "rank_from_env",
    "let_rank0_report",
    "collective",
    "under_mpirun",
    "quick_singleton_start",
    "install_abort_hook",
    "is_power_of_two",
    "node_comm",
    "local_rank",
    "local_size",
    "host_layout",
    "describe_hosts",
    "made",
    "revoke_made",
    "is_rank_failure",
    "set_world",
    "exit_if_shrunk",
]


def under_mpirun() -> bool:
    """True when this process was started by mpirun/mpiexec (Open MPI or MPICH/Hydra)."""
    return any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))


def quick_singleton_start() -> None:
    """:data:`MPI_START_ENV` for a process started without a launcher (an MPI singleton: no
    peers, no network), before it starts MPI; a launched rank keeps its launcher's settings."""
    if not under_mpirun() and "SLURM_PROCID" not in os.environ:
        for var, value in MPI_START_ENV.items():
            os.environ.setdefault(var, value)


def rank_from_env() -> int:
    """World rank, readable before ``MPI.Init`` (0 outside mpirun)."""
    for key in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def let_rank0_report() -> None:
    """Before exiting on an error that every rank meets alike before MPI starts (a bad flag):
    on ranks other than 0, wait, so that rank 0 prints the one line and exits first.

    Whichever rank exits non-zero first makes mpirun kill the others, so without the wait
    rank 0 could be killed before its line is out. Normally rank 0's exit ends the wait
    (mpirun kills the waiting ranks); should rank 0 not fail at all, the wait ends after
    ``ALIKE_ERROR_GRACE_S`` and the non-zero exit still stops the job instead of leaving
    rank 0 waiting for the others in ``MPI.Init``.
    """
    if rank_from_env() != 0:
        time.sleep(ALIKE_ERROR_GRACE_S)


def collective(comm: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` on every rank of ``comm``; if it raises a ``UserError`` on
    any rank, rank 0 raises it (one line from the CLI) and the other ranks exit with its code.

    For set-up steps that fail alike on all ranks (missing files, a wrong checkpoint), so
    that the user sees one error line instead of one per rank: the twin, once MPI runs, of
    :func:`let_rank0_report`.
    """
    from theanompi.errors import ConfigError, DataError, UserError

    try:
        out, err = fn(*args, **kwargs), None
    except UserError as e:
        out, err = None, e
    info = None if err is None else (type(err).__name__, str(err), err.exit_code)
    failed = [i for i in comm.allgather(info) if i is not None]
    if not failed:
        return out
    if comm.Get_rank() == 0:
        if err is not None:
            raise err
        name, msg, _ = failed[0]
        raise (DataError if name == "DataError" else ConfigError)(msg)
    raise SystemExit(failed[0][2])


def local_rank_from_env() -> int:
    """Rank on this node, readable before ``MPI.Init`` (used for per-rank caches)."""
    for key in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


def local_size_from_env() -> int:
    """Ranks on this node, readable before ``MPI.Init`` (used to split BLAS threads)."""
    for key in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"):
        if key in os.environ:
            return int(os.environ[key])
    return 1


_WORLD: Any = None  # the world left after an elastic shrink (set_world); None: COMM_WORLD
_MADE: list[Any] = []  # the communicators this process made on it (made), revoked together


def world() -> Any:
    """``MPI.COMM_WORLD`` (imported lazily so that ``tmpi --help`` does not start MPI), or,
    after an elastic shrink, the communicator of the ranks left (:func:`set_world`)."""
    if _WORLD is not None:
        return _WORLD
    from mpi4py import MPI

    return MPI.COMM_WORLD


def set_world(comm: Any) -> None:
    """After an elastic shrink (ULFM): ``comm``, the ranks left, is the job's world from now on
    for :func:`world` (COMM_WORLD still holds the lost ranks: a collective on it fails)."""
    global _WORLD
    _WORLD = comm


def exit_if_shrunk(code: Any) -> None:
    """After an elastic shrink (:func:`set_world`): meet the ranks left, then end this process
    with ``code`` (``sys.exit``'s) without ``MPI_Finalize``, which waits for the lost ranks
    for ever when rank 0 of COMM_WORLD is one of them (Open MPI 5.0 with ULFM; measured)."""
    if _WORLD is None:
        return
    try:
        _WORLD.Barrier()
    except Exception:  # noqa: BLE001 - another loss at the very end: exit all the same
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


def made(comm: Any) -> Any:
    """``comm``, a communicator this process made (a ``Dup``, a ``Split``), kept so that
    :func:`revoke_made` reaches it; returns it."""
    _MADE.append(comm)
    return comm


def revoke_made() -> None:
    """ULFM: revoke every communicator :func:`made` kept, so that a rank waiting in any of them
    for a peer that left the collective (not only for the lost rank) gets ``ERR_REVOKED``
    instead of waiting for ever; then forget them. Each ``Revoke`` is local and quick."""
    while _MADE:
        comm = _MADE.pop()
        try:
            comm.Revoke()
        except Exception:  # noqa: BLE001 - freed already, or revoked by a peer first
            pass


def is_rank_failure(err: BaseException, comm: Any) -> bool:
    """``err``, raised by an operation on ``comm``, is an MPI error that a lost peer explains:
    ULFM's ``ERR_PROC_FAILED`` (or its pending form), ``ERR_REVOKED``, or any other class once
    ``comm`` is revoked or knows of a failed rank (a nonblocking collective under way when a
    peer failed can report ``MPI_ERR_OTHER``)."""
    from mpi4py import MPI

    if not isinstance(err, MPI.Exception):
        return False
    names = ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
    if err.Get_error_class() in {getattr(MPI, n, None) for n in names} - {None}:
        return True
    try:
        return bool(comm.Is_revoked() or comm.Get_failed().Get_size())
    except Exception:  # noqa: BLE001 - an MPI without ULFM: no lost peer to explain it
        return False


def rank() -> int:
    return world().Get_rank()


def size() -> int:
    return world().Get_size()


def is_root() -> bool:
    return rank() == 0


def log(*args: Any, all_ranks: bool = False, **kwargs: Any) -> None:
    """Print from rank 0 only (or every rank, prefixed, with ``all_ranks=True``); flushes."""
    r = rank() if ("mpi4py.MPI" in sys.modules or under_mpirun()) else 0
    if all_ranks:
        print(f"[rank {r}]", *args, **kwargs, flush=True)
    elif r == 0:
        print(*args, **kwargs, flush=True)


_NODE_COMMS: dict[int, Any] = {}


def node_comm(comm: Any = None) -> Any:
    """The ranks of ``comm`` (default: the world) that share this rank's node (its memory),
    from MPI (``Split_type(COMM_TYPE_SHARED)``), not from a launcher's environment.

    Collective over ``comm`` on the first call for it; cached afterwards.
    """
    from mpi4py import MPI

    comm = world() if comm is None else comm
    key = comm.py2f()
    if key not in _NODE_COMMS:
        _NODE_COMMS[key] = made(comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank()))
    return _NODE_COMMS[key]


def local_rank(comm: Any = None) -> int:
    """This rank's index among the ranks of ``comm`` on its node (0 = the node's first)."""
    return node_comm(comm).Get_rank()


def local_size(comm: Any = None) -> int:
    """How many ranks of ``comm`` share this rank's node."""
    return node_comm(comm).Get_size()


def host_layout(comm: Any = None) -> list[tuple[str, list[int]]]:
    """``[(hostname, [ranks...]), ...]`` in order of each host's first rank (collective)."""
    import socket

    comm = world() if comm is None else comm
    names = comm.allgather(socket.gethostname())
    layout: dict[str, list[int]] = {}
    for r, name in enumerate(names):
        layout.setdefault(name, []).append(r)
    return list(layout.items())


def _ranks_text(ranks: list[int]) -> str:
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1:
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def describe_hosts(comm: Any = None) -> str:
    """The start-up line: ``4 ranks on 2 hosts: nodea x2 (ranks 0-1), nodeb x2 (ranks 2-3)``
    (collective)."""
    comm = world() if comm is None else comm
    layout = host_layout(comm)
    hosts = ", ".join(f"{h} x{len(rs)} ({_ranks_text(rs)})" for h, rs in layout)
    n = comm.Get_size()
    ranks = f"{n} rank{'s' if n > 1 else ''}"
    return f"{ranks} on {len(layout)} host{'s' if len(layout) > 1 else ''}: {hosts}"


def is_power_of_two(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def install_abort_hook() -> None:
    """Make an uncaught exception on any rank (or thread) stop the whole job.

    Without this, one rank dies while the others wait forever in a collective.
    The hook prints one line naming the rank and the cause, then calls
    ``MPI.COMM_WORLD.Abort``, which mpirun turns into a prompt job-wide exit.
    """
    from theanompi.errors import EXIT_FAILURE, UserError

    def abort(exc_type: type, exc: BaseException, tb: Any) -> None:
        comm = world()
        code = exc.exit_code if isinstance(exc, UserError) else EXIT_FAILURE
        if isinstance(exc, KeyboardInterrupt):
            code = 130
        if not isinstance(exc, (UserError, KeyboardInterrupt)):
            sys.__excepthook__(exc_type, exc, tb)
        msg = str(exc) if isinstance(exc, UserError) else _one_line(exc)
        print(
            f"tmpi: error on rank {comm.Get_rank()}/{comm.Get_size()}: {msg}",
            file=sys.stderr,
            flush=True,
        )
        if comm.Get_size() > 1:
            comm.Abort(code)
        os._exit(code)

    def thread_abort(args: threading.ExceptHookArgs) -> None:
        abort(args.exc_type, args.exc_value, args.exc_traceback)  # type: ignore[arg-type]

    sys.excepthook = abort
    threading.excepthook = thread_abort
