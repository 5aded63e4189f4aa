"""Blocking MPI calls that wait by testing and sleeping outside the GIL, instead of spinning.

Open MPI waits for a request by running its progress engine in a loop: a communication
thread inside a blocking collective keeps a core busy for the whole exchange. Beside a
backward pass on the same cores that doubled the step's compute (two simulated nodes,
``tmpi bench cluster``: 118 -> 256 ms). :class:`PollingComm` starts the nonblocking call
instead and :func:`wait` waits for it in a compiled loop that holds no GIL: it asks
``MPI_Request_get_status`` (which drives Open MPI's progress once and leaves the request
alone), sleeps ``poll_us`` microseconds when the request is not complete, and asks again;
mpi4py's ``Wait`` then completes the request. The loop is numba (``nogil``), calling the
MPI library through ``ctypes`` pointers; where the library cannot be found (no
``/proc/self/maps``), :func:`wait` is mpi4py's own ``Wait``.
"""

from __future__ import annotations

import ctypes
import functools
import time
from typing import Any

import numpy as np

__all__ = ["PollingComm", "POLL_US", "wait", "wait_idle"]

#: microseconds between two progress calls while a request is not complete: a 1 Gbit link
#: moves 12 KB in 100 us, well under a TCP socket buffer, so the wire stays busy
POLL_US = 100
_STATUS_BYTES = 64  # more than MPI_Status in Open MPI (24) or MPICH (20); never read


def _libmpi() -> ctypes.CDLL | None:
    """The MPI library mpi4py loaded (found in this process's memory map), or None."""
    from mpi4py import MPI  # noqa: F401 - loads the library

    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "/libmpi.so" in path or "/libmpich.so" in path:
                    return ctypes.CDLL(path)
    except OSError:
        return None
    return None


@functools.cache
def _poller() -> Any:
    """The compiled ``poll(handle, flag, flag_addr, status_addr, us)`` loop, or None."""
    lib = _libmpi()
    if lib is None or not hasattr(lib, "MPI_Request_get_status"):
        return None
    import numba

    # pointers and handles travel as size_t: the same registers as void * on every 64-bit ABI
    size_t = ctypes.c_size_t
    get_status = lib.MPI_Request_get_status
    get_status.argtypes, get_status.restype = (size_t, size_t, size_t), ctypes.c_int
    usleep = ctypes.CDLL(None).usleep
    usleep.argtypes, usleep.restype = (ctypes.c_uint,), ctypes.c_int

    @numba.njit(nogil=True)
    def poll(handle: Any, flag: Any, flag_addr: Any, status_addr: Any, us: Any) -> None:
        while True:  # pragma: no cover - compiled
            get_status(handle, flag_addr, status_addr)
            if flag[0]:
                return
            usleep(us)

    return poll


def wait(request: Any, poll_us: int = POLL_US) -> None:
    """Complete an mpi4py ``request``, sleeping ``poll_us`` between progress calls, GIL free."""
    poll = _poller()
    handle = getattr(request, "handle", None)
    if poll is not None and handle is not None:
        flag = np.zeros(1, np.int32)
        status = np.zeros(_STATUS_BYTES, np.uint8)
        poll(handle, flag, flag.ctypes.data, status.ctypes.data, poll_us)
    request.Wait()


def wait_idle(request: Any, poll_us: int = POLL_US) -> None:
    """Complete ``request`` from a thread with nothing else to do (a rank at a barrier):
    ``Test``, sleep ``poll_us``, ``Test``. A Python loop, so nothing to compile (:func:`wait`'s
    loop costs ~0.5 s a process the first time); it needs the GIL between its sleeps, which
    only a compiled step beside it would keep from it."""
    while not request.Test():
        time.sleep(poll_us / 1e6)


class PollingComm:
    """``comm`` whose blocking calls (those the exchangers make) wait with :func:`wait`.

    Everything else is ``comm``'s own; :meth:`Split`, :meth:`Split_type` and :meth:`Dup`
    return polling communicators too. For a thread that exchanges while another computes, and
    for a rank that waits for a late one that may share its core (BSP's barrier before a
    serial exchange); a serial exchange itself would rather spin (nothing else to do).
    """

    def __init__(self, comm: Any, poll_us: int = POLL_US) -> None:
        self.comm, self.poll_us = comm, int(poll_us)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.comm, name)

    def __repr__(self) -> str:
        return f"PollingComm({self.comm!r}, poll_us={self.poll_us})"

    def _wait(self, request: Any) -> None:
        wait(request, self.poll_us)

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = None) -> None:  # noqa: N802
        from mpi4py import MPI

        self._wait(self.comm.Iallreduce(sendbuf, recvbuf, MPI.SUM if op is None else op))

    def Alltoall(self, sendbuf: Any, recvbuf: Any) -> None:  # noqa: N802
        self._wait(self.comm.Ialltoall(sendbuf, recvbuf))

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> None:  # noqa: N802
        self._wait(self.comm.Iallgather(sendbuf, recvbuf))

    def Bcast(self, buf: Any, root: int = 0) -> None:  # noqa: N802
        self._wait(self.comm.Ibcast(buf, root))

    def Barrier(self) -> None:  # noqa: N802
        self._wait(self.comm.Ibarrier())

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:  # noqa: N802
        self._wait(self.comm.Isend(buf, dest, tag))

    def Recv(self, buf: Any, source: int, tag: int = 0) -> None:  # noqa: N802
        self._wait(self.comm.Irecv(buf, source, tag))

    def _polling(self, comm: Any) -> Any:
        from mpi4py import MPI

        return comm if comm == MPI.COMM_NULL else PollingComm(comm, self.poll_us)

    def Split(self, color: int = 0, key: int = 0) -> Any:  # noqa: N802
        return self._polling(self.comm.Split(color, key))

    def Split_type(self, split_type: int, key: int = 0, info: Any = None) -> Any:  # noqa: N802
        from mpi4py import MPI

        return self._polling(self.comm.Split_type(split_type, key, info or MPI.INFO_NULL))

    def Dup(self) -> Any:  # noqa: N802
        return self._polling(self.comm.Dup())
