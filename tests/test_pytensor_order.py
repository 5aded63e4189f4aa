"""PyTensor set up alike whether ``import pytensor`` came before ``import theanompi`` or after:
the same float type, linker, OpenMP and compile cache (each order in a fresh process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from theanompi.launch.testing import REPO
from theanompi.pytensor_env import compile_dir

PROBE = textwrap.dedent(
    """
    import json, sys
    if sys.argv[1] == "pytensor-first":
        import pytensor, pytensor.tensor
    import numpy as np
    import theanompi as tm
    import pytensor, pytensor.tensor as pt

    rng = np.random.default_rng(0)
    W = pytensor.shared(rng.standard_normal((3 * 8 * 8, 4)).astype("float32"), name="W")
    b = pytensor.shared(np.zeros(4, "float32"), name="b")
    m = tm.wrap_network(lambda x, train: pt.dot(x.flatten(2) / 255.0, W) + b, [W, b],
                        {"input_size": 8, "n_classes": 4, "learning_rate": 0.1})
    m.build(batch_size=2)
    x = rng.uniform(-128, 128, (2, 3, 8, 8)).astype("float32")
    m.train_step(x, np.array([0, 1], "int32"))
    h = pt.matrix("h")  # a graph of the user's own, with a Python float in it
    f = pytensor.function([h], pt.exp(h) * 0.5)
    from pytensor.link.c.op import OpenMPOp
    c = pytensor.config
    print(json.dumps({
        "floatX": c.floatX, "linker": c.linker, "mode": str(c.mode), "openmp": c.openmp,
        "compiledir": str(c.compiledir),
        "ldflags": c.blas__ldflags,
        "params": [str(v.get_value().dtype) for v in m.params + m.opt_state + m.grads],
        "train_outputs": [o.type.dtype for o in m._fn("train").maker.fgraph.outputs],
        "user_output": str(f(np.ones((2, 2), "float32")).dtype),
        "default_linker": type(f.maker.linker).__name__,
        "add_openmp": pt.add.openmp,
    }))
    """
)


def _probe(order: str, flags: str | None = None) -> dict:
    """The set-up in a fresh process (the node's compile cache, as every run: warm)."""
    env = os.environ | {"PYTHONPATH": str(REPO)}
    env.pop("PYTENSOR_FLAGS", None)
    if flags is not None:
        env["PYTENSOR_FLAGS"] = flags
    out = subprocess.run(
        [sys.executable, "-c", PROBE, order],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def both() -> tuple[dict, dict]:
    return _probe("theanompi-first"), _probe("pytensor-first")


def test_pytensor_first_gives_the_same_setup(both: tuple[dict, dict]) -> None:
    ours, theirs = both
    assert theirs == ours


def test_float32_c_linker_and_our_compile_cache(both: tuple[dict, dict]) -> None:
    for got in both:
        assert got["floatX"] == "float32" and got["linker"] == "cvm" and got["openmp"]
        assert set(got["params"]) == {"float32"}
        assert got["train_outputs"][0] == "float32" and got["user_output"] == "float32"
        assert "-lscipy_openblas" in got["ldflags"] and got["add_openmp"] is True
    assert both[1]["compiledir"].startswith(str(compile_dir().resolve()))  # not ~/.pytensor


def test_the_users_flags_still_win_in_either_order() -> None:
    for order in ("theanompi-first", "pytensor-first"):
        got = _probe(order, flags="openmp=False")
        assert got["linker"] == "cvm" and got["openmp"] is False and got["floatX"] == "float32"


def test_a_compile_before_theanompi_keeps_its_cache_with_a_warning(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import warnings
        import pytensor, pytensor.tensor as pt
        x = pt.vector("x"); pytensor.function([x], x + 1)   # compiles: compiledir is fixed
        before = str(pytensor.config.compiledir)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from theanompi.pytensor_env import configure; configure()
        assert str(pytensor.config.compiledir) == before
        assert pytensor.config.floatX == "float32"
        print([str(w.message) for w in caught if "compile cache stays" in str(w.message)])
        """
    )
    env = os.environ | {"THEANOMPI_CACHE": str(tmp_path), "PYTHONPATH": str(REPO)}
    env.pop("PYTENSOR_FLAGS", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "import theanompi before compiling" in out.stdout, out.stdout
