"""Per-rank program: train with crafted predictions, then ``tmpi eval`` the last checkpoint.

``mpirun -n N python tests/models/mpi_metrics_agree.py DATA RUN OUT_JSON``

Trains :class:`CraftedModel` with ``theanompi.train.run.run`` on all ranks, then evaluates the
checkpoint of the record's last epoch with ``theanompi.train.evaluate.run`` on all ranks (N) and on
rank 0 alone (N=1). Rank 0 writes OUT_JSON: the record's last epoch entry, both eval
reports, and how many val images hit each crafted case (counted here with plain numpy).

The model's ``predict`` depends on the image id (``_train_data.image_ids``): ids ``% 6`` in
0..3 get crafted float32 probabilities (true class underflowed to exactly 0 with three
non-zero classes; true class tied at the top-1; tied at the 5th place; all classes equal),
the others the trained softmax regression (so eval must load the checkpoint to agree).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rules"))

from theanompi.pytensor_env import configure  # noqa: E402

configure()

import numpy as np  # noqa: E402
from _fake_model import FakeModel  # noqa: E402
from _train_data import image_ids, tiny_config  # noqa: E402
from mpi4py import MPI  # noqa: E402

K = 10
OVERRIDES = {"model.n_classes": K, "model.n_epochs": 2}


def crafted_row(case: int, y: int) -> np.ndarray | None:
    """Float32 probabilities for the true class ``y`` in crafted ``case`` (None: not crafted)."""
    others = [c for c in range(K) if c != y]
    if case == 0:  # a float32 softmax where the true class underflows to exactly 0
        z = np.full(K, -200.0, np.float32)
        z[others[:3]] = (2.0, 1.5, 1.0)
        e = np.exp(z - z.max())
        return (e / e.sum()).astype(np.float32)
    p = np.zeros(K, np.float32)
    if case == 1:  # tied with the top: lower index ranks above
        tie = y - 1 if y > 0 else y + 1
        p[:] = 0.05
        p[[y, tie]] = 0.3
        return p
    if case == 2:  # four strictly above, tied at the 5th place
        tie = y - 1 if y > 0 else y + 1
        rest = [c for c in others if c != tie]
        p[rest[:4]] = 0.15
        p[rest[4:]] = 0.05
        p[[y, tie]] = 0.1
        return p
    if case == 3:  # every class equal: the true class ranks y-th
        return np.full(K, 0.1, np.float32)
    return None


class CraftedModel(FakeModel):
    """``FakeModel`` whose ``predict`` is crafted for 4 of every 6 val images."""

    def predict(self, x: np.ndarray) -> np.ndarray:
        p = super().predict(x)
        ids = image_ids(x)
        labels = np.clip(np.rint((x[:, 2].mean(axis=(1, 2)) - 40.0) / 20.0), 0, K - 1)
        for i, (img, y) in enumerate(zip(ids, labels.astype(int), strict=True)):
            row = crafted_row(int(img) % 6, int(y))
            if row is not None:
                p[i] = row
        return p


def case_counts(model: Any, cfg: Any) -> dict[str, int]:
    """Val images whose crafted case decides the outcome, counted with plain numpy."""
    from theanompi.data import ValLoader

    n = {"images": 0, "zero_true_prob": 0, "tie_decides_top1": 0, "tie_decides_top5": 0}
    with ValLoader(cfg, 0, 1).batches() as it:
        for x, y in it:
            keep = y >= 0
            p, t = model.predict(x)[keep], y[keep].astype(int)
            py = p[np.arange(len(t)), t]
            strict = (p > py[:, None]).sum(axis=1)
            pos = np.argmax(np.argsort(-p, axis=1, kind="stable") == t[:, None], axis=1)
            n["images"] += len(t)
            n["zero_true_prob"] += int((py == 0).sum())
            n["tie_decides_top1"] += int(((strict < 1) & (pos >= 1)).sum())
            n["tie_decides_top5"] += int(((strict < 5) & (pos >= 5)).sum())
    return n


def main(argv: list[str]) -> int:
    from theanompi.comm import install_abort_hook
    from theanompi.io.record import read_record
    from theanompi.train import evaluate as tmpi_eval
    from theanompi.train.run import run as train_run

    install_abort_hook()
    data, run, out = (Path(a) for a in argv)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    cfg = tiny_config(data, run, **OVERRIDES)
    summary = train_run(cfg, comm=comm, model=CraftedModel(cfg.model))
    last = None
    if rank == 0:
        last = [r for r in read_record(cfg.output.record_dir) if r.get("kind") == "epoch"][-1]
    last = comm.bcast(last, root=0)
    ckpt = last["checkpoint"]
    rep_n = tmpi_eval.run(
        cfg, checkpoint=ckpt, model=CraftedModel(cfg.model), comm=comm, quiet=True
    )
    if rank == 0:
        model1 = CraftedModel(cfg.model)
        rep_1 = tmpi_eval.run(cfg, checkpoint=ckpt, model=model1, comm=MPI.COMM_SELF, quiet=True)
        result = {
            "size": comm.Get_size(),
            "summary_val": {k: v for k, v in summary.items() if k.startswith("val_")},
            "record": last,
            "eval": {"n": rep_n, "1": rep_1},
            "counts": case_counts(model1, cfg),
        }
        out.write_text(json.dumps(result, default=str))
    comm.Barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
