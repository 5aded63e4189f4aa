"""One metrics module: tie rule, loss floor, padding, symbolic == numpy, and training's
validation == ``tmpi eval`` of the same checkpoint, exactly, under real mpirun."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from theanompi.models.metrics import (
    LOSS_FLOOR,
    TOP_K,
    batch_metrics,
    evaluate,
    indexed_batches,
    true_rank,
    validate,
)

AGREE = Path(__file__).with_name("mpi_metrics_agree.py")


def ref_rank(p: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Independent float64 reference: position of ``y`` in a stable descending sort."""
    order = np.argsort(-np.asarray(p, np.float64), axis=1, kind="stable")
    return np.argmax(order == np.asarray(y)[:, None], axis=1)


def ref_loss(p: np.ndarray, y: np.ndarray) -> np.ndarray:
    py = np.asarray(p, np.float64)[np.arange(len(y)), y]
    return -np.log(np.maximum(py, 2.0**-149))


def test_import_does_not_load_pytensor() -> None:
    code = "import sys, theanompi.models.metrics; sys.exit('pytensor' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_true_rank_is_the_stable_sort_position_with_many_ties() -> None:
    rng = np.random.default_rng(0)
    p = rng.integers(0, 4, size=(500, 9)).astype(np.float32) / 4  # ties everywhere
    y = rng.integers(0, 9, size=500)
    np.testing.assert_array_equal(true_rank(p, y), ref_rank(p, y))
    m = batch_metrics(p, y)
    assert m["top1"] == int((ref_rank(p, y) == 0).sum())
    assert m["topk"] == int((ref_rank(p, y) < 5).sum())
    # argmax (first maximum) agrees on the top-1; the top-k indices contain y iff a top-k hit
    np.testing.assert_array_equal(m["hit1"], p.argmax(axis=1) == y)
    np.testing.assert_array_equal((m["topk_idx"] == y[:, None]).any(axis=1), ref_rank(p, y) < 5)


def test_padding_is_ignored_and_top_k_counted() -> None:  # from the old rules._common test
    probs = np.array(
        [[0.7, 0.1, 0.1, 0.05, 0.03, 0.02],  # y=0: top-1 hit
         [0.7, 0.1, 0.1, 0.05, 0.03, 0.02],  # y=1: top-1 miss, top-5 hit (tie with 2: 1 wins)
         [0.3, 0.25, 0.2, 0.1, 0.1, 0.05],   # y=5: five classes score higher -> top-5 miss
         [0.9, 0.02, 0.02, 0.02, 0.02, 0.02]],  # padding
        dtype=np.float32,
    )  # fmt: skip
    m = batch_metrics(probs, np.array([0, 1, 5, -1]))
    assert (m["n"] - m["top1"], m["n"] - m["topk"], m["n"]) == (2, 1, 3)
    assert m["loss"] == pytest.approx(-np.log([0.7, 0.1, 0.05]).sum(), rel=1e-6)
    empty = batch_metrics(probs, np.full(4, -1))
    assert (empty["n"], empty["top1"], empty["topk"], empty["loss"]) == (0, 0, 0, 0.0)


@pytest.mark.parametrize(("y", "hit"), [(0, True), (1, False)])
def test_tie_at_the_top_goes_to_the_lower_index(y: int, hit: bool) -> None:
    p = np.array([[0.4, 0.4, 0.2]], np.float32)
    m = batch_metrics(p, np.array([y]))
    assert m["top1"] == int(hit) and m["topk"] == 1
    assert m["topk_idx"].tolist() == [[0, 1, 2]]


@pytest.mark.parametrize(("tie", "hit"), [(5, False), (7, True)])
def test_tie_at_the_fifth_place(tie: int, hit: bool) -> None:
    p = np.full((1, 8), 0.05, np.float32)
    p[0, [0, 1, 2, 3]] = 0.15  # four strictly above the true class 6
    p[0, [6, tie]] = 0.1
    m = batch_metrics(p, np.array([6]))
    assert true_rank(p, np.array([6])).tolist() == [5 if tie < 6 else 4]
    assert m["topk"] == int(hit) and m["top1"] == 0


def test_true_class_underflowed_to_zero() -> None:
    # the case: 10 classes, the true class at p=0 in float32, three non-zero classes
    z = np.full((2, 10), -200.0, np.float32)
    z[:, [0, 1, 2]] = (2.0, 1.5, 1.0)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    p = (e / e.sum(axis=1, keepdims=True)).astype(np.float32)
    y = np.array([9, 3])
    assert (p[[0, 1], y] == 0).all() and (p[:, :3] > 0).all()
    m = batch_metrics(p, y)
    # y=9: zero-probability classes 3..8 tie with it at lower indices -> 9 above: top-5 miss;
    # y=3: only the three non-zero classes rank above -> top-5 hit
    assert true_rank(p, y).tolist() == [9, 3]
    assert (m["top1"], m["topk"]) == (0, 1)
    assert m["loss"] == float(ref_loss(p, y).sum())
    assert m["loss"] == pytest.approx(2 * 149 * np.log(2.0), rel=1e-15)


