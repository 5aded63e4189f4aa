"""The hosts of an elastic job (``tmpi train -n N --min-np M``): a lost host leaves, and the
host discovery script's new slots come in (as ``horovodrun --host-discovery-script``).

The ranks themselves go on after a lost rank (:mod:`theanompi.train.elastic`); what they
cannot survive, mpirun's own end, is the launcher's: a lost host (Open MPI's runtime ends the
job when it loses a daemon) and a grown one (an mpirun job's hosts are fixed at its start).
Either way the launcher relaunches on the hosts of now, with ``--resume``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from theanompi.errors import ConfigError
from theanompi.launch.hosts import Placement, parse_host_list

__all__ = ["DISCOVERY_TIMEOUT_S", "ElasticHosts", "discover"]

DISCOVERY_TIMEOUT_S = 10.0  # a discovery script that takes longer is skipped this time
WAIT_POLL_S = 2.0  # how often the hosts are asked again while too few slots are offered


def discover(script: str) -> list[tuple[str, int]] | None:
    """The hosts ``script`` offers now: its stdout, one ``host:slots`` (or ``host``, 1 slot) a
    line; None (and a warning) when it fails, times out or prints no host."""
    try:
        out = subprocess.run(
            [script], capture_output=True, text=True, timeout=DISCOVERY_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        _warn(f"host discovery script {script}: {type(err).__name__}: {err}")
        return None
    lines = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
    if out.returncode != 0 or not lines:
        _warn(f"host discovery script {script}: exit {out.returncode}, {len(lines)} host(s)")
        return None
    try:
        return parse_host_list(",".join(lines))
    except ConfigError as err:
        _warn(f"host discovery script {script}: {err}")
        return None


def _warn(text: str) -> None:
    print(f"tmpi: warning: {text}", file=sys.stderr, flush=True)


def _say(text: str) -> None:
    print(f"tmpi: elastic: {text}", file=sys.stderr, flush=True)


class ElasticHosts:
    """Where an elastic job runs now: ``placement`` and ``n`` ranks on it, at least ``min_np``
    and at most ``max_np`` (0: the ``n`` asked for), from the discovery ``script`` when given.

    Parameters
    ----------
    placement, n
        The hosts and ranks asked for (``--hostfile``/``-H``/this machine, ``-n``); with a
        ``script``, its hosts replace them.
    min_np, max_np
        The fewest ranks to go on with, the most to grow to (0: ``n``).
    script
        The host discovery script (empty: none; the hosts only ever shrink).
    timeout
        Seconds to wait for the script to offer ``min_np`` slots (at the start, after a loss).
    in_place
        The ranks left after a lost rank go on in the same job (mpirun with ULFM; BSP);
        otherwise (EASGD, GOSGD, ZeRO-1, the overlapped exchange) the job is relaunched on
        one rank fewer (:meth:`fewer`).
    """

    def __init__(
        self,
        placement: Placement,
        n: int,
        *,
        min_np: int,
        max_np: int = 0,
        script: str = "",
        timeout: float = 600.0,
        in_place: bool = True,
    ) -> None:
        self.placement, self.n = placement, n
        self.in_place = in_place
        self.min_np, self.max_np = min_np, max_np or n
        self.script, self.timeout = script, timeout
        self._offered: list[tuple[str, int]] = []  # the hosts more() found
        self._lost: set[str] = set()  # hosts lost: never taken back in this job (as Horovod's)
        if script and not (Path(script).is_file() and Path(script).stat().st_mode & 0o111):
            raise ConfigError(
                f"--host-discovery-script {script}: not an executable file; chmod +x it, or "
                "give its path"
            )
        if script:
            hosts = self._wait_for(self.min_np, "to start")
            if hosts is None:
                raise ConfigError(
                    f"--host-discovery-script {script} offered fewer than --min-np "
                    f"{min_np} slots for {timeout:g} s (elastic.timeout)"
                )
            self._take(hosts)

    def _take(self, hosts: Sequence[tuple[str, int]]) -> str:
        """Run on ``hosts`` from now on, as many ranks as they hold (at most ``max_np``)."""
        self.placement = Placement(hosts=tuple(hosts), mpi_args=self.placement.mpi_args)
        self.n = min(self.max_np, self.placement.slots)
        return self.placement.describe(self.n)

    def _wait_for(self, slots: int, why: str) -> list[tuple[str, int]] | None:
        """The script's hosts once they offer ``slots`` slots; None after ``timeout`` s."""
        deadline = time.monotonic() + self.timeout
        said = False
        while True:
            hosts = self._discover()
            if hosts is not None and sum(s for _, s in hosts) >= slots:
                return hosts
            if time.monotonic() > deadline:
                return None
            if not said:
                _say(f"waiting up to {self.timeout:g} s for {slots} slots {why}")
                said = True
            time.sleep(WAIT_POLL_S)

    def _discover(self) -> list[tuple[str, int]] | None:
        """The script's hosts, less those lost."""
        hosts = discover(self.script)
        kept = [e for e in hosts or [] if e[0] not in self._lost]
        return kept or None

    def lose(self, host: str, ranks: Sequence[int]) -> str | None:
        """Go on without ``host``, which ran ``ranks``: where (the next launch's hosts; in a
        Slurm allocation, those of it), or None (too few slots left, or not known which host
        it was)."""
        left = self.placement.without(host, ranks, self.n)
        self._lost |= {h for h, _ in self.placement.hosts} - {h for h, _ in left.hosts}
        if left == self.placement:
            why = f"{host} is none of the hosts given ({self.placement.describe(self.n)})"
        elif left.slots < self.min_np and self.script:
            hosts = self._wait_for(self.min_np, f"without {host}")
            if hosts is not None:
                return self._take(hosts)
            why = f"fewer than --min-np {self.min_np} slots offered for {self.timeout:g} s"
        elif left.slots < self.min_np:
            why = f"{left.slots} slot(s) left, fewer than --min-np {self.min_np}"
        else:
            self.placement, self.n = left, min(self.n, left.slots)
            return left.describe(self.n)
        _say(f"going on without {host}: {why}")
        return None

    def fewer(self) -> str | None:
        """Go on with one rank fewer (a rule that cannot shrink in place lost one): where, or
        None below ``min_np``."""
        if self.n - 1 < self.min_np:
            _say(f"going on without a rank: {self.n - 1} left, fewer than --min-np {self.min_np}")
            return None
        self.n -= 1
        return self.placement.describe(self.n)

    def refill(self) -> str | None:
        """The ranks left in place fell below ``min_np`` (their line said so): with a script,
        where the job goes on once it offers ``min_np`` slots (within ``timeout``); else None,
        and the job ends as its ranks said."""
        if not self.script:
            return None
        hosts = self._wait_for(self.min_np, f"to go on (fewer than --min-np {self.min_np} left)")
        if hosts is None:
            _say(f"fewer than --min-np {self.min_np} slots offered for {self.timeout:g} s")
            return None
        return self._take(hosts)

    def more(self) -> str | None:
        """The launcher's watch while the job runs: the hosts that the script offers now, when
        they hold more slots than the job uses and it may grow (``max_np``); else None."""
        if not self.script or self.n >= self.max_np:
            return None
        hosts = self._discover()
        if hosts is None or min(self.max_np, sum(s for _, s in hosts)) <= self.n:
            return None
        self._offered = hosts
        return "elastic: the host discovery script offers " + ", ".join(
            f"{h}:{s}" for h, s in hosts
        )

    def grow(self) -> str:
        """Take the hosts :meth:`more` found: where the next launch runs."""
        return self._take(self._offered)
