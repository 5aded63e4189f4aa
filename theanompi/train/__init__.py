"""Training and evaluation runs: the Trainer loop, its parts (schedule, progress, rng, snapshots,
run dir, start-up checks) and ``run``/``evaluate`` that assemble them from a config.

May import every lower layer (launch, config, rules, exchange, models, data, io); never bench or cli.
"""
