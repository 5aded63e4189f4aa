"""Starting and watching a job: hosts, the mpirun line, supervision, signals, stall watchdog,
the simulated cluster.

May import config, comm, errors and io; never train, bench or cli.
"""
