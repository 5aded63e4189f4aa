"""Set PyTensor up before its first import: float32, C linker, real BLAS, per-rank compile dir.

PyTensor's C ``Gemm``/``Gemv`` call the Fortran symbols ``sgemm_`` etc.  The
``scipy-openblas32`` wheel (a pip dependency) ships a full OpenBLAS whose symbols
carry a ``scipy_`` prefix, so we link ``libscipy_openblas.so`` and map each BLAS
name used in PyTensor's headers to its prefixed twin with ``-D`` macros, which
PyTensor passes to every BLAS Op's compile line. No system BLAS is needed.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

from theanompi.comm import local_rank_from_env, local_size_from_env

__all__ = ["configure", "blas_info", "blas_ldflags", "cache_root"]

_configured = False


def cache_root() -> Path:
    """Base folder for PyTensor's compile caches (``$THEANOMPI_CACHE`` or ``~/.cache/theanompi``)."""
    return Path(os.environ.get("THEANOMPI_CACHE", Path.home() / ".cache" / "theanompi"))


@functools.cache
def _openblas_library() -> Path | None:
    try:
        import scipy_openblas32
    except ImportError:
        return None
    lib = Path(scipy_openblas32.get_lib_dir()) / f"lib{scipy_openblas32.get_library()}.so"
    return lib if lib.exists() else None


@functools.cache
def _exported_symbols(lib: Path) -> frozenset[str]:
    """Dynamic symbols of ``lib``, read with ctypes-free ELF parsing via ``nm`` if present."""
    try:
        out = subprocess.run(
            ["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True
        ).stdout
        return frozenset(line.split()[-1] for line in out.splitlines() if line.strip())
    except (OSError, subprocess.CalledProcessError):
        return frozenset()


def _blas_names_used_by_pytensor() -> set[str]:
    import importlib.util

    spec = importlib.util.find_spec("pytensor.tensor.blas_headers")
    if spec is None or spec.origin is None:
        return set()
    return set(re.findall(r"\b([sd][a-z]+_)\(", Path(spec.origin).read_text()))


@functools.cache
def blas_ldflags() -> str:
    """Flags for ``pytensor.config.blas__ldflags``; empty when no usable BLAS is found."""
    lib = _openblas_library()
    if lib is None:
        return ""
    symbols = _exported_symbols(lib)
    prefix = "scipy_"
    used = _blas_names_used_by_pytensor()
    if symbols and not any(s.startswith(prefix) for s in symbols):
        prefix = ""
    names = sorted(n for n in used if not symbols or prefix + n in symbols)
    macros = " ".join(f"-D{n}={prefix}{n}" for n in names) if prefix else ""
    libname = lib.name[3:-3]
    return f"-L{lib.parent} -l{libname} -Wl,-rpath,{lib.parent} {macros}".strip()


def blas_info() -> dict[str, str]:
    """What BLAS PyTensor links, for ``tmpi info``."""
    lib = _openblas_library()
    return {
        "library": str(lib) if lib else "none (PyTensor falls back to numpy)",
        "ldflags": (blas_ldflags()[:120] + " ...") if blas_ldflags() else "",
        "threads": os.environ.get("OPENBLAS_NUM_THREADS", "default"),
    }


def configure(*, blas_threads: int | None = None) -> None:
    """Configure PyTensor for this process; call before ``import pytensor``.

    User settings in ``PYTENSOR_FLAGS`` win over ours. The compile dir is per
    local rank so that ranks never wait on (or corrupt) each other's lock.
    BLAS threads default to cores / ranks-on-this-node, at least 1.
    """
    global _configured
    if _configured:
        return
    local_rank = local_rank_from_env()
    if blas_threads is None:
        blas_threads = max(1, (os.cpu_count() or 1) // max(1, local_size_from_env()))
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        os.environ.setdefault(var, str(blas_threads))

    ours = {
        "floatX": "float32",
        "linker": "cvm",
        "mode": "FAST_RUN",
        "base_compiledir": str(cache_root() / "pytensor" / f"rank{local_rank}"),
    }
    user = os.environ.get("PYTENSOR_FLAGS", "")
    user_keys = {kv.split("=", 1)[0].strip() for kv in user.split(",") if "=" in kv}
    merged = [f"{k}={v}" for k, v in ours.items() if k not in user_keys]
    if user:
        merged.append(user)
    if "pytensor" not in sys.modules:
        os.environ["PYTENSOR_FLAGS"] = ",".join(merged)

    import pytensor

    if "blas__ldflags" not in user_keys and not os.environ.get("PYTENSORRC"):
        pytensor.config.blas__ldflags = blas_ldflags()
    _configured = True
