"""A simulated two-node cluster on one Linux machine: network namespaces joined by a veth pair.

Each node is a network namespace with its own address (198.18.0.1, 198.18.0.2: the
benchmarking range) and, for every process started in it, its own host name (a UTS
namespace). ``mpirun`` runs on the first node and reaches the second through a launch agent
(``--mca plm_rsh_agent``) that stands in for ssh: it drops ssh's options, maps the host to
its namespace and runs the command there. Open MPI's TCP transport then crosses the veth.
Needs root, ``ip`` (iproute2) and ``unshare`` (util-linux).

    with SimCluster(workdir) as cluster:
        subprocess.run(cluster.on_head(["tmpi", "train", "-n", "4", "--hostfile",
                       str(cluster.hostfile), "--mpi-args", cluster.mpi_args]))
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from theanompi.launch.launcher_watch import pid_alive

__all__ = ["SimCluster", "unavailable", "remove_stale", "PREFIX", "main"]

#: namespace names are PREFIX<creator pid>x<serial><node letter>; a dead creator means stale
PREFIX = "tmpisim"
_VETH = "tsv"  # veth names: tsv<pid>x<serial><letter> (at most 15 characters)
_NAME_RE = re.compile(rf"^(?:{PREFIX}|{_VETH})(\d+)x\d+[a-z]$")
_serial = itertools.count()

_AGENT = """#!/bin/sh
# Launch agent standing in for ssh (written by theanompi.launch.simcluster): drop ssh's options,
# map the host to its node's namespace, run the command there under that node's host name.
while [ $# -gt 0 ]; do
  case "$1" in
    -[1246AaCfGgKkMNnqsTtVvXxYy]*) shift ;;
    -*) shift 2 ;;
    *) break ;;
  esac
done
host="$1"; shift
case "$host" in
{cases}
  *) echo "simcluster agent: unknown host $host" >&2; exit 255 ;;
esac
# like ssh, stay on this side and exit 255 when the remote side dies of a signal, silently:
# the command's stderr is fd 3, this shell's own "Killed" goes to /dev/null
ip netns exec "$ns" unshare --uts sh -c "exec 2>&3 3>&-; hostname $name; $setup $*" 3>&2 2>/dev/null
rc=$?
[ "$rc" -gt 128 ] && exit 255
exit "$rc"
"""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable() -> str | None:
    """Why a simulated cluster cannot be built here (None: it can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool!r} is not installed"
    if _ip("netns", "list", check=False).returncode != 0:
        return "'ip netns' does not work here"
    return None


def _kill_namespace(ns: str) -> None:
    """SIGKILL every process in namespace ``ns``, then delete it (and the veth end in it)."""
    for _ in range(20):
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    _ip("netns", "del", ns, check=False)


