"""PyTensor set-up: float32, the C linker, a Gemm that links the real BLAS, per-node compile dirs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from theanompi.pytensor_env import blas_ldflags


def test_ldflags_link_the_openblas_wheel() -> None:
    flags = blas_ldflags()
    assert "-lscipy_openblas" in flags and "-Dsgemm_=scipy_sgemm_" in flags


def test_c_gemm_uses_blas_and_matches_numpy() -> None:
    import pytensor
    import pytensor.tensor as pt
    from pytensor.tensor.blas import Gemm

    assert pytensor.config.floatX == "float32" and pytensor.config.linker == "cvm"
    a, b, c = pt.matrix("a"), pt.matrix("b"), pt.matrix("c")
    f = pytensor.function([a, b, c], c + 0.5 * pt.dot(a, b))
    assert any(isinstance(node.op, Gemm) for node in f.maker.fgraph.toposort())
    rng = np.random.default_rng(0)
    A, B, C = (rng.standard_normal((64, 64)).astype("float32") for _ in range(3))
    ref = C.astype(np.float64) + 0.5 * A.astype(np.float64) @ B.astype(np.float64)
    np.testing.assert_allclose(f(A, B, C), ref, rtol=1e-4, atol=1e-4)


def test_no_blas_warning_and_compiledir_per_node(tmp_path) -> None:
    code = textwrap.dedent(
        """
        import warnings; warnings.simplefilter("error")
        from theanompi.pytensor_env import configure; configure()
        import pytensor, pytensor.tensor as pt
        x = pt.matrix(); pytensor.function([x], pt.dot(x, x))
        print(pytensor.config.compiledir)
        """
    )
    env = os.environ | {"THEANOMPI_CACHE": str(tmp_path), "OMPI_COMM_WORLD_LOCAL_RANK": "3"}
    env.pop("PYTENSOR_FLAGS", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "blas" not in out.stderr.lower(), out.stderr
    # one folder per host, whatever the local rank: the node's ranks share it
    assert out.stdout.strip().startswith(str(tmp_path / "pytensor" / socket.gethostname()))


COMPILE_ONCE = textwrap.dedent(
    """
    import sys
    from theanompi.pytensor_env import configure
    configure()
    from mpi4py import MPI
    import numpy as np, pytensor, pytensor.tensor as pt
    from pytensor.link.c.basic import get_module_cache
    from theanompi.models.ops import _parallel, compile_mode
    comm = MPI.COMM_WORLD
    ours = []  # modules this process compiled in its turn (the parallel precompile)
    real = _parallel.precompile
    _parallel.precompile = lambda fg, workers=None: ours.append(real(fg, 2)) or ours[-1]
    # variables made before the graph shift the names in a fused Op's pickled inner graph,
    # as a different history of a real process would
    made_before = [pt.scalar() for _ in range(int(sys.argv[1]))]
    x, z = pt.matrix("x"), pt.tensor3("z")  # several C modules (elemwise, reduction, gemm)
    outs = [pt.exp(x) * 2 + 1, (z * 3).sum(axis=1), pt.tanh(x).T @ x]
    comm.Barrier()
    t0 = MPI.Wtime()
    f = pytensor.function([x, z], outs, mode=compile_mode("c"))
    took = MPI.Wtime() - t0
    rng = np.random.default_rng(0)
    a, c = rng.random((3, 3), dtype=np.float32), rng.random((2, 3, 2), dtype=np.float32)
    ref = [np.exp(a) * 2 + 1, (c * 3).sum(axis=1), np.tanh(a).T @ a, np.exp(a) * 0.5 - a]
    linked = get_module_cache().stats[2]  # compiled by PyTensor's own link (not ours)
    g = pytensor.function([x], pt.exp(x) * 0.5 - x)  # a user's own graph, PyTensor's own link
    ok = all(np.allclose(o, r, rtol=1e-5) for o, r in zip(f(a, c) + [g(a)], ref))
    walked = get_module_cache().walked  # unpickled every key.pkl of the cache
    rows = comm.gather((comm.Get_rank(), sum(ours), linked, took, ok, walked))
    if comm.Get_rank() == 0:
        for row in rows:
            print(*row)
    """
)


def _compile_once_rows(mpirun, tmp_path, made_before: int = 0) -> list[list[str]]:
    script = tmp_path / "compile_once.py"
    script.write_text(COMPILE_ONCE)
    env = {"THEANOMPI_CACHE": str(tmp_path / "cache"), "PYTENSOR_FLAGS": ""}  # a cold cache
    out = mpirun(3, [script, str(made_before)], env=env, timeout=300)
    return [line.split() for line in out.stdout.strip().splitlines()]


@pytest.mark.mpi
def test_a_nodes_ranks_compile_each_module_once_and_never_wait_on_a_warm_cache(
    mpirun, tmp_path
) -> None:
    """3 ranks of one node build the same cold graph at once: one of them compiles its modules
    in its turn, the others wait at the lock and then load them, compiling none; a second job
    on the warm cache compiles nothing and reads no module's key beyond those it needs (the
    index); every rank computes what numpy does."""
    cold = _compile_once_rows(mpirun, tmp_path)
    assert all(ok == "True" for *_, ok, _ in cold), cold
    compiled = sorted(int(c) for _, c, *_ in cold)
    assert compiled[:2] == [0, 0] and compiled[2] >= 2, cold  # one rank compiled them all
    assert all(int(linked) == 0 for _, _, linked, *_ in cold), cold  # none left to the link
    warm = _compile_once_rows(mpirun, tmp_path, made_before=7)
    assert all(ok == "True" and walked == "False" for *_, ok, walked in warm), warm
    assert all(int(c) == 0 and int(linked) == 0 for _, c, linked, *_ in warm), warm
    assert len(list((tmp_path / "cache" / "pytensor").iterdir())) == 1  # one dir for the node


@pytest.mark.mpi
def test_a_wrong_or_missing_compile_cache_index_costs_one_walk(mpirun, tmp_path) -> None:
    """The index is a hint: with every line pointing at another module's folder, a garbage
    line, or no index (a cache of an older version), a job walks the cache once, compiles
    nothing and computes what numpy does; the job after it walks no more."""
    _compile_once_rows(mpirun, tmp_path)
    (index,) = (tmp_path / "cache" / "pytensor").glob("*/*/theanompi-key-index.txt")
    lines = index.read_text().split("\n")[:-1]
    folders = sorted({line.split()[1] for line in lines})
    assert len(folders) >= 3, lines
    shifted = {f: folders[(i + 1) % len(folders)] for i, f in enumerate(folders)}
    wrong = [f"{name} {shifted[folder]}" for name, folder in (line.split() for line in lines)]
    for text in ["\n".join(wrong + ["garbage", "m00 ../escape", ""]), None]:
        if text is None:
            index.unlink()
        else:
            index.write_text(text)
        healed = _compile_once_rows(mpirun, tmp_path)
        assert all(ok == "True" for *_, ok, _ in healed), healed
        assert all(int(c) == 0 and int(linked) == 0 for _, c, linked, *_ in healed), healed
        again = _compile_once_rows(mpirun, tmp_path, made_before=7)
        assert all(ok == "True" and walked == "False" for *_, ok, walked in again), again


def test_blas_symbols_are_listed_once_per_library_file(tmp_path) -> None:
    """The first process lists OpenBLAS's symbols with ``nm`` into the compile dir; a later one
    (each rank's start) reads them there and links the same flags with no ``nm`` at all; a
    file naming another library (or another build of it) is listed again."""
    probe = (
        "from theanompi.pytensor_env import blas_ldflags, compile_dir, SYMBOLS_FILE; "
        "print(blas_ldflags()); print(compile_dir() / SYMBOLS_FILE)"
    )
    env = {**os.environ, "THEANOMPI_CACHE": str(tmp_path / "cache")}

    def run(path: str) -> list[str]:
        out = subprocess.run(
            [sys.executable, "-c", probe], env={**env, "PATH": path}, capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()

    flags, kept = run(env["PATH"])
    assert "-Dsgemm_=scipy_sgemm_" in flags and flags == blas_ldflags()
    key, *symbols = Path(kept).read_text().splitlines()
    lib, _, mtime = key.split()
    assert "scipy_sgemm_" in symbols and int(mtime) == os.stat(lib).st_mtime_ns
    no_nm = tmp_path / "bin"
    no_nm.mkdir()
    (no_nm / "nm").write_text(f"#!/bin/sh\ntouch {tmp_path}/nm-ran\nexit 1\n")
    (no_nm / "nm").chmod(0o755)
    assert run(f"{no_nm}:{env['PATH']}")[0] == flags  # read back
    assert not (tmp_path / "nm-ran").exists(), "nm ran again"
    # another library's list (unprefixed: it would drop the -D macros) is not taken
    Path(kept).write_text("/another/libopenblas.so 1 2\nsgemm_\n")
    assert run(env["PATH"])[0] == flags and Path(kept).read_text().splitlines()[0] == key
