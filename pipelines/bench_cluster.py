"""``tmpi bench exchange`` across the simulated two-node cluster, plain and shaped (root only).

python pipelines/bench_cluster.py [--rate 10gbit --delay 25us] [bench exchange args...]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile

from theanompi.launch.mpirun import mpirun_env
from theanompi.launch.simcluster import SimCluster, unavailable
from theanompi.launch.testing import REPO


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="10gbit", help="tc netem rate of the shaped run")
    p.add_argument("--delay", default="25us", help="tc netem one-way delay of the shaped run")
    p.add_argument("--only", choices=["plain", "shaped"], help="run one of the two")
    args, bench = p.parse_known_args()
    why = unavailable()
    if why:
        print(f"bench_cluster: {why}", file=sys.stderr)
        return 2
    bench = bench or ["--sizes", "4", "--sets", "alexnet", "--reps", "3"]
    env = mpirun_env(os.environ | {"PYTHONPATH": str(REPO)})
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # tear the cluster down
    with tempfile.TemporaryDirectory() as tmp, SimCluster(tmp) as cluster:
        for label in [x for x in ("plain", "shaped") if args.only in (None, x)]:
            if label == "shaped":
                label += ": " + cluster.shape(args.rate, args.delay)
            print(f"== {label}", flush=True)
            argv = [sys.executable, "-m", "theanompi.cli", "bench", "exchange", *bench]
            argv += ["--hostfile", str(cluster.hostfile), "--mpi-args", cluster.mpi_args]
            rc = subprocess.run(cluster.on_head(argv), env=env, cwd=REPO).returncode
            if rc:
                return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
