"""PyTensor set-up: float32, the C linker, a Gemm that links the real BLAS, per-rank compile dirs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np

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


def test_no_blas_warning_and_compiledir_per_rank(tmp_path) -> None:
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
    assert out.stdout.strip().startswith(str(tmp_path / "pytensor" / "rank3"))
