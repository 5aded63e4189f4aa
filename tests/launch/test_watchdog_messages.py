"""The watchdog's heartbeats are O(N): every rank sends one a interval to the hub, the hub
one digest to every rank (2(N-1) messages in the job, not N(N-1)), and still every rank has
fresh news of every other. Real mpirun; ``pipelines/watchdog_load.py`` measures N=16."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from theanompi.launch.blame import HUB

pytestmark = pytest.mark.mpi

SCRIPT = Path(__file__).with_name("mpi_watchdog_messages.py")


@pytest.mark.parametrize("n", [4])
def test_heartbeats_go_through_the_hub(mpirun, tmp_path: Path, n: int) -> None:
    out = tmp_path / "rows.json"
    mpirun(n, [SCRIPT, out], timeout=120)
    rows = json.loads(out.read_text())
    assert len(rows) == n
    for rank, sent, ticks, heard, oldest, stale in rows:
        assert ticks >= 10, rows
        # one heartbeat (a rank) or N-1 digests (the hub) per tick, give or take the last one
        per_tick = n - 1 if rank == HUB else 1
        assert (ticks - 3) * per_tick <= sent <= (ticks + 1) * per_tick, rows
        assert heard == [r for r in range(n) if r != rank], rows  # news of every other rank
        assert oldest < stale, rows  # ... and fresh
    total = sum(r[1] for r in rows) / min(r[2] for r in rows)
    assert total <= 2 * (n - 1) + 1, rows  # was n * (n - 1) = 12 at n=4
