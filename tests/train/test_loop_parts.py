"""Parts of the training loop: RNG discovery, the Ctrl-C flag, step stats and value digests."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from theanompi.launch.signals import StopFlag
from theanompi.models.params import value_digests
from theanompi.train.progress import StepStats
from theanompi.train.rng import get_rng_states, rng_vars, seed_rngs, set_rng_states


def test_rng_vars_finds_the_small_cnn_dropout_and_round_trips_state() -> None:
    from theanompi.models import create_model

    m = create_model({"name": "small_cnn", "input_size": 28, "channels": 3, "n_classes": 10})
    (v,) = rng_vars(m)
    seed_rngs(m, 5, rank=1)
    states = get_rng_states(m)
    first = v.get_value().random(3)
    set_rng_states(m, states)
    np.testing.assert_array_equal(v.get_value().random(3), first)
    seed_rngs(m, 5, rank=0)
    assert get_rng_states(m) != states  # each rank draws its own dropout masks


def test_stop_flag_turns_the_first_ctrl_c_into_a_flag() -> None:
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when started as a background job
    with StopFlag() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested and stop.signum == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_step_stats_split_and_window() -> None:
    s = StepStats()
    for i in range(4):
        s.add(1.0 + i, 0.5, compute=0.01 * i, exchange=0.002, wait=0.0, wall=0.02)
    assert len(s.since(2)) == 2 and s.since(2).mean("loss") == 3.5
    assert s.split()["t_exchange"] == pytest.approx(0.002) and s.median("compute") == pytest.approx(
        0.015
    )
    assert value_digests([np.zeros(3, np.float32)]) == value_digests([np.zeros(3, np.float32)])
    assert value_digests([np.zeros(3, np.float32)]) != value_digests([np.ones(3, np.float32)])
