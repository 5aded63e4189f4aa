"""Where a job's ranks go: a hostfile, a ``-H`` host list, a Slurm allocation, or this machine."""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from theanompi.errors import ConfigError

__all__ = [
    "Placement",
    "parse_host_list",
    "read_hostfile",
    "expand_slurm_nodelist",
    "slurm_hosts",
    "split_placement_flags",
    "PlacementFlag",
    "PLACEMENT_FLAGS",
    "ENV_HOSTFILE",
    "ENV_HOSTS",
    "ENV_MPI_ARGS",
]

#: the CLI hands ``--hostfile``/``-H``/``--mpi-args`` to the launcher in these variables
ENV_HOSTFILE = "THEANOMPI_HOSTFILE"
ENV_HOSTS = "THEANOMPI_HOSTS"
ENV_MPI_ARGS = "THEANOMPI_MPI_ARGS"


@dataclass(frozen=True)
class PlacementFlag:
    """A command-line flag that says where the ranks go: its names, its variable, its help."""

    names: tuple[str, ...]
    env: str
    metavar: str
    help: str

    def option(self, panel: str) -> Any:
        """The typer option of every command that takes ``-n`` (``tmpi train|eval|run|prep``):
        its value also comes from its variable, where ``tmpi`` puts the flag given anywhere on
        the command line."""
        import typer

        return typer.Option(
            *self.names,
            envvar=self.env,
            metavar=self.metavar,
            help=self.help,
            rich_help_panel=panel,
        )


#: ``--hostfile``, ``-H``/``--host`` and ``--mpi-args``, by the parameter name of every command
#: that takes ``-n`` (the CLI declares its options from this table; :func:`split_placement_flags`
#: reads the same names)
PLACEMENT_FLAGS = {
    "hostfile": PlacementFlag(
        ("--hostfile",),
        ENV_HOSTFILE,
        "<file>",
        "With -n: an Open MPI hostfile, 'HOST slots=N' a line (mpirun --hostfile).",
    ),
    "hosts": PlacementFlag(
        ("-H", "--host"),
        ENV_HOSTS,
        "<host:slots,...>",
        "With -n: hosts and their slots inline, host1:4,host2:4 (as mpirun -H, horovodrun -H).",
    ),
    "mpi_args": PlacementFlag(
        ("--mpi-args",),
        ENV_MPI_ARGS,
        "<words>",
        "With -n: words passed to mpirun as they are, e.g. '--mca btl_tcp_if_include eth0'.",
    ),
}

_HOST_RE = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+$")


def _slots(text: str, where: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"{where}: slots must be a whole number >= 1, got {text!r}")
    return int(text)


def parse_host_list(text: str) -> list[tuple[str, int]]:
    """``"a:2,b:2"`` (as ``mpirun -H`` and ``horovodrun -H``) -> ``[("a", 2), ("b", 2)]``;
    a host without ``:slots`` gets 1.

    >>> parse_host_list("node1:2, node2")
    [('node1', 2), ('node2', 1)]
    """
    hosts: list[tuple[str, int]] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, _, slots = item.partition(":")
        if not name or not _HOST_RE.match(name):
            raise ConfigError(f"-H {text!r}: bad host {item!r}; write host1:slots,host2:slots")
        hosts.append((name, _slots(slots, f"-H {item!r}") if slots else 1))
    if not hosts:
        raise ConfigError(f"-H {text!r} names no host; write host1:slots,host2:slots")
    return hosts


