"""create_exchanger and the constructor checks (no MPI needed: a fake communicator)."""

from __future__ import annotations

import pytest

from theanompi.errors import ConfigError
from theanompi.exchange import STRATEGIES, Exchanger, create_exchanger


class FakeComm:
    """Just enough of a communicator for the constructors."""

    def __init__(self, size: int, rank: int = 0) -> None:
        self.size, self.rank = size, rank

    def Get_size(self) -> int:  # noqa: N802 - mpi4py's name
        return self.size

    def Get_rank(self) -> int:  # noqa: N802
        return self.rank


def test_unknown_name_lists_choices() -> None:
    with pytest.raises(ValueError) as err:
        create_exchanger("nccl", comm=FakeComm(2))
    msg = str(err.value)
    assert msg.startswith("unknown exchanger 'nccl'; choose from ")
    for name in ("ar", "asa32", "asa16", "copper"):
        assert repr(name) in msg


def test_bad_op() -> None:
    with pytest.raises(ValueError, match=r"unknown op 'avg'; choose from 'mean', 'sum'"):
        create_exchanger("ar", comm=FakeComm(2), op="avg")


@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 8, 12])
def test_power_of_two_check(name: str, n: int) -> None:
    pow2 = n & (n - 1) == 0
    if name in ("ar", "ar_per_array") or pow2:
        ex = create_exchanger(name, comm=FakeComm(n), op="sum")
        assert isinstance(ex, Exchanger) and ex.name == name and ex.size == n
        return
    with pytest.raises(ConfigError) as err:
        create_exchanger(name, comm=FakeComm(n))
    msg = str(err.value)
    assert f"N={n}" in msg and "power-of-2" in msg and "'ar'" in msg and "\n" not in msg


def test_prepare_checks_dtype_and_exchange_checks_shapes() -> None:
    import numpy as np

    ex = create_exchanger("ar", comm=FakeComm(1))
    with pytest.raises(TypeError, match="float32"):
        ex.prepare([np.zeros(3)])
    with pytest.raises(RuntimeError, match="prepare"):
        ex.exchange([np.zeros(3, np.float32)])
    a = np.arange(3, dtype=np.float32)
    ex.prepare([a])
    ex.exchange([a])  # one rank: unchanged
    assert a.tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match=r"prepared float32\(3,\)"):
        ex.exchange([np.zeros(4, np.float32)])
