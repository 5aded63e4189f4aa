"""Compile a graph's missing C modules several at a time, before PyTensor links it node by node.

PyTensor compiles the C module of each node when it links the node, one after the other, and
holds the compile dir's lock around every ``g++`` run, so a cold AlexNet (about 60 modules of
~0.8 s of CPU each) costs a minute on a node with many idle cores. :class:`ParallelCVMLinker`
first generates the code of every node whose module is not cached, runs the compilers in a
thread pool (``g++`` is a subprocess: the threads only wait) into fresh module folders, and
registers the modules in PyTensor's cache under its lock; the ordinary link that follows then
finds every module cached. Anything unexpected leaves the module to PyTensor's own link.

The ranks of a node share one compile dir. They build at the same time; the first that finds
modules missing compiles them while the others wait at a file lock, then find them cached. On a
warm cache nobody waits (a node barrier around the whole build cost the second rank of
``tmpi train -n 2`` a second: it waited out the first rank's rewrites and loads). The results of
PyTensor's compiler probes (``-march`` flags, OpenMP support: two ``g++`` runs, ~0.25 s a
process) are kept in the compile dir too (:func:`load_compiler_probes`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pytensor.link.vm import VMLinker

from theanompi.io import startup_trace
from theanompi.models.ops import _headers, _key_index

__all__ = [
    "ParallelCVMLinker",
    "compile_workers",
    "load_compiler_probes",
    "precompile",
    "save_compiler_probes",
]

#: serialises the (fast) loading of the compiled modules: ``dlimport`` edits ``sys.path``
_IMPORT_LOCK = threading.Lock()
#: in the compile dir: one process of the node compiles at a time (its flock goes with it)
TURN_LOCK = ".theanompi-compile.lock"
#: in the compile dir: PyTensor's compiler probes, for the processes that come later
PROBES_FILE = "theanompi-compiler-probes.json"
_probes_kept = False  # this process has checked the file against its own probes


def compile_workers() -> int:
    """Compilers run at once: ``$THEANOMPI_COMPILE_JOBS``, else this process's cores (the node's
    other ranks wait at the compile turn meanwhile: :func:`precompile`)."""
    env = os.environ.get("THEANOMPI_COMPILE_JOBS", "")
    if env.strip().isdigit() and int(env) >= 1:
        return int(env)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _job(node: Any, cache: Any) -> tuple[Any, Any, str] | None:
    """``(linker, key, module_hash)`` of ``node``'s C module when it must be compiled, else None."""
    from pytensor.graph.fg import FunctionGraph
    from pytensor.link.c.basic import CLinker
    from pytensor.link.c.cmodule import get_module_hash
    from pytensor.link.c.op import COp

    if not isinstance(node.op, COp):
        return None
    if any(getattr(v.type, "dtype", "") == "float16" for v in node.inputs + node.outputs):
        return None  # PyTensor handles (refuses) these itself
    cl = CLinker().accept(FunctionGraph(node.inputs, node.outputs), no_recycling=[])
    key = cl.cmodule_key()
    if not key[0] or cache._get_from_key(key) is not None:
        return None  # unversioned (PyTensor keeps those per process) or cached
    module_hash = get_module_hash(cl.get_src_code(), key)
    if _key_index.has_module_hash(cache, module_hash):
        return None  # the same code under another key: PyTensor links it without compiling
    return cl, key, module_hash


def _compile(cl: Any, cache: Any) -> Any:
    """Run the compiler for linker ``cl`` into a fresh folder of the cache; returns the module."""
    from pytensor.link.c.cmodule import dlimport_workdir

    mod = cl.get_dynamic_module()
    location = dlimport_workdir(cache.dirname)
    return cl.c_compiler().compile_str(
        module_name=mod.code_hash,
        src_code=mod.code(),
        location=location,
        include_dirs=cl.header_dirs(),
        lib_dirs=cl.lib_dirs(),
        libs=cl.libraries(),
        preargs=cl.compile_args(),
    )


def _jobs(fgraph: Any, cache: Any) -> dict[str, tuple[Any, Any]]:
    """``{module_hash: (linker, key)}`` of the modules ``fgraph`` lacks in ``cache``."""
    jobs: dict[str, tuple[Any, Any]] = {}
    for node in fgraph.toposort():
        try:
            job = _job(node, cache)
        except Exception:  # noqa: BLE001 - e.g. an Op without C code: PyTensor decides later
            continue
        if job is not None:
            jobs.setdefault(job[2], (job[0], job[1]))
    return jobs


def _compile_all(jobs: dict[str, tuple[Any, Any]], cache: Any, workers: int) -> dict[str, Any]:
    """Compile every job, ``workers`` at a time, with the headers precompiled
    (:mod:`~theanompi.models.ops._headers`); ``{module_hash: module}`` of those that built."""
    from pytensor.link.c import cmodule

    original = cmodule.dlimport

    def locked_dlimport(*args: Any, **kwargs: Any) -> Any:
        with _IMPORT_LOCK:
            return original(*args, **kwargs)

    _headers.prepare(Path(cache.dirname), [cl.compile_args() for cl, _ in jobs.values()])
    cmodule.dlimport = locked_dlimport
    try:
        with ThreadPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
            futures = {h: pool.submit(_compile, cl, cache) for h, (cl, _) in jobs.items()}
            modules = {}
            for h, fut in futures.items():
                try:
                    modules[h] = fut.result()
                except Exception:  # noqa: BLE001 - PyTensor's link compiles it and reports
                    continue
    finally:
        cmodule.dlimport = original
    return modules