def remove_stale() -> list[str]:
    """Delete the namespaces and veths of simulated clusters whose creator has died."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME_RE.match(name)
        if m and not pid_alive(int(m.group(1))):
            _kill_namespace(name)
            removed.append(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        name = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        m = _NAME_RE.match(name)
        if m and not pid_alive(int(m.group(1))):
            _ip("link", "del", name, check=False)
            removed.append(name)
    return removed


class SimCluster:
    """Two nodes (``nodea`` at 198.18.0.1, ``nodeb`` at 198.18.0.2), ``slots`` ranks each.

    ``up()`` builds them (removing stale ones first), ``down()`` tears them down, killing
    every process left in them; as a context manager, down always runs. The files it writes
    in ``workdir``: ``hostfile`` and the launch agent ``agent.sh``.
    """

    hostnames = ("nodea", "nodeb")
    addresses = ("198.18.0.1", "198.18.0.2")

    def __init__(self, workdir: str | os.PathLike[str], slots: int = 2) -> None:
        self.workdir = Path(workdir)
        self.slots = slots
        tag = f"{os.getpid()}x{next(_serial)}"
        self.namespaces = tuple(f"{PREFIX}{tag}{c}" for c in "ab")
        self._veths = tuple(f"{_VETH}{tag}{c}" for c in "ab")
        self.hostfile = self.workdir / "hostfile"
        self.agent = self.workdir / "agent.sh"
        self._up = False
        self._setup = ["", ""]

    @property
    def mpi_args(self) -> str:
        """mpirun arguments for this cluster: the launch agent, TCP over the veth only, and
        ranks that yield while they wait (2 ranks per node share this machine's cores)."""
        net = "198.18.0.0/15"
        return (
            f"--mca plm_rsh_agent {self.agent} "
            f"--mca btl_tcp_if_include {net} --mca oob_tcp_if_include {net} "
            "--mca mpi_yield_when_idle 1"
        )

    @property
    def host_list(self) -> str:
        """The ``-H`` form of the hostfile."""
        return ",".join(f"{a}:{self.slots}" for a in self.addresses)

    def up(self) -> SimCluster:
        remove_stale()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._up = True
        try:
            (na, nb), (va, vb) = self.namespaces, self._veths
            _ip("netns", "add", na)
            _ip("netns", "add", nb)
            _ip("link", "add", va, "type", "veth", "peer", "name", vb)
            _ip("link", "set", va, "netns", na)
            _ip("link", "set", vb, "netns", nb)
            for ns, veth, addr in zip(self.namespaces, self._veths, self.addresses, strict=True):
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", veth, "up")
        except subprocess.CalledProcessError as e:
            self.down()
            raise RuntimeError(f"simulated cluster: {' '.join(e.cmd)}: {e.stderr.strip()}") from e
        self.hostfile.write_text("".join(f"{a} slots={self.slots}\n" for a in self.addresses))
        self._write_agent()
        return self

    def _write_agent(self) -> None:
        cases = "\n".join(
            f"  {addr}|{name}) ns={ns}; name={name}; setup={shlex.quote(setup)} ;;"
            for addr, name, ns, setup in zip(
                self.addresses, self.hostnames, self.namespaces, self._setup, strict=True
            )
        )
        tmp = self.agent.with_suffix(".tmp")
        tmp.write_text(_AGENT.format(cases=cases))
        tmp.chmod(0o755)
        tmp.replace(self.agent)

    @contextlib.contextmanager
    def node_setup(self, node: int, script: str) -> Iterator[None]:
        """While in the ``with``, run shell ``script`` on node ``node`` before every command
        started there (e.g. ``mount --bind A B;``: each command gets its own mount namespace,
        so a node can see different files at the same path)."""
        if node == 0:
            raise ValueError("node_setup applies to the nodes mpirun reaches through the agent")
        self._setup[node] = script.rstrip().rstrip(";") + ";"
        self._write_agent()
        try:
            yield
        finally:
            self._setup[node] = ""
            self._write_agent()

    def down(self) -> None:
        if not self._up:
            return
        for ns in self.namespaces:
            _kill_namespace(ns)
        for veth in self._veths:  # only left when up() failed before moving it
            _ip("link", "del", veth, check=False)
        self._up = False

    def __enter__(self) -> SimCluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def on_node(self, node: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run on node ``node`` (0 = the head, where mpirun runs), as its host."""
        ns, name = self.namespaces[node], self.hostnames[node]
        script = 'hostname "$0" && exec "$@"'
        return ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", script, name, *argv]

    def on_head(self, argv: Sequence[str]) -> list[str]:
        return self.on_node(0, argv)

    def pids(self, node: int) -> list[int]:
        """Processes running in node ``node``'s namespace."""
        out = _ip("netns", "pids", self.namespaces[node], check=False).stdout
        return [int(p) for p in out.split()]

    @property
    def interfaces(self) -> tuple[str, ...]:
        """Each node's end of the veth (e.g. for ``GLOO_SOCKET_IFNAME``)."""
        return self._veths

    def shape(
        self,
        rate: str = "10gbit",
        delay: str = "25us",
        *,
        tbf: bool = False,
        burst: str = "1mb",
        latency: str = "10ms",
    ) -> str:
        """Shape both ends of the link: ``tc netem`` rate and one-way delay, or, with ``tbf``
        or where the kernel lacks netem, ``tc tbf`` rate with ``burst`` and ``latency`` (the
        queue's bound, not an added delay). Returns what was applied."""

        def qdisc(ns: str, veth: str, *spec: str) -> bool:
            cmd = ["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", veth, "root"]
            return subprocess.run([*cmd, *spec], capture_output=True).returncode == 0

        pairs = list(zip(self.namespaces, self._veths, strict=True))
        if not tbf and all(qdisc(ns, v, "netem", "rate", rate, "delay", delay) for ns, v in pairs):
            return f"netem rate {rate} delay {delay}"
        for ns, veth in pairs:
            if not qdisc(ns, veth, "tbf", "rate", rate, "burst", burst, "latency", latency):
                raise RuntimeError(f"simulated cluster: tc cannot shape {veth} (netem, tbf)")
        why = "" if tbf else " (no netem in this kernel: no added delay)"
        return f"tbf rate {rate} burst {burst} latency {latency}{why}"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m theanompi.launch.simcluster up DIR`` (builds, prints the mpirun arguments, waits
    until Ctrl-C or SIGTERM, then tears down) or ``clean`` (removes stale clusters)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["clean"]:
        print("\n".join(remove_stale()) or "nothing stale")
        return 0
    if len(args) != 2 or args[0] != "up":
        print("usage: python -m theanompi.launch.simcluster up DIR | clean", file=sys.stderr)
        return 2
    why = unavailable()
    if why:
        print(f"simcluster: {why}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with SimCluster(args[1]) as cluster:
        print(f"hostfile:  {cluster.hostfile}")
        print(f"mpi args:  {cluster.mpi_args}")
        print(f"head node: {' '.join(cluster.on_head(['CMD']))}", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
