"""The rules' own state in mid-epoch checkpoints, in one process (``MPI.COMM_SELF``): a worker's
values and momentum, the gossip weight and draws, and the side file that carries them.
The real runs (a rank SIGKILLed, then ``--resume``) are in ``tests/fault/test_rule_checkpoints.py``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _fake_model import FakeModel  # noqa: E402

from theanompi.io.checkpoint import checkpoint_path, rank_state_path  # noqa: E402
from theanompi.rules.base import own_values, set_own_values  # noqa: E402
from theanompi.rules.gosgd import Gossip  # noqa: E402
from theanompi.train.snapshot import Snapshotter  # noqa: E402

SECTION = {"channels": 3, "input_size": 4, "n_classes": 3, "learning_rate": 0.1, "momentum": 0.9}


def _self() -> object:
    from mpi4py import MPI

    return MPI.COMM_SELF


def _moved(model: FakeModel, by: float) -> list[np.ndarray]:
    for v in model.params + model.opt_state:
        v.set_value(v.get_value() + np.float32(by))
    return own_values(model)


def test_own_values_round_trip_and_refuse_another_model() -> None:
    model = FakeModel(SECTION)
    saved = _moved(model, 1.0)
    _moved(model, 5.0)
    set_own_values(model, saved)
    for a, b in zip(own_values(model), saved, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="does not fit"):
        set_own_values(FakeModel({**SECTION, "n_classes": 4}), saved)


def test_gossip_state_survives_json_and_continues_the_draws() -> None:
    g = Gossip(_self(), 0.5, seed=3, n=4)
    for _ in range(7):
        g.draw()
    g.weight, g.pushes, g.received, g.sent[0] = 0.125, 4, 3, 2
    state = json.loads(json.dumps(g.state()))  # what the side file's meta holds
    ahead = [g.rng.random() for _ in range(5)]
    fresh = Gossip(_self(), 0.5, seed=3, n=4)
    fresh.load_state(state)
    assert [fresh.rng.random() for _ in range(5)] == ahead
    assert (fresh.weight, fresh.pushes, fresh.received, int(fresh.sent[0])) == (0.125, 4, 3, 2)
    with pytest.raises(ValueError, match="2 workers, now 1"):
        fresh.load_state({**state, "sent": [0, 0]})


def test_a_rank_state_goes_in_a_rank0_side_file_and_comes_back(tmp_path: Path) -> None:
    model = FakeModel(SECTION)
    snap = Snapshotter(tmp_path, 1, _self(), model, local_opt=False)
    own = _moved(model, 2.0)
    path = snap.save(1, 13, {"mid_epoch": True}, 3, rank_state=(own, {"exchanges": 6}))
    assert path == checkpoint_path(tmp_path, 1, 3) and rank_state_path(path, 0).exists()
    plain = snap.save(2, 20)  # no rank state (an epoch end, BSP): no side file at N=1
    assert not rank_state_path(plain, 0).exists()

    _moved(model, 7.0)
    back = Snapshotter(tmp_path, 1, _self(), model, local_opt=False)
    back.restore(path)
    arrays, meta = back.rank_state
    assert meta == {"exchanges": 6}
    for a, b in zip(arrays, own, strict=True):
        np.testing.assert_array_equal(a, b)
    back.restore(plain)
    assert back.rank_state is None
