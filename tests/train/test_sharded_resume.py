"""ZeRO-1 checkpoints through ``tmpi train`` on real mpirun: a sharded run's checkpoint is the
unsharded run's, bit for bit (the whole Adam state gathered), and a resume crosses both ways
and to another N: sharded at N=2 -> unsharded at N=4 gives the parameters and state of
unsharded at N=2 -> sharded at N=4."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.mpi

ADAM = ("--sync-type", "cdd", "--strategy", "asa32", "--set", "model.optimizer=adam")


def _train(cli, data: Path, run: Path, n: int, epochs: int, *extra: str) -> str:
    out = cli(
        "train", "-n", str(n), "--model", "digits", "--data", str(data), "--run-dir", str(run),
        "--epochs", str(epochs), "--max-steps", "6", "--deterministic", *ADAM, *extra,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files if k != "meta"}


def _same(a: Path, b: Path) -> None:
    x, y = _arrays(a), _arrays(b)
    assert x.keys() == y.keys() and any(k.startswith("o") for k in x)  # the optimizer state too
    for k in x:
        np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_a_sharded_checkpoint_resumes_unsharded_on_another_n(
    cli, digits_data: Path, tmp_path: Path
) -> None:
    """About 20 s: four ``tmpi train`` jobs, two of them 4 ranks on 2 cores."""
    a, b = tmp_path / "sharded_first", tmp_path / "sharded_after"
    out = _train(cli, digits_data, a, 2, 1, "--shard-optimizer")
    assert "optimizer state sharded 1/2 (ZeRO-1)" in out
    _train(cli, digits_data, b, 2, 1)
    _same(a / "checkpoints/epoch_0001.npz", b / "checkpoints/epoch_0001.npz")
    _train(cli, digits_data, a, 4, 2, "--resume")
    out = _train(cli, digits_data, b, 4, 2, "--resume", "--shard-optimizer")
    assert "optimizer state sharded 1/4 (ZeRO-1)" in out and "resumed from" in out
    _same(a / "checkpoints/epoch_0002.npz", b / "checkpoints/epoch_0002.npz")
