"""The machine a benchmark ran on, printed beside its ratios: figures from two machines (one
with AVX-512 and AMX, one without) are never compared blind."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

from theanompi.pytensor_env import blas_info

__all__ = ["ISA_FLAGS", "describe", "machine_line"]

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


def describe(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """CPU model, cores, the :data:`ISA_FLAGS` it has and the BLAS kernel in use."""
    model, flags = _cpuinfo(cpuinfo)
    blas = blas_info()
    return {
        "cpu": model,
        "cpus": os.cpu_count() or 1,
        "isa": [f for f in ISA_FLAGS if f in flags],
        "blas": f"openblas {blas['version']}",
        "blas_kernel": blas["kernel"],
        "blas_threads": blas["threads"],
    }


def machine_line(info: dict[str, Any] | None = None) -> str:
    """One line for the top of a benchmark's table, e.g. ``machine: Intel(R) Xeon(R)
    Processor, 2 CPUs, avx2 fma avx512f ... amx_tile; BLAS openblas 0.3.34 (SkylakeX kernel,
    2 threads)``."""
    m = describe() if info is None else info
    isa = " ".join(m["isa"]) or "no AVX2"
    return (
        f"machine: {m['cpu']}, {m['cpus']} CPUs, {isa}; BLAS {m['blas']} "
        f"({m['blas_kernel']} kernel, {m['blas_threads']} threads)"
    )
