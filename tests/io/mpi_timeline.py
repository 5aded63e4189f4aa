"""Per-rank program for the timeline tests: a fake training loop that records its spans.

``python mpi_timeline.py TRACE [--server] [--late-rank=R]``

Every worker runs 5 steps of ``compute`` (a short sleep), ``exchange`` (a real
``Allreduce``) and ``wait``, then one ``validate`` and one ``checkpoint``; after a final
``Barrier`` each rank adds a zero-length ``mark`` span, so the test can check that all
ranks share one time axis. ``--server``: the last rank records nothing (like an EASGD
server): it only constructs and closes. ``--late-rank=R``: rank R reaches the Timeline
constructor 0.5 s after the others. A ``ConfigError`` prints one line from rank 0 and exits 2.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from theanompi.comm import install_abort_hook  # noqa: E402
from theanompi.errors import UserError  # noqa: E402
from theanompi.io.timeline import Timeline  # noqa: E402


def main(argv: list[str]) -> int:
    install_abort_hook()
    trace, *flags = argv
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    server = "--server" in flags and rank == size - 1
    late = next((int(f.split("=")[1]) for f in flags if f.startswith("--late-rank=")), -1)
    if rank == late:
        time.sleep(0.5)
    try:
        tl = Timeline(trace if rank == 0 else None, comm, label="server" if server else None)
    except UserError as err:
        if rank == 0:
            print(f"tmpi: error: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    workers = comm.Split(0 if not server else MPI.UNDEFINED, rank)
    if not server:
        buf = np.ones(1000, np.float64)
        for step in range(5):
            with tl.span("compute", step=step):
                time.sleep(0.002 * (rank + 1))
            t0 = MPI.Wtime()
            workers.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            tl.add("exchange", t0, MPI.Wtime(), step=step)
            with tl.span("wait"):
                pass
        with tl.span("validate", {"epoch": 0}):
            time.sleep(0.001)
        with tl.span("checkpoint", {"epoch": 0}):
            pass
        workers.Free()
    comm.Barrier()
    t = MPI.Wtime()
    if not server:
        tl.add("mark", t, t)
    tl.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
