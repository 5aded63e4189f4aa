"""Run by test_watchdog_messages.py under mpirun: the watchdog's thread alone for a second."""

import json
import sys
import time

from mpi4py import MPI

from theanompi.launch.blame import HUB
from theanompi.launch.watchdog import Watchdog

INTERVAL = 0.05
comm = MPI.COMM_WORLD
wd = Watchdog(comm, 60.0, interval=INTERVAL)
comm.Barrier()
t0 = time.monotonic()
wd.start()
time.sleep(1.0)
ages = {r: time.monotonic() - t for r, (t, _) in wd.heard.items()}
wd.close()
ticks = int((time.monotonic() - t0) / INTERVAL)
rows = comm.gather((wd.rank, wd.sent, ticks, sorted(ages), max(ages.values()), wd.stale), root=HUB)
if comm.Get_rank() == HUB:
    json.dump(rows, open(sys.argv[1], "w"))
