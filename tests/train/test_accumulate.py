"""Gradient accumulation (``training.accumulate_steps``, docs/train.md): K sub-batches per optimiser
step equal one K times larger batch (real compiled PyTensor graphs); a real 2-rank BSP ``cdd`` run
with K=2 ends where K=1 with twice the batch does; a resume from a mid-epoch checkpoint of a K=2
run is bit-exact; a bad value or an unsupported combination is one ``ConfigError`` line.

Batch norm normalises each sub-batch by its own statistics, so with BN K sub-batches differ
from one K times larger batch by design: the model here (the MLP) has no BN and no dropout.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fault"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _train_data import tiny_config, write_dataset  # noqa: E402
from harness import tiny_train_args, write_tiny_data  # noqa: E402

from theanompi.config import load_config  # noqa: E402
from theanompi.errors import ConfigError  # noqa: E402
from theanompi.io.checkpoint import list_checkpoints, load_checkpoint  # noqa: E402
from theanompi.io.record import read_record  # noqa: E402

MLP = {
    "name": "mlp",
    "input_size": 8,
    "channels": 3,
    "n_classes": 4,
    "batch_size": 4,
    "learning_rate": 0.05,
    "momentum": 0.9,
    "weight_decay": 0.001,
    "arch": {"hidden": [16]},
}


# -- (1) one step of K sub-batches == one step of a K times larger batch --------------------------
def _rule(kind: str):
    from theanompi.rules.base import SyncRule
    from theanompi.rules.bsp import BSP

    # EASGD and GOSGD train through the base rule's accumulate; BSP on one rank: no exchange
    return SyncRule() if kind == "base" else BSP("ar", kind)


@pytest.mark.parametrize(
    ("kind", "optimizer"), [("base", "sgd"), ("cdd", "sgd"), ("avg", "sgd"), ("cdd", "adam")]
)
def test_k_sub_batches_equal_one_k_times_larger_batch(kind: str, optimizer: str) -> None:
    from mpi4py import MPI

    from theanompi.models import create_model

    k, b = 4, 4
    section = {**MLP, "optimizer": optimizer}
    acc, big = create_model(section).build(b), create_model(section).build(k * b)
    for p, q in zip(acc.params, big.params, strict=True):  # the same start values
        np.testing.assert_array_equal(p.get_value(), q.get_value())
    rule = _rule(kind)
    rule.setup(acc, MPI.COMM_SELF)
    rng = np.random.default_rng(0)
    for step in range(3):  # momentum / Adam moments carry from step to step
        x = rng.uniform(0, 255, (k * b, 3, 8, 8)).astype(np.float32)
        y = rng.integers(0, 4, k * b).astype(np.int32)
        subs = [
            rule.accumulate(acc, x[i * b : (i + 1) * b], y[i * b : (i + 1) * b], i, k)
            for i in range(k)
        ]
        rule.after_step(acc, step + 1)
        loss, err = big.train_step(x, y)
        assert abs(np.mean([s[0] for s in subs]) - loss) < 1e-5  # the reported loss: their mean
        assert abs(np.mean([s[1] for s in subs]) - err) < 1e-6
    for p, q in zip(acc.params + acc.opt_state, big.params + big.opt_state, strict=True):
        np.testing.assert_allclose(p.get_value(), q.get_value(), rtol=0, atol=1e-5, err_msg=p.name)
    moved = max(
        np.abs(p.get_value() - q.get_value()).max()
        for p, q in zip(acc.params, create_model(section).params, strict=True)
    )
    assert moved > 1e-3  # the steps did change the parameters


def test_jax_backend_accumulates_on_the_device() -> None:
    pytest.importorskip("jax")
    from theanompi.models import create_model
    from theanompi.rules.base import SyncRule

    acc = create_model(MLP).build(4, backend="jax")
    big = create_model(MLP).build(8, backend="jax")
    rng = np.random.default_rng(2)
    x = rng.uniform(0, 255, (8, 3, 8, 8)).astype(np.float32)
    y = rng.integers(0, 4, 8).astype(np.int32)
    for i in range(2):
        SyncRule().accumulate(acc, x[4 * i : 4 * i + 4], y[4 * i : 4 * i + 4], i, 2)
    big.train_step(x, y)
    for p, q in zip(acc.params, big.params, strict=True):
        np.testing.assert_allclose(np.asarray(p.get_value()), np.asarray(q.get_value()), atol=1e-5)


def test_accumulate_with_k_1_is_the_plain_step() -> None:
    from theanompi.models import create_model
    from theanompi.rules.base import SyncRule

    one, plain = create_model(MLP).build(4), create_model(MLP).build(4)
    x = np.random.default_rng(1).uniform(0, 255, (4, 3, 8, 8)).astype(np.float32)
    y = np.arange(4, dtype=np.int32)
    assert SyncRule().accumulate(one, x, y, 0, 1) == plain.train_step(x, y)
    for p, q in zip(one.params, plain.params, strict=True):
        np.testing.assert_array_equal(p.get_value(), q.get_value())


# -- (2) real mpirun: K=2 == K=1 with twice the batch; a mid-epoch resume is bit-exact --------------
@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_data(tmp_path_factory.mktemp("acc") / "data")  # 5 files of 16, 8x8


def _train(cli, data: Path, run: Path, *extra: str, epochs: int = 2, ok: bool = True):
    args = tiny_train_args(data, run, "-n", "2", "--sync-type", "cdd", *extra, epochs=epochs)
    out = cli(*args, "--set", "randomness.deterministic=true", timeout=600)
    if ok:
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


def _arrays(path: Path) -> list[np.ndarray]:
    ck = load_checkpoint(path)
    return ck.params + ck.opt_state


@pytest.mark.mpi
@pytest.mark.slow
def test_bsp_cdd_k2_equals_k1_with_twice_the_batch(cli, data: Path, tmp_path: Path) -> None:
    acc, big = tmp_path / "k2", tmp_path / "b8"
    out = _train(cli, data, acc, "--set", "training.accumulate_steps=2", "--batch-size", "4")
    assert "batch 4/worker x 2 accumulated (16 global on 2 worker(s))" in out.stdout
    assert "5 optimiser steps/epoch" in out.stdout
    _train(cli, data, big, "--batch-size", "8")
    final = "epoch_0002.npz"
    a, b = acc / "checkpoints" / final, big / "checkpoints" / final
    assert load_checkpoint(a).step == load_checkpoint(b).step == 10  # optimiser steps
    for x, y in zip(_arrays(a), _arrays(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-5)
    recs = [[r for r in read_record(d) if r["kind"] in ("start", "step")] for d in (acc, big)]
    assert recs[0][0]["steps_per_epoch"] == recs[1][0]["steps_per_epoch"] == 5
    assert recs[0][0]["accumulate_steps"] == 2 and recs[0][0]["batch_size"] == 4
    assert [r["step"] for r in recs[0][1:]] == [r["step"] for r in recs[1][1:]] == [5, 10]
    for r, s in zip(recs[0][1:], recs[1][1:], strict=True):  # loss: the mean of the sub-batches
        assert abs(r["loss"] - s["loss"]) < 1e-5 and abs(r["error"] - s["error"]) < 1e-6


@pytest.mark.mpi
@pytest.mark.slow
def test_k2_mid_epoch_resume_is_bit_exact(cli, data: Path, tmp_path: Path) -> None:
    every = ("--set", "training.accumulate_steps=2", "--set", "output.checkpoint_every_steps=2")
    straight = tmp_path / "straight"
    _train(cli, data, straight, *every, "--max-steps", "4")  # 4 optimiser steps = 8 sub-batches
    names = [p.name for p in list_checkpoints(straight / "checkpoints")]
    assert names == [
        "epoch_0000_step_00002.npz",
        "epoch_0001.npz",
        "epoch_0001_step_00002.npz",
        "epoch_0002.npz",
    ]
    assert load_checkpoint(straight / "checkpoints" / "epoch_0002.npz").step == 8
    # as if killed after step 2 of the second epoch: the later checkpoint is gone
    run = tmp_path / "resumed"
    shutil.copytree(straight, run)
    (run / "checkpoints" / "epoch_0002.npz").unlink()
    for side in (run / "checkpoints").glob("epoch_0002.rank*.npz"):
        side.unlink()
    refused = _train(cli, data, run, "--resume", "--max-steps", "4", ok=False)  # K=1 now
    assert refused.returncode == 2, refused.stderr[-3000:]
    line = [s for s in refused.stderr.splitlines() if s.startswith("tmpi: error:")]
    assert len(line) == 1 and "training.accumulate_steps=2, now 1" in line[0], refused.stderr

    out = _train(cli, data, run, *every, "--resume", "--max-steps", "4")
    assert "resumed from" in out.stdout and "epoch_0001_step_00002.npz" in out.stdout
    final = "epoch_0002.npz"
    for x, y in zip(
        _arrays(run / "checkpoints" / final), _arrays(straight / "checkpoints" / final), strict=True
    ):
        np.testing.assert_array_equal(x, y)


# -- (3) bad values and unsupported combinations: one ConfigError line each ------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("acc_tiny") / "data", n_train=2, B=16, S=8)


def _one_line(err: pytest.ExceptionInfo[ConfigError]) -> str:
    msg = str(err.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True, [2]])
def test_bad_value_is_one_line(bad: object) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, "digits", {"training.accumulate_steps": bad})
    assert "training.accumulate_steps" in _one_line(err)


def test_default_and_good_values() -> None:
    assert load_config(None, "digits").training.accumulate_steps == 1
    for rule in ("BSP", "EASGD", "GOSGD"):  # every built-in rule takes K > 1
        over = {"training.accumulate_steps": 4, "weight_exchange.sync_rule": rule}
        assert load_config(None, "digits", over).training.accumulate_steps == 4
    over = {"training.accumulate_steps": 2, "weight_exchange.sync_type": "avg"}
    assert load_config(None, "digits", over).weight_exchange.sync_type == "avg"


def test_rule_without_accumulation_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "rule.py"
    path.write_text(
        "from theanompi.rules.base import SyncRule\n\n"
        "class Mine(SyncRule):\n"
        "    name = 'Mine'\n"
        "    supports_accumulation = False\n"
    )
    ref = f"{path}:Mine"
    assert load_config(None, "digits", {"weight_exchange.sync_rule": ref}).training
    with pytest.raises(ConfigError) as err:
        load_config(
            None, "digits", {"weight_exchange.sync_rule": ref, "training.accumulate_steps": 2}
        )
    msg = _one_line(err)
    assert "sync_rule Mine does not support training.accumulate_steps=2" in msg
    assert "set training.accumulate_steps: 1" in msg


def test_cli_bad_value_exit_2_one_line(cli) -> None:
    out = cli("train", "--set", "training.accumulate_steps=0", "--print-config")
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tmpi: error:"), out.stderr
    assert "training.accumulate_steps" in lines[0]


def test_more_sub_batches_than_an_epoch_holds(tiny: Path, tmp_path: Path) -> None:
    from theanompi.train.run import train_loader

    cfg = tiny_config(tiny, tmp_path / "r", **{"model.batch_size": 8})  # 2 x 2 = 4 sub-batches
    assert train_loader(cfg, 0, 2).steps_per_epoch == 2
    capped = tiny_config(
        tiny,
        tmp_path / "r",
        **{"model.batch_size": 4, "training.accumulate_steps": 2, "training.max_steps": 1},
    )
    assert train_loader(capped, 0, 1).steps_per_epoch == 2  # max_steps counts optimiser steps
    big = tiny_config(
        tiny, tmp_path / "r", **{"model.batch_size": 8, "training.accumulate_steps": 3}
    )
    with pytest.raises(ConfigError) as err:
        train_loader(big, 1, 2)
    msg = _one_line(err)
    assert "training.accumulate_steps=3 needs 3 sub-batches per rank and epoch" in msg
    assert "gives 2 per rank" in msg


def test_model_without_accumulate_is_refused(tiny: Path, tmp_path: Path) -> None:
    from theanompi.models import create_model
    from theanompi.train.run import check_accumulate

    cfg = tiny_config(tiny, tmp_path / "r")  # the numpy FakeModel of tests/rules
    fake = create_model(cfg.model)
    check_accumulate(fake, 1)
    with pytest.raises(ConfigError) as err:
        check_accumulate(fake, 2)
    assert "set training.accumulate_steps: 1" in _one_line(err)
    check_accumulate(create_model(MLP), 2)
