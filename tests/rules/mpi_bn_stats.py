"""Per-rank program: train a FakeModel with batch-norm-like running statistics and dump them.

``python mpi_bn_stats.py DATA RUN OUT [--resume] [--real] [section.key=value ...]``

The model (:class:`BNFakeModel`) keeps ``buffers`` (running mean and variance of the input
features, moved by momentum 0.1 towards each of this rank's batches, as BatchNorm does) and
normalises the features with them in ``predict`` (validation). It records, on every rank, the buffers
after its last training step (before the Trainer's epoch-end average), the buffers its last
validation used, the buffers at its first training step, and its final buffers; rank 0
gathers them into OUT (.npz) with the summary. ``--real``: a compiled net with two real
BatchNorm layers (``bn1`` after a conv, ``bn2`` after the pool) records the same instead.
Exits 130 when interrupted.
"""

from __future__ import annotations

import json
import sys
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


class BNFakeModel(FakeModel):
    def __init__(self, section) -> None:
        super().__init__(section)
        f = int(np.prod(self.input_shape))
        self.buffers = [
            pytensor.shared(np.zeros(f, np.float32), name="bn.mean"),
            pytensor.shared(np.ones(f, np.float32), name="bn.var"),
        ]
        self.first: list[np.ndarray] | None = None
        self.trained: list[np.ndarray] | None = None
        self.validated: list[np.ndarray] | None = None

    def _values(self) -> list[np.ndarray]:
        return [b.get_value().copy() for b in self.buffers]

    def train_step(self, x, y):
        if self.first is None:
            self.first = self._values()
        feats = x.reshape(len(x), -1).astype(np.float64) / 255
        mean, var = self.buffers
        mean.set_value((0.9 * mean.get_value() + 0.1 * feats.mean(0)).astype(np.float32))
        var.set_value((0.9 * var.get_value() + 0.1 * feats.var(0, ddof=1)).astype(np.float32))
        out = super().train_step(x, y)
        self.trained = self._values()
        return out

    def predict(self, x):
        self.validated = self._values()
        m, v = (b.get_value() for b in self.buffers)
        z = (x.reshape(len(x), -1) / 255 - m) / np.sqrt(v + 1e-5)
        return super().predict((z * 255).reshape(x.shape).astype(np.float32))


def _real_model(section):
    """A compiled net with real BatchNorm layers (conv, BN, ReLU, pool, fc), recording too."""
    from theanompi.models.base import Model
    from theanompi.models.layers import BatchNorm, Conv2D, Dense, GlobalAvgPool, ReLU, Sequential

    class TinyBN(Model):
        name = "tiny_bn"

        def build_network(self):
            net = Sequential(self.input_shape, "tiny")
            net.add(Conv2D, 6, 3, pad=1, bias=False, name="conv", rng=self.rng)
            net.add(BatchNorm, name="bn1").add(ReLU, name="relu").add(GlobalAvgPool, name="gap")
            net.add(BatchNorm, name="bn2")
            return net.add(Dense, self.n_classes, name="fc", rng=self.rng)

        def _values(self):
            return [b.get_value().copy() for b in self.buffers]

        def train_step(self, x, y):
            if self.first is None:
                self.first = self._values()
            out = super().train_step(x, y)
            self.trained = self._values()
            return out

        def predict(self, x):
            self.validated = self._values()
            return super().predict(x)

    m = TinyBN(section)
    m.first = m.trained = m.validated = None
    return m


def main(argv: list[str]) -> int:
    install_abort_hook()
    data, run, out, *rest = argv
    flags, over = job_args(rest)
    comm = MPI.COMM_WORLD
    cfg = tiny_config(Path(data), Path(run), **over)
    model = _real_model(cfg.model) if "--real" in flags else BNFakeModel(cfg.model)
    try:
        summary = train_run(cfg, comm=comm, resume="--resume" in flags, model=model)
    except UserError as err:
        if comm.Get_rank() == 0:
            print(f"tmpi: error: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    none = [np.full(b.get_value().shape, np.nan, np.float32) for b in model.buffers]
    mine = {
        "first": model.first or none,
        "trained": model.trained or none,
        "validated": model.validated or none,
        "final": model._values(),
    }
    everyone = comm.gather(mine, root=0)
    if comm.Get_rank() == 0:
        arrays = {
            f"r{r}_{k}_{i}": a
            for r, d in enumerate(everyone)
            for k, vs in d.items()
            for i, a in enumerate(vs)
        }
        np.savez(out, summary=np.array(json.dumps(summary, default=str)), **arrays)
    return 130 if summary.get("interrupted") else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
