"""The headers precompiled once per compile dir (:mod:`theanompi.models.ops._headers`): every
module compiled in a cold cache reads them precompiled (g++'s ``-H`` marks a valid ``.gch``
with ``!``), carries no debug information, and computes what numpy does; the next
process that compiles in the same dir builds no header again."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from theanompi.launch.testing import REPO

GRAPH = textwrap.dedent(
    """
    import sys
    from theanompi.pytensor_env import configure
    configure()
    import numpy as np, pytensor, pytensor.tensor as pt
    from theanompi.models.ops import compile_mode
    dtype = sys.argv[1]  # another dtype: other modules to compile
    x, z = pt.matrix("x", dtype=dtype), pt.tensor3("z", dtype=dtype)
    outs = [pt.exp(x) * 2 + 1, (z * 3).sum(axis=1), pt.tanh(x).T @ x]  # 3 kinds of module
    f = pytensor.function([x, z], outs, mode=compile_mode("c"))
    rng = np.random.default_rng(0)
    a, c = rng.random((3, 3)).astype(dtype), rng.random((2, 3, 2)).astype(dtype)
    ref = [np.exp(a) * 2 + 1, (c * 3).sum(axis=1), np.tanh(a).T @ a]
    g = pytensor.function([x], pt.cosh(x) * 5)  # one module: PyTensor's own link compiles it
    ref.append(np.cosh(a) * 5)
    print(all(np.allclose(o, r, rtol=1e-5) for o, r in zip(f(a, c) + [g(a)], ref)))
    """
)


def _cold_build(tmp_path: Path, cache: Path, dtype: str) -> list[str]:
    """Build ``GRAPH`` in ``dtype`` with ``cache`` as the compile cache, g++ run through a
    wrapper that adds ``-H`` and keeps the lines naming a precompiled header; those lines."""
    log = tmp_path / "gch.log"
    log.unlink(missing_ok=True)
    wrapper = tmp_path / "bin" / "g++"  # PyTensor wants a compiler named g++
    wrapper.parent.mkdir(exist_ok=True)
    wrapper.write_text(
        f'#!/bin/bash\n{shutil.which("g++")} "$@" -H 2> >(grep -F .gch >> {log}; cat > /dev/null)\n'
    )
    wrapper.chmod(0o755)
    env = os.environ | {
        "THEANOMPI_CACHE": str(cache),
        "PYTENSOR_FLAGS": f"cxx={wrapper}",
        "PYTHONPATH": str(REPO),
    }
    out = subprocess.run(
        [sys.executable, "-c", GRAPH, dtype], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0 and out.stdout.split() == ["True"], out.stderr[-3000:]
    return log.read_text().splitlines() if log.exists() else []


def test_modules_read_the_headers_precompiled_and_carry_no_debug_information(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    lines = _cold_build(tmp_path, cache, "float32")
    (folder,) = cache.glob("pytensor/*/*/theanompi-headers.h.gch")
    built = sorted(folder.iterdir())
    assert len(built) == 2, built  # with and without OpenMP
    used = [ln for ln in lines if ln.startswith("! ")]
    modules = list(folder.parent.glob("tmp*/*.so"))
    assert len(modules) >= 3 and len(used) == len(modules), (lines, modules)  # every one
    assert {Path(ln[2:].strip()) for ln in used} == set(built), lines  # each kind used
    assert not any(b".debug_info" in p.read_bytes() for p in modules)
    made = {p: p.stat().st_mtime_ns for p in built}
    lines = _cold_build(tmp_path, cache, "float64")  # new modules in the same dir: no header built
    assert {p: p.stat().st_mtime_ns for p in folder.iterdir()} == made
    assert sum(ln.startswith("! ") for ln in lines) >= 2, lines
