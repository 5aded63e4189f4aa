"""The hierarchical exchanger under real ``mpirun``: nodes simulated by ``node=rank // K``."""

from __future__ import annotations

from pathlib import Path

import pytest

from theanompi.comm import under_mpirun
from theanompi.config import choices, load_config
from theanompi.errors import ConfigError
from theanompi.exchange import WHEN, create_exchanger
from theanompi.exchange.hierarchical import hierarchical_wanted

SCRIPT = Path(__file__).with_name("mpi_hierarchical.py")
MODEL_YAML = Path(__file__).parents[1] / "model_mlp.yaml"

pytestmark = pytest.mark.skipif(under_mpirun(), reason="launches its own mpirun")


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("n", "group", "extra"),
    [
        (1, 2, []),
        (4, 2, []),  # 2 nodes of 2
        (4, 3, ["--thread"]),  # nodes of 3 and 1, from a non-main thread
        (3, 1, []),  # 3 nodes of 1: power-of-2 strategies refuse
        pytest.param(8, 2, [], marks=pytest.mark.slow),  # 4 nodes of 2
    ],
)
def test_hierarchical_under_mpirun(mpirun, n: int, group: int, extra: list[str]) -> None:
    """Every strategy x compressor x op: within its bound of float64 and of flat, the same
    bytes on every rank, refusals naming the number of node leaders."""
    proc = mpirun(n, [SCRIPT, "--group", str(group), *extra], timeout=300)
    assert "all checks passed" in proc.stdout, proc.stdout
    nodes = -(-n // group)
    if n > 1:
        assert f"ar               mean nodes {nodes} " in proc.stdout, proc.stdout
    if nodes & (nodes - 1):
        assert "copper           mean ConfigError ok" in proc.stdout, proc.stdout


def test_hierarchical_wanted_modes() -> None:
    assert hierarchical_wanted("always") and not hierarchical_wanted("never")
    assert choices("weight_exchange.hierarchical") == WHEN


@pytest.mark.parametrize("name", ["hierarchical", "overlap"])
@pytest.mark.parametrize(("text", "shown"), [("yes", "True"), ("'often'", "'often'")])
def test_bad_mode_refused_when_the_config_loads(
    tmp_path: Path, name: str, text: str, shown: str
) -> None:
    """The config is the one check of a mode: one line naming the key, the value, the choices."""
    run = tmp_path / "config.yaml"
    run.write_text(f"weight_exchange:\n  {name}: {text}\n")
    with pytest.raises(ConfigError) as info:
        load_config(run, MODEL_YAML)
    msg = str(info.value)
    assert msg.endswith(
        f"weight_exchange.{name} is {shown}; it must be one of 'auto', 'always', 'never'"
    ), msg
    assert "\n" not in msg


def test_unknown_strategy_refused_before_any_collective() -> None:
    with pytest.raises(ConfigError, match="^unknown exchanger 'nccl'"):
        create_exchanger("nccl", hierarchical=True)
