"""Peak memory in the benchmarks, the allocator settings that bound it, and the parallel compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from theanompi.bench._memory import MB, peak_rss_bytes, reset_peak_rss, rss_bytes
from theanompi.bench.train import _table


def test_peak_rss_follows_a_touched_array_and_resets() -> None:
    if not reset_peak_rss():  # from here on: earlier tests in this process may have peaked higher
        pytest.skip("this kernel cannot reset VmHWM")
    before = peak_rss_bytes()
    a = np.ones(96 * MB // 8)  # written: resident, not just reserved
    grown = peak_rss_bytes()
    assert grown >= before + 80 * MB and grown >= rss_bytes()
    del a
    assert reset_peak_rss()
    assert peak_rss_bytes() <= grown - 80 * MB


_ALLOCATOR = """
import json, numpy as np
from theanompi.pytensor_env import HEAP_BLOCK_MAX, configure
from theanompi.bench._memory import MB, rss_bytes
configure()
out = {}
base = rss_bytes()
big = [np.ones(4 * HEAP_BLOCK_MAX // 8) for _ in range(8)]   # above the threshold: own mmaps
del big
out["big_kept"] = (rss_bytes() - base) / MB
base = rss_bytes()
small = [np.ones(HEAP_BLOCK_MAX // 4 // 8) for _ in range(64)]   # below it: the heap
del small
out["small_kept"] = (rss_bytes() - base) / MB
out["small_total"] = 64 * HEAP_BLOCK_MAX / 4 / MB
print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_large_blocks_go_back_small_blocks_stay_mapped() -> None:
    """Blocks above HEAP_BLOCK_MAX return to the kernel on free (else the heap keeps a second
    copy of AlexNet's weights); smaller ones stay mapped for the next step (no page faults)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTENSOR_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "-c", _ALLOCATOR], capture_output=True, text=True, env=env, check=True
    )
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["big_kept"] < 8, r  # 128 MiB allocated and freed: (almost) nothing stays
    assert r["small_kept"] > 0.8 * r["small_total"], r  # 64 MiB kept for reuse


def test_train_table_shows_peak_rss_per_rank() -> None:
    row = {
        "n": 2,
        "independent": False,
        "batch_size": 32,
        "images_per_s": 6.8,
        "step_s": 9.4,
        "compute_s": 8.6,
        "exchange_s": 0.6,
        "wait_s": 0.0,
        "param_mb": 232.6,
        "peak_rss_mb": 1439.4,
        "peak_rss_mb_per_rank": [1439.4, 1421.0],
        "peak_rss_x_params": 1439.4 / 232.6,
    }
    line = _table([row]).splitlines()[2]
    assert "1439 (6.2x) [1439 1421]" in line


_PRECOMPILE = """
import json
from theanompi.pytensor_env import configure
configure()
import numpy as np, pytensor, pytensor.tensor as pt
from pytensor.link.c.basic import get_module_cache
from theanompi.models.ops import _parallel, compile_mode
counts = []
real = _parallel.precompile
_parallel.precompile = lambda fg, workers=None: counts.append(real(fg, 2)) or counts[-1]
x, y, z = pt.matrix("x"), pt.vector("y"), pt.tensor3("z")
outs = [pt.exp(x) * 2 + 1, pt.log1p(y) ** 2, (z * 3).sum(axis=1), pt.tanh(x).T @ x]
f = pytensor.function([x, y, z], outs, mode=compile_mode("c"))
rng = np.random.default_rng(0)
a, b, c = (rng.random(s, dtype=np.float32) for s in [(3, 3), (4,), (2, 3, 2)])
ref = [np.exp(a) * 2 + 1, np.log1p(b) ** 2, (c * 3).sum(axis=1), np.tanh(a).T @ a]
err = max(float(np.max(np.abs(np.asarray(o) - r) / (1 + np.abs(r)))) for o, r in zip(f(a, b, c), ref))
print(json.dumps({"precompiled": counts, "compiled_at_link": get_module_cache().stats[2], "err": err}))
"""


@pytest.mark.slow
def test_parallel_precompile_fills_the_cache_before_the_link(tmp_path: Path) -> None:
    """A cold graph's modules are compiled by the thread pool; PyTensor's own link then
    compiles none of them, and the function computes what numpy does."""
    env = {k: v for k, v in os.environ.items() if k != "PYTENSOR_FLAGS"}
    env["THEANOMPI_CACHE"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-c", _PRECOMPILE], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["precompiled"] and r["precompiled"][0] >= 4, r
    assert r["compiled_at_link"] == 0, r
    assert r["err"] < 1e-5, r