def precompile(fgraph: Any, workers: int | None = None) -> int:
    """Compile the uncached C modules of ``fgraph``'s nodes, ``workers`` at a time, into
    PyTensor's module cache; returns how many this process compiled (0 with one worker:
    nothing to gain, or when another process of the node compiled them meanwhile).
    """
    from filelock import FileLock
    from pytensor.compile.compilelock import lock_ctx
    from pytensor.link.c.basic import get_module_cache

    workers = compile_workers() if workers is None else workers
    if workers < 2:
        return 0
    cache = get_module_cache()
    if len(_jobs(fgraph, cache)) < 2:
        return 0
    # One process of the node compiles at a time, outside PyTensor's lock (held for minutes,
    # it would time out the others' loads); the others wait here, then find the modules.
    with FileLock(Path(cache.dirname) / TURN_LOCK):
        with lock_ctx():
            cache.refresh(cleanup=False)
        jobs = _jobs(fgraph, cache)
        if len(jobs) < 2:
            return 0
        modules = _compile_all(jobs, cache, workers)
        done = 0
        with lock_ctx():
            for h, module in modules.items():
                key = jobs[h][1]
                if cache._get_from_key(key) is not None or _key_index.has_module_hash(cache, h):
                    continue  # PyTensor's own link in another process got there first
                cache.module_from_name[module.__file__] = module
                cache.module_hash_to_key_data[h] = cache._add_to_cache(module, key, h)
                done += 1
    return done


def _probes_key() -> dict[str, str]:
    """What the probes depend on: the compiler, its flags and version, PyTensor's version
    (the compile dir is per host and CPU already)."""
    import pytensor
    from pytensor.configdefaults import config

    return {
        "cxx": str(config.cxx),
        "cxxflags": str(config.gcc__cxxflags),
        "gcc_version": str(config.gcc_version_str),
        "pytensor": pytensor.__version__,
    }


def _probes() -> tuple[Any, Any]:
    """This process's probe results, ``(march_flags, gxx_support_openmp)`` (None: not run)."""
    from pytensor.link.c.cmodule import GCC_compiler
    from pytensor.link.c.op import OpenMPOp

    return GCC_compiler.march_flags, OpenMPOp.gxx_support_openmp


def _saved_probes(path: Path) -> tuple[list[str], bool] | None:
    """The probe results in ``path`` when they were found with this compiler, else None."""
    try:
        saved = json.loads(path.read_text())
        march, openmp = saved["march_flags"], saved["openmp"]
        ok = saved["key"] == _probes_key() and isinstance(openmp, bool)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (ok and isinstance(march, list) and all(isinstance(f, str) for f in march)):
        return None
    return march, openmp


def load_compiler_probes(compiledir: str | os.PathLike[str]) -> bool:
    """Take the ``-march`` flags and OpenMP support that an earlier process of this node found
    (:func:`save_compiler_probes`), so PyTensor skips its two ``g++`` probes; returns whether
    this process has them now. A file for another compiler, or unreadable, is ignored. Reads
    the file only while this process lacks them (once, not per compiled function)."""
    from pytensor.link.c.cmodule import GCC_compiler
    from pytensor.link.c.op import OpenMPOp

    if None not in _probes():
        return True
    saved = _saved_probes(Path(compiledir) / PROBES_FILE)
    if saved is None:
        return False
    if GCC_compiler.march_flags is None:
        GCC_compiler.march_flags = saved[0]
    if OpenMPOp.gxx_support_openmp is None:
        OpenMPOp.gxx_support_openmp = saved[1]
    return True


def save_compiler_probes(compiledir: str | os.PathLike[str]) -> None:
    """Keep this process's probe results in the compile dir once PyTensor has run both,
    replacing a file that another compiler's probes wrote (it would never be read again)."""
    from theanompi.io.atomic import atomic_write

    global _probes_kept
    march, openmp = _probes()
    if _probes_kept or march is None or openmp is None:
        return
    path = Path(compiledir) / PROBES_FILE
    _probes_kept = True  # one look per process: it is there now, or cannot be written
    if _saved_probes(path) is not None:
        return
    text = json.dumps({"key": _probes_key(), "march_flags": march, "openmp": bool(openmp)})
    try:
        with atomic_write(path) as tmp:
            tmp.write_text(text)
    except OSError:
        pass  # a read-only cache: the next process probes again


class ParallelCVMLinker(VMLinker):
    """PyTensor's ``cvm`` linker (C thunks, C loop) that first compiles the graph's missing
    modules in parallel (:func:`precompile`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("use_cloop", True)
        super().__init__(*args, **kwargs)

    def make_all(self, *args: Any, **kwargs: Any) -> Any:
        from pytensor.configdefaults import config

        t0 = time.perf_counter()
        _key_index.install()
        load_compiler_probes(config.compiledir)
        try:
            precompile(self.fgraph)
        except Exception:  # noqa: BLE001 - an optimisation only: the link below compiles
            pass
        made = super().make_all(*args, **kwargs)
        save_compiler_probes(config.compiledir)
        startup_trace.add("loads", time.perf_counter() - t0)
        return made
