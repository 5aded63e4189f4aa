"""Per-rank program: K BSP cdd steps of a real PyTensor CNN, gradients exchanged serially and
overlapped with the backward pass; checks both give the same parameters and that every rank
holds the same bits. Prints ``OK`` on rank 0.

``python mpi_overlap.py STRATEGY:COMPRESSION ...``
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from theanompi.pytensor_env import configure  # noqa: E402

configure()

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from theanompi.models.small_cnn import SmallCNN  # noqa: E402
from theanompi.rules.bsp import BSP  # noqa: E402

STEPS, B = 4, 8
ARCH = {"channels": [4, 8], "fc": 32, "dropout": 0.25, "seed": 7}


def train(strategy: str, compression: str, overlap: bool) -> tuple[list[np.ndarray], BSP]:
    comm = MPI.COMM_WORLD
    cfg = {"name": "small_cnn", "input_size": 12, "channels": 3, "n_classes": 5, "arch": ARCH}
    model = SmallCNN(cfg).build(B)
    # ~1 KB buckets: [fc2, fc1], [conv2], [conv1]
    rule = BSP(
        strategy, "cdd", compression, overlap="always" if overlap else "never", bucket_mb=1e-3
    )
    rule.setup(model, comm)
    rng = np.random.default_rng(100 + comm.Get_rank())
    for step in range(1, STEPS + 1):
        x = rng.random((B, 3, 12, 12), dtype=np.float32) * 255
        y = rng.integers(0, 5, B).astype(np.int32)
        rule.train_step(model, x, y)
        rule.after_step(model, step)
    rule.finish(model)
    return [p.get_value() for p in model.params], rule


def check(strategy: str, compression: str) -> None:
    comm = MPI.COMM_WORLD
    serial, _ = train(strategy, compression, overlap=False)
    overlapped, rule = train(strategy, compression, overlap=True)
    assert rule.overlapped is not None and len(rule.overlapped.buckets) >= 3, rule.overlapped
    for a, b in zip(serial, overlapped, strict=True):
        if comm.Get_size() == 2:  # a + b = b + a: the same bits, however the buffers are cut
            np.testing.assert_array_equal(b, a)
        else:  # MPI may add 3+ values in another order for another buffer size: float32
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)  # rounding, over 4 steps
    everyone = comm.allgather([v.tobytes() for v in overlapped])
    assert all(e == everyone[0] for e in everyone), "ranks hold different parameters"
    moved = max(float(np.abs(v).max()) for v in overlapped)
    assert moved > 0
    if comm.Get_rank() == 0:
        print("OK", strategy, compression, rule.overlapped, flush=True)


if __name__ == "__main__":
    for spec in sys.argv[1:]:
        check(*spec.split(":"))
