"""Gradients exchanged while the backward pass runs give the parameters of the serial
exchange, for every BSP strategy and compression, on real mpirun."""

from __future__ import annotations

from pathlib import Path

import pytest

from theanompi.exchange.overlap import plan_buckets

SCRIPT = str(Path(__file__).with_name("mpi_overlap.py"))


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("n", "specs"),
    [
        (2, ["ar:none", "ar:fp16", "asa32:none", "asa16:none", "copper:none"]),
        (3, ["ar:none", "ar:fp16"]),
    ],
)
def test_overlapped_gradients_match_the_serial_exchange(mpirun, n: int, specs: list[str]) -> None:
    out = mpirun(n, [SCRIPT, *specs], timeout=300).stdout
    assert [line.split()[1:3] for line in out.splitlines() if line.startswith("OK")] == [
        s.split(":") for s in specs
    ], out


def test_buckets_follow_the_backward_pass_and_never_split_an_array() -> None:
    sizes = [400, 40, 4_000, 4, 1_000, 10]
    buckets = plan_buckets(sizes, bucket_mb=1_000 / 2**20)
    assert buckets == [[5, 4], [3, 2], [1, 0]]
    assert sorted(i for b in buckets for i in b) == list(range(len(sizes)))
    assert plan_buckets(sizes, bucket_mb=1.0) == [[5, 4, 3, 2, 1, 0]]
