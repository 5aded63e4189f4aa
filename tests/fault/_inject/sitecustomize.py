"""Fault injection at interpreter start, for every process of a job (put this folder first on
``PYTHONPATH``): with ``THEANOMPI_STUCK_RANK=R``, MPI rank R prints ``rank R stuck`` in its
first validation (the watchdog is armed after the first step) and then stays in C code that
holds the GIL (libc's ``sleep`` through ``ctypes.PyDLL``), as a rank hung in a C library does:
its own threads stop too, so it sends no heartbeats, and only a C-level handler
(``faulthandler``) can still report where it is. Works under ``tmpi train -n N`` (whose ranks
this script cannot start itself) and under a bare mpirun alike."""

from __future__ import annotations

import os

_VICTIM = os.environ.get("THEANOMPI_STUCK_RANK")
_MODULE = "theanompi.models.metrics"


def stuck_in_c_holding_the_gil() -> None:
    import ctypes

    libc = ctypes.PyDLL(None)  # PyDLL: the call keeps the GIL
    while True:
        libc.sleep(1000)  # a signal ends one sleep early; sleep again


def _patch(metrics) -> None:  # type: ignore[no-untyped-def]
    import sys

    evaluate = metrics.evaluate

    def first_validation_gets_stuck(*args, **kw):  # type: ignore[no-untyped-def]
        print(f"rank {_VICTIM} stuck", file=sys.stderr, flush=True)
        stuck_in_c_holding_the_gil()
        return evaluate(*args, **kw)

    metrics.evaluate = first_validation_gets_stuck


if _VICTIM is not None and os.environ.get("OMPI_COMM_WORLD_RANK") == _VICTIM:
    import importlib.abc
    import importlib.util
    import sys

    class _Hook(importlib.abc.MetaPathFinder):
        """Patch the metrics module right after it is executed, before anyone imports it."""

        def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
            if name != _MODULE:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            assert spec is not None and spec.loader is not None
            run = spec.loader.exec_module

            def exec_module(module) -> None:  # type: ignore[no-untyped-def]
                run(module)
                _patch(module)

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, _Hook())