def read_hostfile(path: str | os.PathLike[str]) -> list[tuple[str, int]]:
    """Hosts and slots of an Open MPI hostfile (``host slots=N`` per line, ``#`` comments)."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"--hostfile {str(p)!r}: cannot read it ({e.strerror})") from None
    hosts: list[tuple[str, int]] = []
    for i, raw in enumerate(lines, 1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        name, slots = words[0], 1
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key in ("slots", "max_slots", "max-slots"):
                if key == "slots":
                    slots = _slots(value, f"{p}:{i}")
            else:
                raise ConfigError(f"{p}:{i}: unknown field {word!r}; write 'HOST slots=N'")
        if not _HOST_RE.match(name):
            raise ConfigError(f"{p}:{i}: bad host name {name!r}")
        hosts.append((name, slots))
    if not hosts:
        raise ConfigError(f"--hostfile {str(p)!r} lists no host; write one 'HOST slots=N' a line")
    return hosts


def expand_slurm_nodelist(text: str) -> list[str]:
    """Slurm's compressed node list -> host names.

    >>> expand_slurm_nodelist("gpu[01-03,07],login")
    ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'login']
    """
    names: list[str] = []
    for prefix, ranges, _ in re.findall(r"([^,\[]+)(?:\[([^\]]*)\])?(,|$)", text):
        if not ranges:
            names.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not hi:
                names.append(prefix + lo)
                continue
            names += [prefix + str(k).zfill(len(lo)) for k in range(int(lo), int(hi) + 1)]
    return names


def _expand_counts(text: str) -> list[int]:
    """``"2(x3),1"`` (SLURM_TASKS_PER_NODE) -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in filter(None, text.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return []
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def slurm_hosts(env: Mapping[str, str]) -> list[tuple[str, int]]:
    """The allocation's hosts and tasks per host, from Slurm's environment ([] outside one)."""
    if not env.get("SLURM_JOB_ID"):
        return []
    names = expand_slurm_nodelist(env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "")))
    per = env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_JOB_CPUS_PER_NODE", "")
    counts = _expand_counts(per)
    if len(counts) != len(names):
        counts = [1] * len(names)
    return list(zip(names, counts, strict=True))


