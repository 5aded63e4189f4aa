"""The headers every generated C module starts with, precompiled once per compile dir.

A module's ``g++`` run takes ~0.6 s of CPU, and a third of it is reading ``Python.h``, numpy's
headers and the C++ library they pull in (``-fsyntax-only`` alone: 0.22 s), the same in every
module. :func:`compile_flags` gives the flags that :mod:`theanompi.models.ops._parallel` adds to
each module it compiles: ``-include`` of :data:`HEADERS_FILE` (written once into the compile
dir), which g++ takes precompiled from the ``.gch`` folder beside it, and ``-g0`` (PyTensor
passes ``-g``; the debug information costs 15 % of a compile, and our stack dumps are
Python's). Measured on a cold digits run, 53 modules: g++ CPU 25.8 -> 17.6 s, the run 17.3 ->
12.9 s. Neither flag changes the code compiled, so PyTensor's cache keys leave them out, and a
missing or unusable ``.gch`` only means that g++ reads the header as text, as it would
without.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = ["HEADERS_FILE", "compile_flags"]

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


def compile_flags(compile_dir: Path, compile_args: list[list[str]]) -> list[str]:
    """Flags to add to the compile of modules whose own flags are ``compile_args``, once
    :data:`HEADERS_FILE` is in ``compile_dir`` and precompiled for each set of flags there
    (with and without OpenMP, typically) that lacks its own. Call it with the node's compile
    turn held: the first process of a node builds, the others find the files."""
    header = compile_dir / HEADERS_FILE
    try:
        if not header.is_file() or header.read_text() != HEADERS:
            tmp = header.with_name(f".{HEADERS_FILE}.{os.getpid()}.tmp")
            tmp.write_text(HEADERS)
            os.replace(tmp, header)
    except OSError:
        return ["-g0"]  # a read-only compile dir without the header
    todo = {}
    for args in compile_args:
        target, flags = _precompiled(header, args)
        if not target.is_file():
            todo[target] = flags
    if todo:
        with ThreadPoolExecutor(max_workers=len(todo)) as pool:
            list(pool.map(lambda item: _build(header, *item), todo.items()))
    return ["-g0", "-include", str(header)]


def _precompiled(header: Path, compile_args: list[str]) -> tuple[Path, list[str]]:
    """Where the header precompiled for a module's ``compile_args`` goes, and the flags.

    g++ tries each file of ``<header>.gch/`` and takes the first valid one (same compiler,
    optimisation, OpenMP, code model); a file is named by a hash of the compiler and the
    flags that matter, so another compiler or flag set adds its own beside the others. The
    ``-D`` macros of the BLAS names are left out: the headers never use them.
    """
    import numpy as np
    from pytensor.configdefaults import config
    from pytensor.link.c.cmodule import std_include_dirs

    flags = [a for a in compile_args if not a.startswith("-D") or a.startswith("-DNPY_")]
    flags += [f"-I{d}" for d in [np.get_include(), *std_include_dirs()]]
    flags += ["-g0", "-fvisibility=hidden"]  # as compile_str adds it
    digest = hashlib.sha256(repr([config.cxx, config.gcc_version_str, flags]).encode())
    return header.with_name(f"{header.name}.gch") / f"{digest.hexdigest()[:20]}.gch", flags


def _build(header: Path, target: Path, flags: list[str]) -> bool:
    """Precompile ``header`` with ``flags`` into ``target``, whole or not at all."""
    from pytensor.configdefaults import config

    tmp = header.with_name(f".{target.name}.{os.getpid()}.tmp")
    cmd = [config.cxx, *flags, "-x", "c++-header", "-o", str(tmp), str(header)]
    try:
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            return False
        target.parent.mkdir(exist_ok=True)
        os.replace(tmp, target)  # never half-written in the folder g++ reads
        return True
    except OSError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
