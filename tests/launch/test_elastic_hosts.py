"""An elastic job's hosts as the launcher keeps them: a lost host leaves (named as mpirun
names it, or found by the ranks it ran), and a real host discovery script's new slots come in
up to ``max_np``."""

from __future__ import annotations

from pathlib import Path

import pytest

from theanompi.errors import ConfigError
from theanompi.launch.elastic import ElasticHosts, discover
from theanompi.launch.hosts import Placement


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "discover.sh"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_a_lost_host_leaves_by_its_name_or_by_the_ranks_it_ran() -> None:
    two = Placement(hosts=(("10.0.0.1", 2), ("10.0.0.2", 2)))
    hosts = ElasticHosts(two, 4, min_np=2)
    assert hosts.lose("10.0.0.2", [2, 3]) == "2 ranks on hosts 10.0.0.1:2"
    assert (hosts.n, hosts.placement.hosts) == (2, (("10.0.0.1", 2),))
    # mpirun names the node by its hostname, the hostfile by its address: the ranks tell
    hosts = ElasticHosts(two, 4, min_np=2)
    assert hosts.lose("nodeb", [2, 3]) == "2 ranks on hosts 10.0.0.1:2"
    assert ElasticHosts(two, 4, min_np=3).lose("nodeb", [2, 3]) is None  # 2 slots < 3
    assert ElasticHosts(two, 4, min_np=2).lose("nodec", []) is None  # which one: not known


def test_the_discovery_scripts_new_slots_come_in_up_to_max_np(tmp_path: Path) -> None:
    offered = tmp_path / "hosts"
    offered.write_text("a:2\n")
    script = _script(tmp_path, f"cat {offered}")
    hosts = ElasticHosts(Placement(), 8, min_np=2, max_np=3, script=script, timeout=0)
    assert (hosts.n, hosts.placement.hosts) == (2, (("a", 2),))  # the script's, not -n's
    assert hosts.more() is None
    offered.write_text("a:2\nb:2\n")
    assert hosts.more() == "elastic: the host discovery script offers a:2, b:2"
    assert hosts.grow() == "3 ranks on hosts a:2, b:2"  # max_np
    assert hosts.more() is None  # at max_np: no more growth


def test_a_discovery_script_that_fails_or_offers_too_little(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert discover(_script(tmp_path, "echo 'bad host!'")) is None
    assert discover(_script(tmp_path, "exit 3")) is None
    err = capsys.readouterr().err
    assert "tmpi: warning: host discovery script" in err and "exit 3" in err
    few = _script(tmp_path, "echo a:1")
    with pytest.raises(ConfigError, match="offered fewer than --min-np 2 slots for 0 s"):
        ElasticHosts(Placement(), 4, min_np=2, script=few, timeout=0)
    plain = tmp_path / "plain.sh"
    plain.write_text("echo a:4\n")
    with pytest.raises(ConfigError, match="not an executable file"):
        ElasticHosts(Placement(), 4, min_np=2, script=str(plain))


def test_a_lost_host_is_not_taken_back_when_the_script_still_offers_it(tmp_path: Path) -> None:
    script = _script(tmp_path, "printf 'a:2\\nb:2\\n'")
    hosts = ElasticHosts(Placement(), 4, min_np=2, script=script, timeout=0)
    assert hosts.n == 4
    assert hosts.lose("b", [2, 3]) == "2 ranks on hosts a:2"
    assert hosts.more() is None  # b is offered still, but it was lost
