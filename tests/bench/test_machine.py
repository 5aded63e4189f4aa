"""The machine line every compute benchmark prints beside its ratios (issue 41): the CPU, the
instruction sets that pick the kernels, and the kernel family OpenBLAS chose for it, or that
``OPENBLAS_CORETYPE`` set, beside OpenBLAS's own pick."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from theanompi.bench._machine import ISA_FLAGS, _cpuinfo, describe, machine_line

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx fma avx2 avx512f avx512bw avx512_bf16 amx_tile amx_int8
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu
"""


def test_a_written_cpuinfo_is_read_as_the_kernel_picking_flags(tmp_path: Path) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    m = describe(path)
    assert m["cpu"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert m["isa"] == ["avx2", "fma", "avx512f", "avx512_bf16", "amx_tile"]  # ISA_FLAGS' order
    line = machine_line(m)
    assert line.startswith("machine: Intel(R) Xeon(R) Platinum 8480+, ")
    assert "avx2 fma avx512f avx512_bf16 amx_tile; BLAS " in line


def test_this_machine_after_a_gemm_names_openblas_and_its_kernel() -> None:
    """After PyTensor ran a GEMM its OpenBLAS is loaded: threadpoolctl names the kernel
    family (``SkylakeX``, ``Haswell``, ...) and the flags agree with /proc/cpuinfo."""
    import numpy as np
    import pytensor
    import pytensor.tensor as pt

    x = pt.matrix("x", dtype="float32")
    pytensor.function([x], x.dot(x))(np.ones((8, 8), np.float32))
    m = describe()
    assert m["blas"].startswith("openblas ") and m["blas_kernel"] not in ("?", "not loaded yet")
    flags = set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        flags = {
            f
            for ln in cpuinfo.read_text().splitlines()
            if ln.startswith("flags")
            for f in ln.split()
        }
    assert m["isa"] == [f for f in ISA_FLAGS if f in flags]
    line = machine_line(m)
    assert f"({m['blas_kernel']} kernel" in line and f" {m['blas_threads']} threads)" in line


#: a fresh process: a GEMM through PyTensor, then :func:`describe` as JSON
_DESCRIBE = """import json
import numpy as np
import pytensor
import pytensor.tensor as pt
from theanompi.pytensor_env import configure
configure()
from theanompi.bench._machine import describe
x = pt.matrix("x", dtype="float32")
pytensor.function([x], x.dot(x))(np.ones((8, 8), np.float32))
print(json.dumps(describe()))
"""


def _describe_in(env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", _DESCRIBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.skipif("avx2" not in _cpuinfo()[1], reason="OpenBLAS's Haswell kernel needs AVX2")
def test_a_kernel_set_by_openblas_coretype_is_said_beside_openblas_own_pick() -> None:
    """One process with ``OPENBLAS_CORETYPE=Haswell``, one without: the first runs Haswell and
    names, as OpenBLAS's own pick, the kernel the second ran (on an AVX-512 CPU, SkylakeX)."""
    base = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    own = _describe_in(base)
    assert own["blas_coretype_env"] is None and own["blas_own_kernel"] == own["blas_kernel"]
    assert "OPENBLAS_CORETYPE" not in machine_line(own)
    forced = _describe_in(base | {"OPENBLAS_CORETYPE": "Haswell"})
    assert forced["blas_kernel"] == "Haswell" and forced["blas_coretype_env"] == "Haswell"
    assert forced["blas_own_kernel"] == own["blas_kernel"]
    line = machine_line(forced)
    assert "(Haswell kernel set by OPENBLAS_CORETYPE" in line
    assert (f", {own['blas_kernel']} without it, " in line) == (own["blas_kernel"] != "Haswell")
