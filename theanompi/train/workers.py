"""The workers' communicator as the training loop uses it: their ranks in the job, the watched waits and the loop's small collectives."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from theanompi.launch.watchdog import Watchdog
from theanompi.models.params import ParamBuffer

__all__ = ["Workers", "wtime"]


def wtime() -> float:
    """``MPI.Wtime()`` (seconds)."""
    from mpi4py import MPI

    return MPI.Wtime()


def _job_ranks(comm: Any, world: Any) -> list[int]:
    """The ranks of ``comm``'s members in ``world`` (the watchdog and the errors name ranks
    of the job; the workers' communicator may be smaller: EASGD's server is not in it)."""
    size = comm.Get_size()
    if world is None or world is comm or world.Get_size() == size:
        return list(range(size))
    from mpi4py import MPI

    got = MPI.Group.Translate_ranks(comm.Get_group(), list(range(size)), world.Get_group())
    return [int(r) for r in got]


class Workers:
    """The ranks that train together, on ``comm``, inside the job's ``world``.

    Every collective here is a buffer ``Allreduce``: a first pickled ``allreduce`` on a
    communicator holds the GIL while it waits, which would starve the watchdog's thread.

    Parameters
    ----------
    comm
        The workers' communicator (``rule.worker_comm``).
    world
        The job's communicator (``rule.world``; default: ``comm``).
    watchdog
        The job's :class:`~theanompi.launch.watchdog.Watchdog` (default: a disabled one).
    """

    def __init__(self, comm: Any, world: Any = None, watchdog: Watchdog | None = None) -> None:
        self.comm, self.world = comm, world
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        #: job rank of each worker
        self.peers = _job_ranks(comm, world)
        self.watchdog = watchdog if watchdog is not None else Watchdog(comm, 0)

    def waiting(self, phase: str, collective: bool = True) -> AbstractContextManager[None]:
        """Context: a wait the watchdog watches, a collective over the workers by default."""
        peers = self.peers if collective else None
        return self.watchdog.waiting(phase, peers, collective=collective)

    def _allreduce(self, mine: np.ndarray, op: str) -> np.ndarray:
        if self.size == 1:
            return mine
        from mpi4py import MPI

        out = np.empty_like(mine)
        self.comm.Allreduce(mine, out, op=getattr(MPI, op))
        return out

    def min(self, values: Sequence[int]) -> np.ndarray:
        """Collective: the elementwise minimum of int64 ``values`` over the workers."""
        return self._allreduce(np.asarray(values, dtype=np.int64), "MIN")

    def sum(self, n: int) -> int:
        """Collective: ``n`` summed over the workers."""
        return int(self._allreduce(np.array([n], np.int64), "SUM")[0])

    def average_buffers(self, model: Any) -> None:
        """Collective: replace every worker's ``model.buffers`` (batch-norm running
        statistics, updated by each rank's own batches) by their mean over the workers,
        summed in float64 in one ``Allreduce``, so that validation and checkpoints see one set
        of statistics under every rule (EASGD: the workers' mean beside the centre's
        parameters; GOSGD: the mean of all ranks)."""
        bufs = list(getattr(model, "buffers", []) or [])
        if not bufs or self.size == 1:
            return
        flat = ParamBuffer(bufs)
        total = self._allreduce(flat.gather().astype(np.float64), "SUM")
        flat.scatter(total / self.size)

    def abort(self, err: Exception) -> None:
        """This rank met an error the others cannot know of: one line, then end the whole
        job with the error's exit code (a plain exit would leave the others in a collective)."""
        print(f"tmpi: error on rank {self.rank}: {err}", file=sys.stderr, flush=True)
        if self.world is not None and self.world.Get_size() > 1:
            self.world.Abort(getattr(err, "exit_code", 1))

    def end_beside_servers(self, err: Exception) -> None:
        """An error every worker raises: where the job has serving ranks (EASGD), which wait
        for requests that will not come, end the job; worker 0 reports, the others wait for
        its abort to stop them. A job of workers only returns (the error is raised)."""
        if self.world is None or self.world.Get_size() == self.size:
            return
        code = getattr(err, "exit_code", 1)
        if self.rank == 0:
            print(f"tmpi: error: {err}", file=sys.stderr, flush=True)
            self.world.Abort(code)
        time.sleep(10)
        self.world.Abort(code)
