"""``ar_per_array``: one ``MPI.Allreduce`` per array, as Theano-MPI's ``ar`` did (baseline)."""

from __future__ import annotations

import numpy as np

from theanompi.exchange.base import Exchanger

__all__ = ["ArPerArrayExchanger"]


class ArPerArrayExchanger(Exchanger):
    """Baseline for the benchmark: ``Allreduce`` every array on its own, then divide for mean.

    With a compression that cannot work in place, each array is compressed into its own
    wire buffer first, reduced with the compressor's ``MPI.Op``, and decompressed back.

    Parameters
    ----------
    comm, op, compression
        See :class:`~theanompi.exchange.base.Exchanger`.
    """

    name = "ar_per_array"
    baseline = True

    def _prepare(self, arrays: list[np.ndarray]) -> None:
        c = self.compressor
        self._wire = None if c.in_place else [c.empty(a.size) for a in arrays]
        self._op = c.mpi_sum() if self.size > 1 else None

    def allreduce(self, buf: np.ndarray) -> None:
        """``MPI.Allreduce(IN_PLACE, buf, op)``: the compressor's sum of a contiguous wire buffer."""
        from mpi4py import MPI

        self.comm.Allreduce(MPI.IN_PLACE, buf, op=self._op)

    def _exchange(self, arrays: list[np.ndarray]) -> None:
        c = self.compressor
        for i, a in enumerate(arrays):
            if self._wire is not None:
                c.compress(a, self._wire[i])
                self.allreduce(self._wire[i])
                c.decompress(self._wire[i], a)
                continue
            buf = a if a.flags.c_contiguous and a.flags.writeable else np.ascontiguousarray(a)
            self.allreduce(buf)
            c.decompress(buf, buf)  # float32: the mean's division, in place
            if buf is not a:
                np.copyto(a, buf)
