"""The machine a benchmark ran on, printed beside its ratios: figures from two machines (one
with AVX-512 and AMX, one without) are never compared blind; nor are two kernels on one
machine, where ``OPENBLAS_CORETYPE`` sets OpenBLAS's kernel instead of its own pick (an AMD
EPYC with AVX-512 set to ``Haswell``: 2048² float32 GEMM at 2 threads 198-210 GFLOP/s against
its own ``SkylakeX``'s 390-400)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from theanompi.pytensor_env import blas_info

__all__ = ["ISA_FLAGS", "describe", "machine_line", "own_kernel"]

#: the CPU flags that change which kernels OpenBLAS, oneDNN and our C code run
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile")


def _cpuinfo(path: Path = Path("/proc/cpuinfo")) -> tuple[str, set[str]]:
    """(model name, flags) of the first CPU listed; the platform's name where unreadable."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        text = path.read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            model = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
            break
    return model, flags


#: a fresh process's report of the kernel OpenBLAS (the library at argv[1]) picks by itself
_OWN_KERNEL = """import ctypes, sys
ctypes.CDLL(sys.argv[1])
from threadpoolctl import threadpool_info
print(*[p.get("architecture") for p in threadpool_info() if p.get("filepath") == sys.argv[1]])
"""


def own_kernel(library: str) -> str:
    """The kernel OpenBLAS at ``library`` picks for this CPU without ``OPENBLAS_CORETYPE``:
    asked of a fresh process, as OpenBLAS reads the variable once, when it is loaded; ``?``
    where that process cannot tell."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    run = subprocess.run(
        [sys.executable, "-c", _OWN_KERNEL, str(Path(library).resolve())],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    return run.stdout.strip() or "?"


def describe(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """CPU model, cores, the :data:`ISA_FLAGS` it has and the BLAS kernel in use; where
    ``OPENBLAS_CORETYPE`` set that kernel, also the one OpenBLAS picks by itself."""
    model, flags = _cpuinfo(cpuinfo)
    blas = blas_info()
    forced = os.environ.get("OPENBLAS_CORETYPE") or None
    loaded = blas["kernel"] not in ("?", "not loaded yet")
    return {
        "cpu": model,
        "cpus": os.cpu_count() or 1,
        "isa": [f for f in ISA_FLAGS if f in flags],
        "blas": f"openblas {blas['version']}",
        "blas_kernel": blas["kernel"],
        "blas_threads": blas["threads"],
        "blas_coretype_env": forced,
        "blas_own_kernel": own_kernel(blas["library"]) if forced and loaded else blas["kernel"],
    }


def machine_line(info: dict[str, Any] | None = None) -> str:
    """One line for the top of a benchmark's table, e.g. ``machine: Intel(R) Xeon(R)
    Processor, 2 CPUs, avx2 fma avx512f ... amx_tile; BLAS openblas 0.3.34 (SkylakeX kernel,
    2 threads)``; a kernel set by ``OPENBLAS_CORETYPE`` is said so, beside OpenBLAS's own
    pick where that differs: ``(Haswell kernel set by OPENBLAS_CORETYPE, SkylakeX without
    it, 2 threads)``."""
    m = describe() if info is None else info
    isa = " ".join(m["isa"]) or "no AVX2"
    kernel = f"{m['blas_kernel']} kernel"
    if m.get("blas_coretype_env"):
        kernel += " set by OPENBLAS_CORETYPE"
        if m.get("blas_own_kernel") not in (None, "?", m["blas_kernel"]):
            kernel += f", {m['blas_own_kernel']} without it"
    return (
        f"machine: {m['cpu']}, {m['cpus']} CPUs, {isa}; BLAS {m['blas']} "
        f"({kernel}, {m['blas_threads']} threads)"
    )
