"""Run as a user's script (``tmpi run -n N`` or ``mpirun -n N python``): ``tm.fit`` on the digits
data. ``python mpi_fit_digits.py DATA RUN_DIR SUMMARY.json [section.key=value ...]``."""

from __future__ import annotations

import json
import sys

import yaml

import theanompi as tm

data, run_dir, out = sys.argv[1:4]
overrides = {"data.dir": data, "output.run_dir": run_dir, "model.n_epochs": 1}
overrides["training.max_steps"] = 4
for text in sys.argv[4:]:
    key, _, value = text.partition("=")
    overrides[key] = yaml.safe_load(value)
summary = tm.fit(tm.load_config(model="digits", overrides=overrides))
if tm.rank() == 0:
    with open(out, "w") as f:
        json.dump(summary, f)
