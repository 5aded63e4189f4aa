"""Per-rank program for the numerical-guard test: BSP on the tiny dataset with the numpy
FakeModel, one rank's weights poisoned with a nan after a chosen step (a real nan that the
exchange then spreads), through the real loop under real mpirun.

``python mpi_guard.py DATA RUN RANK STEP [section.key=value ...]``; exits with the error's code.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rules"))

from theanompi.pytensor_env import configure  # noqa: E402

configure()

import numpy as np  # noqa: E402
import yaml  # noqa: E402
from _fake_model import FakeModel  # noqa: E402
from _train_data import tiny_config  # noqa: E402
from mpi4py import MPI  # noqa: E402

from theanompi.comm import install_abort_hook  # noqa: E402
from theanompi.errors import UserError  # noqa: E402
from theanompi.train.run import run as train_run  # noqa: E402


class PoisonedModel(FakeModel):
    """FakeModel whose weights become nan after ``step`` train steps on ``rank``."""

    def __init__(self, section, rank: int, step: int) -> None:
        super().__init__(section)
        self.poison_rank, self.poison_step, self.steps = rank, step, 0

    def build(self, batch_size: int, backend: str = "c") -> PoisonedModel:
        super().build(batch_size)
        return self

    def train_step(self, x, y):
        out = super().train_step(x, y)
        self.steps += 1
        if self.steps == self.poison_step and MPI.COMM_WORLD.Get_rank() == self.poison_rank:
            w = self.params[0].get_value()
            w.flat[0] = np.nan
            self.params[0].set_value(w)
        return out


def main(argv: list[str]) -> int:
    install_abort_hook()
    data, run, rank, step, *rest = argv
    over = {k: yaml.safe_load(v) for k, v in (a.split("=", 1) for a in rest)}
    cfg = tiny_config(Path(data), Path(run), **over)
    model = PoisonedModel(cfg.model, int(rank), int(step))
    try:
        train_run(cfg, comm=MPI.COMM_WORLD, model=model)
    except UserError as err:
        if MPI.COMM_WORLD.Get_rank() == 0 or not err.agreed:
            print(f"tmpi: error: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
