"""ZeRO-1 (``weight_exchange.shard_optimizer``): each rank's 1/N of the optimiser state and update
give the digits CNN the parameters of the unsharded run bit for bit, for every optimiser (LARS
included) and with gradient accumulation, on real mpirun; a checkpoint holds the whole state,
and a run taken up from it, sharded or not, goes on as the unsharded run does."""

from __future__ import annotations

from pathlib import Path

import pytest

SCRIPT = str(Path(__file__).with_name("mpi_sharded.py"))
EVERY_OPTIMIZER = ["asa32:sgd", "asa32:adam", "asa32:adamw", "asa32:lars"]


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("n", "specs"),
    [
        # every optimiser with asa32 at N=4 (serial); at N=2 each once with another strategy or
        # accumulation, and LARS (per-layer norms over the shards) with asa32
        pytest.param(2, ["asa32:lars", "asa16:adam", "ar:sgd", "asa32:adamw:2"], id="n2"),
        pytest.param(3, ["ar:adamw"], id="n3"),  # chunks of a buffer padded to a multiple of 3
        pytest.param(4, EVERY_OPTIMIZER, id="n4", marks=pytest.mark.serial),
    ],
)
def test_sharded_optimizer_state_gives_the_unsharded_parameters(
    mpirun, n: int, specs: list[str]
) -> None:
    """N=2 about 10 s, N=4 about 24 s (serial): every rank builds the digits CNN once per
    optimiser and trains it five times (two runs, three resumed), 4 ranks on 2 cores."""
    out = mpirun(n, [SCRIPT, *specs], timeout=600).stdout
    assert [line.split()[1:] for line in out.splitlines() if line.startswith("OK")] == [
        (s + ":1").split(":")[:3] for s in specs
    ], out