def test_loss_floor_is_the_smallest_float32_and_spares_every_nonzero_float32() -> None:
    assert LOSS_FLOOR == float(np.finfo(np.float32).smallest_subnormal)
    tiny = np.float32(np.finfo(np.float32).smallest_subnormal)
    p = np.array([[tiny, 1.0], [np.float32(3e-42), 1.0], [0.0, 1.0]], np.float32)
    m = batch_metrics(p, np.zeros(3, np.int64))
    expect = [-np.log(float(tiny)), -np.log(float(np.float32(3e-42))), -np.log(LOSS_FLOOR)]
    assert m["loss"] == float(np.sum(expect))


def test_random_probabilities_match_the_float64_reference() -> None:
    rng = np.random.default_rng(3)
    z = rng.normal(size=(40, 12)) * 4
    z[::7, :] = np.round(z[::7, :])  # some exact logit ties
    e = np.exp(z - z.max(axis=1, keepdims=True))
    p = (e / e.sum(axis=1, keepdims=True)).astype(np.float32)
    y = rng.integers(0, 12, size=40)
    padded = y.copy()
    padded[::5] = -1
    keep = padded >= 0
    m = batch_metrics(p, padded)
    r = ref_rank(p[keep], y[keep])
    assert (m["n"], m["top1"], m["topk"]) == (keep.sum(), (r == 0).sum(), (r < TOP_K).sum())
    assert m["loss"] == pytest.approx(ref_loss(p[keep], y[keep]).sum(), rel=1e-13)
    np.testing.assert_array_equal(m["labels"], y[keep])


def test_symbolic_metrics_agree_with_numpy_on_the_same_scores() -> None:
    import pytensor
    import pytensor.tensor as pt
    from pytensor.compile.mode import Mode

    from theanompi.models.metrics import symbolic_metrics, symbolic_true_rank

    rng = np.random.default_rng(1)
    s = (rng.integers(-3, 3, size=(300, 10)) * 0.5).astype(np.float32)  # many ties
    s[:50, :] = 0.0  # all classes equal
    y = rng.integers(0, 10, size=300).astype(np.int32)
    x, t = pt.matrix("s", dtype="float32"), pt.ivector("y")
    loss, top1, top5 = symbolic_metrics(x, t)
    fn = pytensor.function(
        [x, t],
        [loss, top1, top5, symbolic_true_rank(x, t)],
        mode=Mode(linker="py", optimizer="fast_compile"),
    )
    g_loss, g_top1, g_top5, g_rank = fn(s, y)
    np.testing.assert_array_equal(g_rank, true_rank(s, y))
    m = batch_metrics(s, y)
    assert float(g_top1) == pytest.approx(1 - m["top1"] / 300, abs=1e-7)
    assert float(g_top5) == pytest.approx(1 - m["topk"] / 300, abs=1e-7)
    z = s.astype(np.float64)
    logp = z - z.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    assert float(g_loss) == pytest.approx(-logp[np.arange(300), y].mean(), rel=1e-5)


class _Table:
    """A model whose ``predict`` looks up fixed probabilities by the image id in ``x``."""

    n_classes = 10

    def __init__(self, probs: np.ndarray) -> None:
        self.probs = probs

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self.probs[x.astype(int)]


class _Loader:
    """Rank ``rank`` of ``size`` of a split of sub-batches of ``b`` ids, like ``ValLoader``."""

    def __init__(self, labels: np.ndarray, b: int, rank: int, size: int) -> None:
        subs = [(np.arange(i, i + b), labels[i : i + b]) for i in range(0, len(labels), b)]
        self.subs, self.rank, self.size = subs[rank::size], rank, size

    @contextmanager
    def batches(self):
        yield iter(self.subs)


