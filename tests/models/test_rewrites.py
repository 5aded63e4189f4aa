"""Our rewrites reach any graph compiled with the C backend's mode, a user's too."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.tensor.special import LogSoftmax, Softmax, log_softmax, softmax

from theanompi.models.ops import compile_mode


def _compile(mode):
    x = pt.matrix("x")
    y = pt.ivector("y")
    logp = log_softmax(x, axis=-1)
    loss = -logp[pt.arange(y.shape[0]), y].mean()
    return pytensor.function([x, y], [softmax(x, axis=-1), logp, pytensor.grad(loss, x)], mode=mode)


def _ops(fn) -> set[type]:
    return {type(n.op) for n in fn.maker.fgraph.apply_nodes}


def test_softmax_and_log_softmax_are_inlined_and_exact() -> None:
    mode = compile_mode("c")
    fn = _compile(mode)
    assert not _ops(fn) & {Softmax, LogSoftmax}
    assert {Softmax, LogSoftmax} <= _ops(_compile(mode.excluding("theanompi")))

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 5)) * 30).astype(np.float32)  # large: the max shift matters
    y = rng.integers(0, 5, 6).astype(np.int32)
    sm, logp, g = fn(x, y)
    x64 = x.astype(np.float64)
    ref_logp = x64 - x64.max(1, keepdims=True)
    ref_logp -= np.log(np.exp(ref_logp).sum(1, keepdims=True))
    ref_g = np.exp(ref_logp)
    ref_g[np.arange(6), y] -= 1
    np.testing.assert_allclose(logp, ref_logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sm, np.exp(ref_logp), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g, ref_g / 6, rtol=1e-5, atol=1e-7)
