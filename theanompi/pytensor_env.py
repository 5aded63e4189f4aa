"""PyTensor set up, before or after its first import: float32, C linker, BLAS, per-node compile dir.

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
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from theanompi.comm import local_size_from_env
from theanompi.io.atomic import atomic_write

__all__ = [
    "configure",
    "blas_info",
    "blas_ldflags",
    "blas_symbol_prefix",
    "cache_root",
    "compile_dir",
    "keep_freed_memory",
    "fit_threads_to_node",
    "thread_pools",
    "unconfigured_env",
]

_configured = False
#: largest block glibc serves from its heap, kept mapped once freed (:func:`keep_freed_memory`)
HEAP_BLOCK_MAX = 4 << 20
#: environment variables as they were before :func:`configure` changed them (None: unset)
_BEFORE: dict[str, str | None] = {}


def unconfigured_env() -> dict[str, str]:
    """``os.environ`` without :func:`configure`'s changes: for a child process that must make
    its own choices (a cold compile cache, a peer library with its own threads)."""
    env = dict(os.environ)
    for var, value in _BEFORE.items():
        if value is None:
            env.pop(var, None)
        else:
            env[var] = value
    return env


def _set_env(var: str, value: str) -> None:
    _BEFORE.setdefault(var, os.environ.get(var))
    os.environ[var] = value


def cache_root() -> Path:
    """Base folder for PyTensor's compile caches (``$THEANOMPI_CACHE`` or ``~/.cache/theanompi``)."""
    return Path(os.environ.get("THEANOMPI_CACHE", Path.home() / ".cache" / "theanompi"))


def compile_dir() -> Path:
    """This node's PyTensor compile dir, shared by its ranks: ``<cache_root>/pytensor/<host>``.

    With ``$THEANOMPI_CACHE`` on a file system shared by the nodes, each node still keeps its
    own folder (nodes may differ in compiler or CPU); the ranks of one node share it, and
    compile each missing module once (:mod:`theanompi.models.ops._parallel`).
    """
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "host"
    return cache_root() / "pytensor" / host


@functools.cache
def _openblas_library() -> Path | None:
    try:
        import scipy_openblas32
    except ImportError:
        return None
    lib = Path(scipy_openblas32.get_lib_dir()) / f"lib{scipy_openblas32.get_library()}.so"
    return lib if lib.exists() else None


#: in the compile dir: the BLAS library's dynamic symbols, as ``nm`` listed them for its file
SYMBOLS_FILE = "theanompi-blas-symbols.txt"