def test_validate_is_evaluate_renamed_and_independent_of_the_split() -> None:
    rng = np.random.default_rng(5)
    p = rng.dirichlet(np.full(10, 0.3), size=60).astype(np.float32)
    p[::4] = 0.1  # ties
    p[1::6, 7] = 0.0
    y = rng.integers(0, 10, size=60)
    y[1::6] = 7  # true class at exactly 0
    y[-3:] = -1  # padding
    model = _Table(p)
    v = validate(model, _Loader(y, 4, 0, 1), None)
    e = evaluate(model, indexed_batches(_Loader(y, 4, 0, 1)))
    keep = y >= 0
    r = ref_rank(p[keep], y[keep])
    assert set(v) == {"val_loss", "val_top1_err", "val_top5_err", "val_n", "val_seconds"}
    assert v["val_n"] == e["images"] == 57
    assert v["val_top1_err"] == e["top1_error"] == 1 - (r == 0).sum() / 57
    assert v["val_top5_err"] == e["top5_error"] == 1 - (r < 5).sum() / 57
    assert v["val_loss"] == e["loss"]
    assert v["val_loss"] == pytest.approx(ref_loss(p[keep], y[keep]).mean(), rel=1e-13)
    # the same sums from the shards of a 3-way split, fed in any order: identical bits
    shards = [b for r_ in (2, 0, 1) for b in indexed_batches(_Loader(y, 4, r_, 3))]
    e3 = evaluate(model, shards, keep_predictions=True)
    assert (e3["loss"], e3["top1_error"], e3["top5_error"]) == (
        e["loss"],
        e["top1_error"],
        e["top5_error"],
    )
    np.testing.assert_array_equal(e3["predictions"][:, 0], p[keep].argmax(axis=1))


def test_validate_refuses_a_loader_split_for_another_size() -> None:
    with pytest.raises(ValueError, match="over 2 rank"):
        validate(_Table(np.zeros((1, 10))), _Loader(np.zeros(4, int), 4, 0, 2), None)


@pytest.mark.mpi
def test_record_validation_equals_eval_of_the_checkpoint_exactly(mpirun, tmp_path) -> None:
    """The issue's acceptance test: the record's last validation (training on 2 ranks) equals
    ``tmpi eval`` of that epoch's checkpoint at N=1 and N=2, ties and zeros included."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from _train_data import write_dataset

    data = write_dataset(tmp_path / "data", n_train=4, n_val=3, B=16, S=10, n_classes=10)
    out = tmp_path / "agree.json"
    mpirun(2, [AGREE, data, tmp_path / "run", out], timeout=240)
    res = json.loads(out.read_text())
    counts = res["counts"]  # the crafted cases really decide some outcomes
    assert counts["images"] == 43
    assert counts["zero_true_prob"] >= 3
    assert counts["tie_decides_top1"] >= 3
    assert counts["tie_decides_top5"] >= 3
    rec = res["record"]
    assert rec["checkpoint"] and rec["val_n"] == 43
    for n in ("1", "2"):
        rep = res["eval"]["n" if n == "2" else "1"]
        assert rep["ranks"] == int(n) and rep["images"] == 43
        assert rec["val_loss"] == rep["loss"], n
        assert rec["val_top1_err"] == rep["top1_error"], n
        assert rec["val_top5_err"] == rep["top5_error"], n


_GIL = """
import threading, time
import numpy as np
from mpi4py import MPI
import theanompi.models.metrics as metrics

comm = MPI.COMM_WORLD.Dup()  # no pickled collective on it yet
rank = comm.Get_rank()
if rank == 1:  # late inside the batch loop: rank 0 waits in evaluate's closing collectives
    real = metrics.batch_metrics

    def slow(*a, **k):
        time.sleep(2)
        return real(*a, **k)

    metrics.batch_metrics = slow

class Table:
    n_classes = 10
    def predict(self, x):
        return np.full((len(x), 10), 0.1, np.float32)

ticks = [0]
def tick():
    while True:
        time.sleep(0.01)
        ticks[0] += 1

threading.Thread(target=tick, daemon=True).start()
batches = [(rank, np.zeros((4, 1), np.float32), np.arange(4))]
t0, s0 = ticks[0], time.monotonic()
out = metrics.evaluate(Table(), batches, comm)
if rank == 0:
    print("WAIT", round(time.monotonic() - s0, 2), "TICKS", ticks[0] - t0, out["images"])
"""


@pytest.mark.mpi
def test_a_thread_runs_while_evaluate_waits_for_a_late_rank(mpirun, tmp_path) -> None:
    """The stall watchdog is a thread: evaluate's collectives must release the GIL while they
    wait, even the first ones on a communicator (mpi4py's pickled ``allreduce`` does not)."""
    script = tmp_path / "gil.py"
    script.write_text(_GIL)
    out = mpirun(2, [script], timeout=120)
    m = re.search(r"WAIT (\S+) TICKS (\d+) (\d+)", out.stdout)
    assert m, out.stdout + out.stderr
    wait, ticks, images = float(m[1]), int(m[2]), int(m[3])
    assert images == 8
    assert wait > 1.5, out.stdout
    assert ticks > 50, out.stdout  # about 100 a second while rank 0 waits
