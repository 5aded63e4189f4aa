"""PyTensor set-up: float32, the C linker, a Gemm that links the real BLAS, per-node compile dirs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

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
    import sys, time
    from theanompi.pytensor_env import configure, CompileTurn
    configure()
    from mpi4py import MPI
    import pytensor, pytensor.tensor as pt
    comm = MPI.COMM_WORLD
    turn = CompileTurn(comm, compiles=comm.Get_rank() != int(sys.argv[1]))
    t0 = MPI.Wtime()
    if turn.comm != MPI.COMM_NULL:
        with turn:
            start = MPI.Wtime() - t0
            x = pt.vector("x")
            # a graph of its own (a constant no other test uses): a cold compile
            f = pytensor.function([x], pt.exp(x * 1.2345678) + pt.log1p(pt.abs(x)))
            assert abs(f([0.0])[0] - 1.0) < 1e-6
            took = MPI.Wtime() - t0 - start
    else:
        start = took = -1.0
    from pytensor.link.c.basic import get_module_cache

    compiled = get_module_cache().stats[2]  # C modules this process compiled (not loaded)
    rows = comm.gather((comm.Get_rank(), turn.first, start, took, compiled))
    if comm.Get_rank() == 0:
        for row in rows:
            print(*row)
    """
)


def _compile_once_rows(mpirun, tmp_path, server: int) -> list[list[str]]:
    script = tmp_path / "compile_once.py"
    script.write_text(COMPILE_ONCE)
    env = {"THEANOMPI_CACHE": str(tmp_path / "cache"), "PYTENSOR_FLAGS": ""}  # a cold cache
    out = mpirun(3, [script, str(server)], env=env, timeout=300)
    return [line.split() for line in out.stdout.strip().splitlines()]


@pytest.mark.mpi
def test_compile_once_per_node_the_first_compiles_the_others_wait(mpirun, tmp_path) -> None:
    """3 ranks on one node, rank 0 builds no model (an EASGD server): rank 1 compiles first,
    rank 2 starts only when rank 1 is done and then loads its modules, compiling none."""
    rows = _compile_once_rows(mpirun, tmp_path, server=0)
    (_, f0, s0, _, _), (_, f1, s1, t1, c1), (_, f2, s2, _, c2) = rows
    assert (f0, f1, f2) == ("False", "True", "False")
    assert float(s0) == -1.0
    assert float(s2) >= float(s1) + float(t1) - 0.05, rows  # waited for the first
    assert int(c1) >= 1 and int(c2) == 0, rows  # the first compiled, the other only loaded
    assert len(list((tmp_path / "cache" / "pytensor").iterdir())) == 1  # one dir for the node
