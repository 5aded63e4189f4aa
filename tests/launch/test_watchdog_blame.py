"""The watchdog's blame rule on recorded heartbeats (the rule alone; tests/fault/test_stall.py
runs it under mpirun with a SIGSTOPped rank)."""

from __future__ import annotations

from mpi4py import MPI

from theanompi.launch.watchdog import Watchdog


def _as_rank(rank: int, size: int) -> Watchdog:
    w = Watchdog(MPI.COMM_SELF, 6.0)  # one rank: no thread, no messages; the rule only
    w.rank, w.size, w.stale = rank, size, 2.0
    return w


def test_a_worker_waiting_on_a_stopped_server_is_not_blamed() -> None:
    """EASGD, server 0 SIGSTOPped: worker 1 waits in the stop agreement for worker 2, which
    waits (alive) in its exchange with the server. The server is to blame, not worker 2."""
    w, now, started = _as_rank(1, 3), 100.0, 0.0
    heard = {
        0: (now - 9.0, (40, "", -1.0, True)),  # silent for 9 s
        2: (now - 0.5, (41, "the exchange", 7.0, True)),  # alive, waiting for the server
    }
    missing = w._missing(now, started, heard, 42, "the stop agreement", (1, 2), True)
    assert missing == [0]
    assert w._decider(now, heard, missing)


def test_a_busy_peer_is_blamed_when_nobody_is_silent() -> None:
    w, now = _as_rank(0, 3), 100.0
    heard = {
        1: (now - 0.5, (42, "the exchange", 7.0, True)),
        2: (now - 0.5, (41, "", -1.0, True)),  # alive, not waiting: busy (a hung kernel)
    }
    assert w._missing(now, 0.0, heard, 42, "the exchange", None, True) == [2]


def test_a_silent_peer_is_blamed_first() -> None:
    w, now = _as_rank(0, 2), 100.0
    heard = {1: (now - 5.0, (42, "the exchange", 1.0, True))}
    assert w._missing(now, 0.0, heard, 42, "the exchange", None, True) == [1]
