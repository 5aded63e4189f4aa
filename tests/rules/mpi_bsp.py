"""Per-rank program: run BSP on a tiny dataset and dump the final state.

``python mpi_bsp.py DATA RUN OUT [--resume] [--skew] [--slow] [section.key=value ...]``

Runs ``theanompi.train.run.run`` (rule BSP) with the numpy FakeModel, then rank 0 writes OUT (.npz): every rank's params and
optimizer state (gathered), and the summary as JSON. ``--skew`` gives rank 1 a
model with an extra parameter (the start-up layout check must refuse it); ``--slow`` makes
rank 1's gradients take :data:`SLOW_S` longer (a straggler).
Exits 130 when the run was interrupted.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from theanompi.pytensor_env import configure  # noqa: E402

configure()

import numpy as np  # noqa: E402
import pytensor  # noqa: E402
from _fake_model import FakeModel  # noqa: E402
from _train_data import job_args, tiny_config  # noqa: E402
from mpi4py import MPI  # noqa: E402

from theanompi.comm import install_abort_hook  # noqa: E402
from theanompi.errors import UserError  # noqa: E402
from theanompi.train.run import run as train_run  # noqa: E402

SLOW_S = 0.15


def main(argv: list[str]) -> int:
    install_abort_hook()
    data, run, out, *rest = argv
    flags, over = job_args(rest)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    cfg = tiny_config(Path(data), Path(run), **over)
    model = FakeModel(cfg.model)
    if "--skew" in flags and rank == 1:
        model.params.append(pytensor.shared(np.zeros(3, np.float32), name="extra.b"))
    if "--slow" in flags and rank == 1:
        grads = model._grads

        def slow_grads(x: np.ndarray, y: np.ndarray) -> tuple:
            time.sleep(SLOW_S)
            return grads(x, y)

        model._grads = slow_grads
    try:
        summary = train_run(cfg, comm=comm, resume="--resume" in flags, model=model)
    except UserError as err:
        if rank == 0:
            print(f"tmpi: error: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    vals = [p.get_value() for p in model.params] + [v.get_value() for v in model.opt_state]
    everyone = comm.gather(vals, root=0)
    if rank == 0:
        arrays = {f"r{r}_{i}": a for r, vs in enumerate(everyone) for i, a in enumerate(vs)}
        np.savez(out, summary=np.array(json.dumps(summary, default=str)), **arrays)
    return 130 if summary.get("interrupted") else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
