"""``python _supervised.py GRACE_S``: supervise a 2-rank job whose ranks ignore the stop signal.

Each rank prints ``rank R up`` in one write (a print's pieces can interleave with the other
rank's) and sleeps; SIGUSR1 is ignored, so only the launcher's hard stop (a second signal, or
``GRACE_S`` seconds after the first) ends it. Exits with the launcher's code.
"""

from __future__ import annotations

import sys

from theanompi.launch.mpirun import mpirun_command, mpirun_env
from theanompi.launch.supervise import supervise

RANK = (
    "import os, signal, time; signal.signal(signal.SIGUSR1, signal.SIG_IGN); "
    "os.write(1, f\"rank {os.environ['OMPI_COMM_WORLD_RANK']} up\\n\".encode()); time.sleep(120)"
)

if __name__ == "__main__":
    cmd = mpirun_command(2, [sys.executable, "-c", RANK])
    sys.exit(supervise(cmd, mpirun_env(), grace_s=float(sys.argv[1])).code)
