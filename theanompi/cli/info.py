"""``tmpi info``: versions of the stack and the device, from rank 0."""

from __future__ import annotations

import os
import sys

import typer

__all__ = ["app", "info"]

app = typer.Typer()


@app.command()
def info() -> None:
    """Print versions of MPI, mpi4py, PyTensor, numpy, the BLAS PyTensor links, the thread
    pools loaded (BLAS, OpenMP: library, api, version, threads, file), and the device."""
    from theanompi.pytensor_env import blas_info, configure, thread_pools

    configure()
    import mpi4py
    import numpy
    import pytensor
    from mpi4py import MPI

    from theanompi._version import __version__

    rows = [
        ("theanompi", __version__),
        ("python", sys.version.split()[0]),
        ("mpi", MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip()),  # NUL-ended
        ("mpi4py", mpi4py.__version__),
        ("mpi ranks", str(MPI.COMM_WORLD.Get_size())),
        ("numpy", numpy.__version__),
        ("pytensor", pytensor.__version__),
        ("pytensor linker", f"{pytensor.config.linker} ({pytensor.config.mode})"),
        ("pytensor floatX", pytensor.config.floatX),
        ("pytensor compiledir", pytensor.config.compiledir),
    ]
    blas = blas_info()
    rows += [
        ("blas library", blas["library"]),
        ("blas threads", blas["threads"]),
        ("blas kernel", f"{blas['kernel']} (openblas {blas['version']}{_set_by_env()})"),
        ("blas ldflags", blas["ldflags"] or "(none)"),
    ]
    rows += [("thread pool", _pool(pool)) for pool in thread_pools()] or [("thread pool", "none")]
    rows.append(("device", _device()))
    if MPI.COMM_WORLD.Get_rank() == 0:
        width = max(len(k) for k, _ in rows)
        for key, value in rows:
            typer.echo(f"{key:<{width}}  {value}")


def _set_by_env() -> str:
    """``; set by OPENBLAS_CORETYPE`` where that variable, not OpenBLAS, chose the kernel (one
    slower than the CPU's own, maybe: ``tmpi bench model`` names both)."""
    return "; set by OPENBLAS_CORETYPE" if os.environ.get("OPENBLAS_CORETYPE") else ""


def _pool(pool: dict[str, object]) -> str:
    """One thread pool, e.g. ``openblas (blas) 0.3.34, 1 thread(s): /path/libscipy_openblas.so``."""
    return (
        f"{pool.get('internal_api')} ({pool.get('user_api')}) {pool.get('version') or '?'}, "
        f"{pool.get('num_threads')} thread(s): {pool.get('filepath')}"
    )


def _device() -> str:
    import platform

    cpu = f"cpu ({os.cpu_count()} cores, {platform.machine()})"
    try:
        import pycuda.driver as cuda  # type: ignore[import-not-found]

        cuda.init()
        if cuda.Device.count():
            return f"{cpu}; gpu: {cuda.Device(0).name()}"
    except Exception:  # noqa: BLE001 - pycuda absent or no GPU: CPU only
        pass
    return cpu
