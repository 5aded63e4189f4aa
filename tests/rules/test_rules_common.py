"""Helpers shared by the rules: metrics over padded batches, RNG discovery, Ctrl-C flag, stats."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from theanompi.rules._common import (
    StepStats,
    StopFlag,
    evaluate_probs,
    get_rng_states,
    rng_vars,
    seed_rngs,
    set_rng_states,
    value_digests,
)


def test_evaluate_probs_ignores_padding_and_counts_top_k() -> None:
    probs = np.array(
        [[0.7, 0.1, 0.1, 0.05, 0.03, 0.02],  # y=0: top-1 hit
         [0.7, 0.1, 0.1, 0.05, 0.03, 0.02],  # y=1: top-1 miss, top-5 hit
         [0.3, 0.25, 0.2, 0.1, 0.1, 0.05],   # y=5: five classes score higher -> top-5 miss
         [0.9, 0.02, 0.02, 0.02, 0.02, 0.02]],  # padding
        dtype=np.float32,
    )  # fmt: skip
    nll, top1, top5, n = evaluate_probs(probs, np.array([0, 1, 5, -1]))
    assert (top1, top5, n) == (2, 1, 3)
    assert nll == pytest.approx(-np.log([0.7, 0.1, 0.05]).sum(), rel=1e-5)
    assert evaluate_probs(probs, np.full(4, -1)) == (0.0, 0, 0, 0)


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
