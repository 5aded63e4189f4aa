"""The machine line every compute benchmark prints beside its ratios (issue 41): the CPU, the
instruction sets that pick the kernels, and the kernel family OpenBLAS chose for it."""

from __future__ import annotations

from pathlib import Path

from theanompi.bench._machine import ISA_FLAGS, describe, machine_line

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
    assert f"({m['blas_kernel']} kernel, {m['blas_threads']} threads)" in machine_line(m)
