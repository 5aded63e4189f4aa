"""The watchdog's blame rule on recorded heartbeats (the rule alone; tests/fault/test_stall.py
runs it under mpirun with a SIGSTOPped rank)."""

from __future__ import annotations

from theanompi.launch.blame import Blame


def _as_rank(rank: int, size: int) -> Blame:
    return Blame(rank, size, stale=2.0)  # the rule only: no thread, no messages


def test_a_worker_waiting_on_a_stopped_server_is_not_blamed() -> None:
    """EASGD, server 0 SIGSTOPped: worker 1 waits in the stop agreement for worker 2, which
    waits (alive) in its exchange with the server. The server is to blame, not worker 2."""
    w, now, started = _as_rank(1, 3), 100.0, 0.0
    heard = {
        0: (now - 9.0, (40, "", -1.0, True)),  # silent for 9 s
        2: (now - 0.5, (41, "the exchange", 7.0, True)),  # alive, waiting for the server
    }
    missing = w.missing(now, started, heard, 42, "the stop agreement", (1, 2), True)
    assert missing == [0]
    assert w.decider(now, started, heard, missing)


def test_a_busy_peer_is_blamed_when_nobody_is_silent() -> None:
    w, now = _as_rank(0, 3), 100.0
    heard = {
        1: (now - 0.5, (42, "the exchange", 7.0, True)),
        2: (now - 0.5, (41, "", -1.0, True)),  # alive, not waiting: busy (a hung kernel)
    }
    assert w.missing(now, 0.0, heard, 42, "the exchange", None, True) == [2]


def test_a_silent_peer_is_blamed_first() -> None:
    w, now = _as_rank(0, 2), 100.0
    heard = {1: (now - 5.0, (42, "the exchange", 1.0, True))}
    assert w.missing(now, 0.0, heard, 42, "the exchange", None, True) == [1]


def test_a_silent_hub_is_named_by_the_lowest_rank_it_last_heard() -> None:
    """The hub (rank 0) stops: ranks 1 and 2 know of each other only through its last digest,
    which goes no older; rank 1 (alive then) reports, rank 2 leaves it to rank 1."""
    now, t_hub = 100.0, 95.0
    heard = {0: (t_hub, (40, "", -1.0, True)), 1: (t_hub - 0.5, (41, "the exchange", 1.0, True))}
    w2 = _as_rank(2, 3)
    missing = w2.missing(now, 0.0, heard, 42, "the exchange", None, True)
    assert missing == [0]
    assert not w2.decider(now, 0.0, heard, missing)
    w1 = _as_rank(1, 3)
    assert w1.decider(now, 0.0, {0: heard[0]}, missing)


def test_a_silent_hub_before_any_digest_leaves_the_report_to_rank_1() -> None:
    """Nothing relayed yet (the hub stopped right after the ranks began listening): rank 2
    cannot know whether rank 1 lives, and leaves the report to it (or, late, makes it)."""
    w2 = _as_rank(2, 3)
    missing = w2.missing(100.0, 90.0, {}, 42, "the exchange", None, True)
    assert missing == [0]
    assert not w2.decider(100.0, 0.0, {}, missing)
    assert _as_rank(1, 3).decider(100.0, 0.0, {}, missing)
