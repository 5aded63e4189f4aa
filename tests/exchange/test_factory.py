"""The registry, create_exchanger, compressors and the constructor checks (no MPI: a fake comm)."""

from __future__ import annotations

import numpy as np
import pytest

from theanompi.errors import ConfigError
from theanompi.exchange import STRATEGIES, Exchanger, create_exchanger
from theanompi.exchange.compression import COMPRESSORS, Compressor


class FakeComm:
    """Just enough of a communicator for the constructors."""

    def __init__(self, size: int, rank: int = 0) -> None:
        self.size, self.rank = size, rank

    def Get_size(self) -> int:  # noqa: N802 - mpi4py's name
        return self.size

    def Get_rank(self) -> int:  # noqa: N802
        return self.rank


def _one_line_naming(msg: str, what: str, bad: str, choices) -> None:
    assert msg.startswith(f"unknown {what} {bad!r}; choose from ") and "\n" not in msg
    assert ", ".join(map(repr, choices)) + ", or give package.module:Class" in msg


def test_unknown_strategy_is_one_config_error_naming_the_choices() -> None:
    for call in (lambda: STRATEGIES.get("nccl"), lambda: create_exchanger("nccl", FakeComm(2))):
        with pytest.raises(ConfigError) as err:
            call()
        _one_line_naming(str(err.value), "exchanger", "nccl", STRATEGIES)


def test_unknown_compression_is_one_config_error_naming_the_choices() -> None:
    with pytest.raises(ConfigError) as err:
        create_exchanger("ar", comm=FakeComm(2), compression="int8")
    _one_line_naming(str(err.value), "compression", "int8", COMPRESSORS)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_registry_classes(name: str) -> None:
    """Every registered name resolves to an Exchanger class of that name."""
    cls = STRATEGIES.get(name)
    assert issubclass(cls, Exchanger) and cls.name == name
    assert isinstance(cls.requires_power_of_two, bool) and isinstance(cls.baseline, bool)
    assert cls.implied_compression in (None, *COMPRESSORS)
    assert all(cls.wire_roundings(n) >= 1 for n in (1, 2, 4, 8))


def test_compressor_registry() -> None:
    for name in COMPRESSORS:
        cls = COMPRESSORS.get(name)
        assert issubclass(cls, Compressor) and cls.name == name
    assert COMPRESSORS.get("none").in_place


def test_bad_op() -> None:
    with pytest.raises(ValueError, match=r"unknown op 'avg'; choose from 'mean', 'sum'"):
        create_exchanger("ar", comm=FakeComm(2), op="avg")


@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.parametrize("compression", list(COMPRESSORS))
@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 8, 12])
def test_power_of_two_check(name: str, compression: str, n: int) -> None:
    pow2 = n & (n - 1) == 0
    if not STRATEGIES.get(name).requires_power_of_two or pow2:
        ex = create_exchanger(name, comm=FakeComm(n), op="sum", compression=compression)
        assert isinstance(ex, Exchanger) and ex.name == name and ex.size == n
        implied = STRATEGIES.get(name).implied_compression
        assert ex.compressor.name == (implied or compression)
        assert f"compression={ex.compressor.name!r}" in repr(ex)
        return
    with pytest.raises(ConfigError) as err:
        create_exchanger(name, comm=FakeComm(n), compression=compression)
    msg = str(err.value)
    assert f"N={n}" in msg and "power-of-2" in msg and "'ar'" in msg and "\n" not in msg


def test_implied_compression_accepts_none_and_itself_only() -> None:
    """asa16 is asa with float16: 'none' (the default) and 'fp16' both give float16."""
    implied = {n: STRATEGIES.get(n).implied_compression for n in STRATEGIES}
    names = [n for n, c in implied.items() if c is not None]
    assert names  # asa16
    for name in names:
        for compression in ("none", implied[name]):
            ex = create_exchanger(name, comm=FakeComm(2), compression=compression)
            assert ex.compressor.name == implied[name]

    class Implies(Exchanger):  # a strategy implying "none" must refuse "fp16"
        name = "implies-none"
        implied_compression = "none"

    with pytest.raises(ConfigError, match=r"always sends none, got compression='fp16'"):
        Implies(comm=FakeComm(2), compression="fp16")


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_error_bounds(n: int) -> None:
    """float32 within ~(N+2) 2**-24; float16 about 2**-11 per rounding, asa16 <= 1e-3."""
    for name in STRATEGIES:
        cls = STRATEGIES.get(name)
        if cls.requires_power_of_two and n & (n - 1):
            continue
        r32, a32 = create_exchanger(name, FakeComm(n), compression="none").error_bound()
        r16, a16 = create_exchanger(name, FakeComm(n), compression="fp16").error_bound()
        if cls.implied_compression is None:
            assert r32 <= (n + 3) * 2.0**-24 and a32 < 1e-40
        k = cls.wire_roundings(n)
        assert k * 2.0**-11 < r16 < k * 2.0**-11 * 1.01 and a16 == n * 2.0**-24
    asa16 = create_exchanger("asa16", FakeComm(8)).error_bound()
    assert asa16[0] < 1e-3 and asa16[1] == 2.0**-21  # the bound asa16 always documented


def test_prepare_checks_dtype_and_exchange_checks_shapes() -> None:
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