@dataclass(frozen=True)
class Placement:
    """Hosts for ``mpirun`` and extra mpirun arguments.

    ``hosts`` empty and ``hostfile`` None: this machine only (or, inside a Slurm allocation,
    the allocation, which mpirun reads itself: ``slurm`` is then True; ``pinned``: only
    ``hosts`` of it, after an elastic job lost one).
    """

    hostfile: Path | None = None
    hosts: tuple[tuple[str, int], ...] = ()
    mpi_args: tuple[str, ...] = ()
    slurm: bool = False
    pinned: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Placement:
        """From ``THEANOMPI_HOSTFILE`` / ``THEANOMPI_HOSTS`` / ``THEANOMPI_MPI_ARGS`` (set by
        the CLI's flags) or, with neither host variable set, a Slurm allocation."""
        env = os.environ if env is None else env
        hostfile = env.get(ENV_HOSTFILE) or None
        host_text = env.get(ENV_HOSTS) or None
        if hostfile and host_text:
            raise ConfigError("give --hostfile or -H, not both")
        try:
            mpi_args = tuple(shlex.split(env.get(ENV_MPI_ARGS, "")))
        except ValueError as e:
            raise ConfigError(f"--mpi-args {env.get(ENV_MPI_ARGS)!r}: {e}") from None
        if hostfile:
            path = Path(hostfile).resolve()
            return cls(hostfile=path, hosts=tuple(read_hostfile(path)), mpi_args=mpi_args)
        if host_text:
            return cls(hosts=tuple(parse_host_list(host_text)), mpi_args=mpi_args)
        slurm = slurm_hosts(env)
        return cls(hosts=tuple(slurm), mpi_args=mpi_args, slurm=bool(slurm))

    @classmethod
    def from_flags(
        cls,
        hostfile: str | os.PathLike[str] | None = None,
        hosts: str | None = None,
        mpi_args: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Placement:
        """From the values of ``--hostfile``, ``-H`` and ``--mpi-args`` (None: not given),
        each in place of its variable in ``env`` (default: the environment)."""
        merged = dict(os.environ if env is None else env)
        given = {"hostfile": hostfile, "hosts": hosts, "mpi_args": mpi_args}
        for name, value in given.items():
            if value is not None:
                merged[PLACEMENT_FLAGS[name].env] = str(value)
        return cls.from_env(merged)

    def without(self, host: str, ranks: Sequence[int] = (), n: int = 0) -> Placement:
        """These hosts less ``host``, a host lost by an elastic job of ``n`` ranks that ran
        ``ranks`` there, given inline. ``host`` is the name mpirun reported: an entry of that
        name or address, else the entry those ranks filled (mpirun fills each host's slots in
        order); unchanged where neither tells."""
        gone = {h for h, _ in self.hosts if _same_host(h, host)}
        if not gone and ranks and n <= self.slots:
            fill = [h for h, s in self.hosts for _ in range(s)]
            gone = {fill[r] for r in ranks if r < len(fill)}
        if not gone:
            return self
        left = tuple(e for e in self.hosts if e[0] not in gone)
        return replace(self, hostfile=None, hosts=left, pinned=self.slurm)

    @property
    def slots(self) -> int:
        """Slots over all hosts (0: this machine, no limit)."""
        return sum(s for _, s in self.hosts)

    def mpirun_args(self, n: int) -> list[str]:
        """mpirun's host arguments for ``n`` ranks: none for this machine; in a Slurm
        allocation, none for the hosts (mpirun reads it) but the daemons' launch agent."""
        if self.hosts and not self.slurm and n > self.slots:
            where = f"--hostfile {self.hostfile}" if self.hostfile else "-H"
            raise ConfigError(
                f"-n {n} but {where} gives {self.slots} slots "
                f"({', '.join(f'{h}:{s}' for h, s in self.hosts)}); lower -n or add slots"
            )
        if self.hostfile is not None:
            return ["--hostfile", str(self.hostfile)]
        if self.hosts and not self.slurm:
            return ["--host", ",".join(f"{h}:{s}" for h, s in self.hosts)]
        if self.slurm:  # mpirun reads the allocation; its daemons must outlive Slurm's USR1
            from theanompi.launch.slurm import prted_agent_args

            pinned = ["--host", ",".join(f"{h}:{s}" for h, s in self.hosts)] if self.pinned else []
            return pinned + prted_agent_args()
        return []

    def describe(self, n: int) -> str:
        """One line for the launcher: where the ``n`` ranks go."""
        if not self.hosts:
            return f"{n} ranks on this machine"
        source = "Slurm allocation" if self.slurm else "hosts"
        return f"{n} ranks on {source} " + ", ".join(f"{h}:{s}" for h, s in self.hosts)


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _same_host(entry: str, name: str) -> bool:
    """A placement entry (a name or an address) is the host mpirun called ``name``."""
    if entry == name:
        return True
    if not (_is_address(entry) or _is_address(name)) and entry.split(".")[0] == name.split(".")[0]:
        return True  # node1 and node1.cluster.org
    try:
        ours = {a[4][0] for a in socket.getaddrinfo(entry, None)}
        theirs = {a[4][0] for a in socket.getaddrinfo(name, None)}
    except OSError:  # a name this machine cannot resolve
        return False
    return bool(ours & theirs)


def split_placement_flags(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """Take ``--hostfile F``, ``-H LIST``/``--host LIST`` and ``--mpi-args "..."`` (also as
    ``--flag=value``) out of a command line: (their env variables, the rest).

    Anywhere on the line: before the subcommand, after it, or for ``tmpi bench``, whose
    commands hand their arguments on; the commands with ``-n`` read the variables back as
    their options' values."""
    names = {name: f.env for f in PLACEMENT_FLAGS.values() for name in f.names}
    found: dict[str, str] = {}
    rest: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg == "--":
            rest += [arg, *it]
            break
        flag, eq, value = arg.partition("=")
        if flag in names and (eq or arg in names):
            if not eq:
                value = next(it, None)  # type: ignore[assignment]
                if value is None:
                    raise ConfigError(f"{flag} needs a value")
            if names[flag] in found:
                raise ConfigError(f"{flag} given twice")
            found[names[flag]] = value
        else:
            rest.append(arg)
    return found, rest
