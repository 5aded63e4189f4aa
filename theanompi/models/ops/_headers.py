"""The headers every generated C module starts with, precompiled once per compile dir.

A module's ``g++`` run takes ~0.6 s of CPU, and a third of it is reading ``Python.h``, numpy's
headers and the C++ library they pull in (``-fsyntax-only`` alone: 0.22 s), the same in every
module. :func:`install` wraps PyTensor's one way to compile a module
(``GCC_compiler.compile_str``) so that each module's compile gets ``-include`` of
:data:`HEADERS_FILE` (written once into the compile dir), which g++ takes precompiled from the
``.gch`` folder beside it, and ``-g0`` (PyTensor passes ``-g``; the debug information costs
15 % of a compile, and our stack dumps are Python's). Measured on a cold digits run, 53
modules: g++ CPU 25.8 -> 17.6 s, the run 17.3 -> 12.9 s. Neither flag changes the code
compiled, so PyTensor's cache keys leave them out, and a missing or unusable ``.gch`` only
means that g++ reads the header as text, as it would without.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from theanompi.io.atomic import atomic_write

__all__ = ["HEADERS_FILE", "install", "prepare"]

#: in the compile dir: the includes of PyTensor's ``mod.cpp``, in its order
HEADERS_FILE = "theanompi-headers.h"
HEADERS = """#include <Python.h>
#include "pytensor_mod_helper.h"
#include <math.h>
#include <numpy/arrayobject.h>
#include <numpy/arrayscalars.h>
#include <numpy/npy_math.h>
#include <vector>
#include <algorithm>
"""

#: module flags that do not go into a precompiled header: macros, the linker's
_LEFT_OUT = ("-D", "-l", "-L", "-Wl,")
#: headers whose build failed in this process: not tried again for every module
_FAILED: set[Path] = set()


def install() -> None:
    """Compile every module of this process with the headers precompiled (:func:`prepare`):
    PyTensor's compile of a module (``-O3``: a :class:`~pytensor.link.c.basic.CLinker`'s) gets
    our flags after its own; its two one-off helper modules and its compiler probes do not."""
    from pytensor.link.c.cmodule import GCC_compiler

    original = GCC_compiler.compile_str
    if getattr(original, "theanompi_headers", False):
        return

    def compile_str(module_name: str, src_code: str, location: str | None = None,
                    include_dirs: Any = None, lib_dirs: Any = None, libs: Any = None,
                    preargs: Any = None, py_module: bool = True,
                    hide_symbols: bool = True) -> Any:  # fmt: skip
        if location and preargs and "-O3" in preargs:
            preargs = [*preargs, *prepare(Path(location).parent, [list(preargs)])]
        return original(module_name, src_code, location, include_dirs, lib_dirs, libs,
                        preargs, py_module, hide_symbols)  # fmt: skip

    compile_str.theanompi_headers = True  # type: ignore[attr-defined]
    GCC_compiler.compile_str = staticmethod(compile_str)  # type: ignore[method-assign]


def prepare(compile_dir: Path, compile_args: list[list[str]]) -> list[str]:
    """The flags to add to a module's compile, once :data:`HEADERS_FILE` is in ``compile_dir``
    and precompiled for each set of module flags in ``compile_args`` (with and without
    OpenMP, typically) that lacks its own. :mod:`~theanompi.models.ops._parallel` calls it
    for all the modules it is about to compile, with the node's compile turn held, so that
    its compiler threads find them built. No flags for a compiler other than g++."""
    if not _is_gcc():
        return []
    header = compile_dir / HEADERS_FILE
    try:
        if not header.is_file() or header.read_text() != HEADERS:
            with atomic_write(header) as tmp:
                tmp.write_text(HEADERS)
    except OSError:
        return ["-g0"]  # a read-only compile dir without the header
    todo = {}
    for args in compile_args:
        target, flags = _precompiled(header, args)
        if target not in _FAILED and not target.is_file():
            todo[target] = flags
    if todo:
        with ThreadPoolExecutor(max_workers=len(todo)) as pool:
            list(pool.map(lambda item: _build(header, *item), todo.items()))
    return ["-g0", "-include", str(header)]


def _is_gcc() -> bool:
    """Whether PyTensor's compiler is g++ (clang reads ``.pch`` files, not a ``.gch`` folder)."""
    from pytensor.configdefaults import config

    return "g++" in Path(str(config.cxx)).name


def _precompiled(header: Path, compile_args: list[str]) -> tuple[Path, list[str]]:
    """Where the header precompiled for a module's ``compile_args`` goes, and the flags.

    g++ tries each file of ``<header>.gch/`` and takes the first valid one (same compiler,
    optimisation, OpenMP, code model); a file is named by a hash of the compiler and the
    flags that matter, so another compiler or flag set adds its own beside the others. The
    ``-D`` macros of the BLAS names are left out (the headers never use them), and so are the
    linker's arguments of the BLAS Ops (with a library among its inputs g++ would link).
    """
    import numpy as np
    from pytensor.configdefaults import config
    from pytensor.link.c.cmodule import std_include_dirs

    flags = [a for a in compile_args if not a.startswith(_LEFT_OUT) or a.startswith("-DNPY_")]
    flags += [f"-I{d}" for d in [np.get_include(), *std_include_dirs()]]
    flags += ["-g0", "-fvisibility=hidden"]  # as compile_str adds it
    digest = hashlib.sha256(repr([config.cxx, config.gcc_version_str, flags]).encode())
    return header.with_name(f"{header.name}.gch") / f"{digest.hexdigest()[:20]}.gch", flags


def _build(header: Path, target: Path, flags: list[str]) -> bool:
    """Precompile ``header`` with ``flags`` into ``target``, whole or not at all."""
    from pytensor.configdefaults import config

    # outside the folder (g++ would try a half-written file there); per process and thread
    tmp = header.with_name(f".{target.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    cmd = [config.cxx, *flags, "-x", "c++-header", "-o", str(tmp), str(header)]
    try:
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            _FAILED.add(target)
            return False
        target.parent.mkdir(exist_ok=True)
        os.replace(tmp, target)  # never half-written in the folder g++ reads
        return True
    except OSError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
