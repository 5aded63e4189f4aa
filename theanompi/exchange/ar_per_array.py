"""``ar_per_array``: one ``MPI.Allreduce`` per array, as Theano-MPI's ``ar`` did (baseline)."""

from __future__ import annotations

import numpy as np

from theanompi.exchange.base import Exchanger

__all__ = ["ArPerArrayExchanger"]


class ArPerArrayExchanger(Exchanger):
    """Baseline for the benchmark: ``Allreduce`` every array on its own, then divide for mean.

    Parameters
    ----------
    comm, op
        See :class:`~theanompi.exchange.base.Exchanger`.
    """

    name = "ar_per_array"

    def allreduce(self, buf: np.ndarray) -> None:
        """``MPI.Allreduce(IN_PLACE, buf, SUM)`` on a contiguous buffer."""
        from mpi4py import MPI

        self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    def _exchange(self, arrays: list[np.ndarray]) -> None:
        for a in arrays:
            buf = a if a.flags.c_contiguous and a.flags.writeable else np.ascontiguousarray(a)
            self.allreduce(buf)
            if self.op == "mean":
                np.divide(buf, np.float32(self.size), out=buf)
            if buf is not a:
                np.copyto(a, buf)
