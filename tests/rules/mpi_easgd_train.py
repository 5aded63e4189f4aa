"""Per-rank program: train with EASGD (rank 0 server, ranks 1..N workers) and dump the summary.

``python mpi_easgd_train.py DATA RUN OUT [--fake] [section.key=value ...]``

``--fake``: the numpy FakeModel on a tiny dataset (tests/_train_data.py); otherwise the model
config ``training.model`` (default ``digits``: small_cnn) on a prep output folder. Rank 0 writes
OUT (JSON): the summary plus every worker's final params digest. Exit 130 when interrupted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from theanompi.pytensor_env import configure  # noqa: E402

configure()

from _train_data import job_args  # noqa: E402
from mpi4py import MPI  # noqa: E402

from theanompi.comm import install_abort_hook  # noqa: E402
from theanompi.errors import UserError  # noqa: E402
from theanompi.train.run import run as train_run  # noqa: E402


def main(argv: list[str]) -> int:
    install_abort_hook()
    data, run, out, *rest = argv
    flags, over = job_args(rest)
    over.setdefault("weight_exchange.sync_rule", "EASGD")
    comm = MPI.COMM_WORLD
    model = None
    try:
        if "--fake" in flags:
            from _fake_model import FakeModel
            from _train_data import tiny_config

            cfg = tiny_config(Path(data), Path(run), **over)
            model = FakeModel(cfg.model)
        else:
            from theanompi.config import load_config

            man = json.loads((Path(data) / "misc" / "manifest.json").read_text())
            base = {
                "data.dir": data,
                "output.run_dir": run,
                "data.file_batch_size": man["batch_size"],
                "data.image_size": man["size"],
                "data.layout": man["layout"],
            }
            cfg = load_config(None, None, {**base, **over})
        summary = train_run(cfg, comm=comm, resume="--resume" in flags, model=model)
    except UserError as err:
        if comm.Get_rank() == 0:
            print(f"tmpi: error: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    if comm.Get_rank() == 0:
        Path(out).write_text(json.dumps(summary, default=str))
    return 130 if summary.get("interrupted") else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
