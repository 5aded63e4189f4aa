"""The stall watchdog's blame rule: from the heartbeats heard, which ranks a wait is for."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["HUB", "Blame"]

#: the rank every heartbeat goes to and whose digest of them goes back to every rank: 2(N-1)
#: messages an interval in the whole job, not N(N-1)
HUB = 0


class Blame:
    """Who rank ``rank`` of ``size`` waits for, judged on the heartbeats it heard.

    ``heard`` maps a rank to ``(when its news was current, by this process's clock;
    (seq, phase, seconds waited or -1, armed))``; a rank unheard of for ``stale`` seconds is
    silent. ``hosts`` (per rank) names the ranks' hosts in the stall line. Pure: the watchdog's
    thread holds the news, this rule only reads it (tests feed it recorded heartbeats)."""

    def __init__(self, rank: int, size: int, stale: float, hosts: Sequence[str] = ()) -> None:
        self.rank = rank
        self.size = size
        self.stale = stale
        self.hosts = list(hosts)

    def fresh(self, r: int, now: float, started: float, heard: dict[int, Any]) -> bool:
        """Whether ``r`` was heard within the staleness; the news of a rank other than the hub
        is judged as of the hub's last digest (a late hub does not make them all silent)."""
        if self.rank != HUB and r != HUB and HUB in heard:
            now = heard[HUB][0]
        if r not in heard:
            return now - started < self.stale
        return now - heard[r][0] < self.stale

    def missing(
        self,
        now: float,
        started: float,
        heard: dict[int, Any],
        seq: int,
        phase: str,
        peers: tuple[int, ...] | None,
        collective: bool,
    ) -> list[int]:
        """The peers to blame: the hub when it is silent, else the silent ones; when none is
        silent, for a collective, those not waiting at this phase or a later one (busy
        elsewhere, or behind) -- or, when such a peer is itself waiting elsewhere, the silent
        ranks of the whole job. Only current news (half the staleness) tells that a peer is
        elsewhere: a late hub's is frozen."""
        if self.rank != HUB and not self.fresh(HUB, now, started, heard):
            return [HUB]  # the hub is silent: its news of the others is old, it is to blame
        ranks = [r for r in (peers or range(self.size)) if r != self.rank]
        silent = [r for r in ranks if not self.fresh(r, now, started, heard)]
        if silent or not collective:
            return silent
        out = []
        for r in ranks:
            if r not in heard or now - heard[r][0] > self.stale / 2:  # no news (just listening)
                continue  # or old news (the hub is late): not bad news yet
            rseq, rphase, rwaited, _ = heard[r][1]
            if rwaited < 0 or rseq < seq or (rseq == seq and rphase != phase):
                out.append(r)
        if any(heard[r][1][2] >= 0 for r in out):  # a late peer that itself waits (an EASGD
            # worker in its exchange with a stopped server): blame whom the job waits for
            everyone = (r for r in range(self.size) if r != self.rank)
            silent = [r for r in everyone if not self.fresh(r, now, started, heard)]
            if silent:
                return silent
        return out

    def decider(
        self, now: float, started: float, heard: dict[int, Any], missing: list[int]
    ) -> bool:
        """True when no lower rank that is alive and waiting will report instead. When the hub
        is the silent one, the others' news is as old as its last digest: the lowest rank
        alive then, or never heard of, reports (if it does not, the others do once late)."""
        if self.rank != HUB and HUB in missing:  # a rank never heard of may be alive
            return not any(
                r not in missing and (r not in heard or self.fresh(r, now, started, heard))
                for r in range(HUB + 1, self.rank)
            )
        for r in range(self.rank):
            if r in missing or r not in heard:
                continue
            t, (_, _, rwaited, _) = heard[r]
            if now - t < self.stale and rwaited >= 0:
                return False
        return True

    def names(self, ranks: list[int]) -> str:
        """``rank 1 (nodeb)`` or ``ranks 1 (nodeb), 2 (nodeb)``, for the stall line."""

        def one(r: int) -> str:
            return f"{r} ({self.hosts[r]})" if r < len(self.hosts) else str(r)

        return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(one(r) for r in ranks)