@functools.cache
def _exported_symbols(lib: Path) -> frozenset[str]:
    """Dynamic symbols of ``lib``, listed by ``nm`` once per library file and node: a later
    process (every rank's start) reads them from the compile dir instead of running ``nm``
    (50 ms of a start, measured); the file's first line names the library's path, size and
    mtime, so another library or a rebuilt one is listed again."""
    try:
        st = lib.stat()
    except OSError:
        return frozenset()
    key = f"{lib} {st.st_size} {st.st_mtime_ns}"
    kept = compile_dir() / SYMBOLS_FILE
    try:
        first, _, rest = kept.read_text().partition("\n")
        if first == key:
            return frozenset(rest.split())
    except OSError:
        pass
    try:
        out = subprocess.run(
            ["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return frozenset()
    symbols = frozenset(line.split()[-1] for line in out.splitlines() if line.strip())
    try:
        with atomic_write(kept) as tmp:
            tmp.write_text(key + "\n" + "\n".join(sorted(symbols)) + "\n")
    except OSError:
        pass  # a read-only cache: the next process lists them again
    return symbols


def _blas_names_used_by_pytensor() -> set[str]:
    import importlib.util

    spec = importlib.util.find_spec("pytensor.tensor.blas_headers")
    if spec is None or spec.origin is None:
        return set()
    return set(re.findall(r"\b([sd][a-z]+_)\(", Path(spec.origin).read_text()))


@functools.cache
def blas_symbol_prefix() -> str:
    """``"scipy_"`` when the linked OpenBLAS prefixes its symbols (``scipy_sgemm_``), else ``""``."""
    lib = _openblas_library()
    symbols = _exported_symbols(lib) if lib is not None else frozenset()
    return "" if symbols and not any(s.startswith("scipy_") for s in symbols) else "scipy_"


@functools.cache
def blas_ldflags() -> str:
    """Flags for ``pytensor.config.blas__ldflags``; empty when no usable BLAS is found."""
    lib = _openblas_library()
    if lib is None:
        return ""
    symbols = _exported_symbols(lib)
    prefix = blas_symbol_prefix()
    used = _blas_names_used_by_pytensor()
    names = sorted(n for n in used if not symbols or prefix + n in symbols)
    macros = " ".join(f"-D{n}={prefix}{n}" for n in names) if prefix else ""
    libname = lib.name[3:-3]
    return f"-L{lib.parent} -l{libname} -Wl,-rpath,{lib.parent} {macros}".strip()


def thread_pools() -> list[dict[str, Any]]:
    """The thread pools loaded in this process (BLAS, OpenMP), as ``threadpoolctl`` reports
    them: ``internal_api`` (the library: openblas, openmp, mkl), ``user_api`` (blas,
    openmp), ``version``, ``num_threads``, ``filepath``, ..."""
    from threadpoolctl import threadpool_info

    return list(threadpool_info())


def blas_info() -> dict[str, str]:
    """What BLAS PyTensor links, for ``tmpi info`` and the benchmarks' machine line: its
    threads, version and the kernel family it picked for this CPU (``SkylakeX``,
    ``Haswell``, ...) as ``threadpoolctl`` reports them once it is loaded, else the threads
    it will start with and ``kernel`` ``not loaded yet``."""
    lib = _openblas_library()
    info = {
        "threads": os.environ.get("OPENBLAS_NUM_THREADS", "default"),
        "version": "?",
        "kernel": "not loaded yet",
    }
    if lib is not None:
        for pool in thread_pools():
            if Path(pool.get("filepath", "")).resolve() == lib.resolve():
                info["threads"] = str(pool["num_threads"])
                info["version"] = str(pool.get("version") or "?")
                info["kernel"] = str(pool.get("architecture") or "?")
    return {
        "library": str(lib) if lib else "none (PyTensor falls back to numpy)",
        "ldflags": (blas_ldflags()[:120] + " ...") if blas_ldflags() else "",
        **info,
    }


def keep_freed_memory() -> bool:
    """Make glibc keep freed blocks of up to :data:`HEAP_BLOCK_MAX` bytes for reuse instead of
    returning them to the kernel.

    PyTensor frees every intermediate array of a step and allocates it again in the next;
    glibc serves blocks of megabytes from fresh ``mmap``s, so each step page-faults all of
    them in again (measured: a fifth of the small CNN's step on the 2-core VM). With high
    ``M_MMAP_THRESHOLD``/``M_TRIM_THRESHOLD`` they come from the heap, already mapped; the
    cost is a process that keeps its peak footprint. Blocks above the threshold (a whole
    AlexNet weight, velocity or activation) still get their own ``mmap`` and go back on
    ``free``: their page faults cost little beside the work done on them, while in the heap
    they fragment it into a second, resident copy of the parameters (measured: AlexNet b=32
    under BSP asa16 at N=2 peaks at 1438 MB per rank, 6.2x its 233 MB of parameters, against
    1723 MB with every block in the heap). Returns whether the settings took.
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, HEAP_BLOCK_MAX) and mallopt(m_trim_threshold, 1 << 30))


def _node_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def fit_threads_to_node(local_size: int) -> int:
    """After MPI starts: BLAS and OpenMP threads per rank = this node's cores / ``local_size``
    (its ranks, from MPI: :func:`theanompi.comm.local_size`), at least 1.

    :func:`configure` guessed from the launcher's environment before MPI started; this
    corrects the guess where that environment lacked or misstated it (srun, other MPIs).
    Threads the user set (``OPENBLAS_NUM_THREADS``/``OMP_NUM_THREADS``) are left alone.
    The pools already loaded (every BLAS: the one PyTensor links and numpy's own; OpenMP's
    runtime once a C Op loaded it) are set through ``threadpoolctl``, those loaded later read
    the environment. Returns the threads per rank now in force.
    """
    n = max(1, _node_cores() // max(1, local_size))
    ours = [v for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS") if _BEFORE.get(v, "") is None]
    if "OPENBLAS_NUM_THREADS" not in ours:
        return int(os.environ.get("OPENBLAS_NUM_THREADS", "0") or 0) or n
    for var in ours:
        os.environ[var] = str(n)  # OpenMP reads it when its runtime loads (the first C Op)
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=n, user_api="blas")
    if "OMP_NUM_THREADS" in ours:
        threadpool_limits(limits=n, user_api="openmp")
    return n


def configure(*, blas_threads: int | None = None) -> None:
    """Configure PyTensor for this process, before or after ``import pytensor``.

    User settings in ``PYTENSOR_FLAGS`` (and, for an imported PyTensor, its ``.pytensorrc``)
    win over ours. The compile dir is per node (:func:`compile_dir`), shared by the node's
    ranks: PyTensor's lock keeps them from corrupting it and our compile turn
    (:mod:`theanompi.models.ops._parallel`) from compiling the same code twice. BLAS threads default to cores / ranks-on-this-node, at
    least 1.

    Before PyTensor's first import our settings go into ``PYTENSOR_FLAGS``; once it is
    imported they are set on ``pytensor.config`` instead (:func:`_apply_to_imported`), so
    that both orders give the same float type, linker, OpenMP and compile dir.
    """
    global _configured
    if _configured:
        return
    if blas_threads is None:
        blas_threads = max(1, _node_cores() // max(1, local_size_from_env()))
    threads = {"OPENBLAS_NUM_THREADS": str(blas_threads), "OMP_NUM_THREADS": str(blas_threads)}
    # Two thread pools share the cores: OpenBLAS's (dense layers) and OpenMP's (the C Ops of
    # theanompi.models.ops). Idle threads of either must sleep at once rather than spin, or
    # they steal the cores the other pool is computing on (measured: 2x slower steps).
    threads |= {"OMP_WAIT_POLICY": "PASSIVE", "OPENBLAS_THREAD_TIMEOUT": "4"}
    for var, value in threads.items():
        if var not in os.environ:
            _set_env(var, value)

    ours = {
        "floatX": "float32",
        "linker": "cvm",
        "mode": "FAST_RUN",
        "openmp": "True",  # large elementwise ops on the same OpenMP threads as our C Ops
        "base_compiledir": str(compile_dir()),
    }
    user = os.environ.get("PYTENSOR_FLAGS", "")
    user_keys = {kv.split("=", 1)[0].strip() for kv in user.split(",") if "=" in kv}
    merged = [f"{k}={v}" for k, v in ours.items() if k not in user_keys]
    if user:
        merged.append(user)
    imported = "pytensor" in sys.modules
    if not imported:
        _set_env("PYTENSOR_FLAGS", ",".join(merged))

    keep_freed_memory()
    import pytensor

    if imported:
        _apply_to_imported(pytensor.config, ours, user_keys)

    if "blas__ldflags" not in user_keys and not os.environ.get("PYTENSORRC"):
        pytensor.config.blas__ldflags = blas_ldflags()
    _configured = True


def _apply_to_imported(config: Any, ours: dict[str, str], user_keys: set[str]) -> None:
    """Our settings on an already imported PyTensor, as ``PYTENSOR_FLAGS`` would have made them.

    A key the user set (``PYTENSOR_FLAGS`` or ``.pytensorrc``) is left alone. ``floatX``,
    ``linker``, ``mode`` and ``openmp`` may change at run time; the Ops PyTensor created on
    import (``pt.add``'s ``Elemwise``, ...) read ``openmp`` then, so they get ours too.
    ``base_compiledir`` is fixed once read (on import), but ``compiledir`` is only fixed once
    something compiles: until then it is set to the folder the other order gives (ours, with
    PyTensor's own subfolder name); after a compile it stays PyTensor's, with a warning.
    """
    params = config._config_var_dict  # PyTensor 3: name -> ConfigParam

    def user_set(key: str) -> bool:
        param = params.get(key)
        return key in user_keys or (param is not None and not param.is_default)

    for key, value in ours.items():
        if key != "base_compiledir" and key in params and not user_set(key):
            setattr(config, key, value)
    if config.openmp and not user_set("openmp"):
        _openmp_on_existing_ops()
    if user_set("base_compiledir") or user_set("compiledir"):
        return
    from pytensor.configdefaults import _default_compiledir

    target = Path(ours["base_compiledir"]) / _default_compiledir().name
    if not hasattr(params["compiledir"], "val"):  # not read yet: nothing compiled
        config.compiledir = target
    elif Path(config.compiledir) != target.resolve():
        import warnings

        warnings.warn(
            f"PyTensor compiled before theanompi set it up: its compile cache stays "
            f"{config.compiledir} (not {target}); import theanompi before compiling",
            stacklevel=3,
        )


def _openmp_on_existing_ops() -> None:
    """``openmp=True`` on the OpenMP-capable Ops that exist already: those PyTensor made on
    import with its default ``openmp=False`` (the other order makes them with ours)."""
    import gc

    from pytensor.link.c.op import OpenMPOp

    for obj in gc.get_objects():
        if issubclass(type(obj), OpenMPOp) and not obj.openmp:
            obj.openmp = True
