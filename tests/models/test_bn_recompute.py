"""The fused BatchNorm + ReLU output recomputed for the backward pass (issue 41): the
recompute gives the training pass's output bit for bit (C and numpy, zeros, NaN); a reduced
ResNet-50 trains the same bits with the rewrite and without it, and in the order the C VM
runs its step no kept BN output is alive once the backward pass starts recomputing them."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.compile.mode import Mode

from theanompi.models.ops import c_mode
from theanompi.models.ops.batchnorm import BatchNormRecompute, BatchNormTrain
from theanompi.models.overlap import demand_order
from theanompi.models.params import get_values

C = Mode(linker="cvm", optimizer="fast_compile")
PY = Mode(linker="py", optimizer="fast_compile")
R = np.random.default_rng(41)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("relu", [False, True])
def test_the_recompute_is_the_training_outputs_bits(dtype, relu):
    """From the mean and invstd the training pass returned: the same ``y``, C and numpy, with a
    zero channel and a NaN in another."""
    x = pt.tensor4("x", dtype=dtype)
    g, b, rm, rv = (pt.vector(n, dtype=dtype) for n in "gbmv")
    y, _, _, mean, invstd = BatchNormTrain(relu=relu)(x, g, b, rm, rv)
    again = BatchNormRecompute(relu=relu)(x, g, b, mean, invstd, x.sum())  # waits for a sum
    xv = R.normal(0.5, 2, (5, 4, 6, 3)).astype(dtype)
    xv[:, 1] = 0.0
    xv[3, 2, 1, 1] = np.nan
    vals = [xv, R.uniform(0.5, 2, 4).astype(dtype), R.normal(-0.5, 0.3, 4).astype(dtype)]
    vals += [np.zeros(4, dtype), np.ones(4, dtype)]
    for mode in (C, PY):
        want, got = pytensor.function([x, g, b, rm, rv], [y, again], mode=mode)(*vals)
        assert got.dtype == dtype and np.isnan(got[:, 2]).all()
        np.testing.assert_array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{got.itemsize}"))
    if relu:
        assert (got == 0).mean() > 0.15  # the rectifier is doing something


def cvm_order(fgraph) -> list:
    """The nodes in the order PyTensor's C VM runs them: each output, then each update, on
    demand (a node's ordering prerequisites, then its inputs, depth first, then the node)."""
    orderings = fgraph.orderings()
    return demand_order(
        [out.owner for out in fgraph.outputs if out.owner is not None],
        lambda node: [*orderings.get(node, []), *(v.owner for v in node.inputs)],
    )


def _tiny_resnet(mode=None):
    """A reduced ResNet-50's compiled train step (``mode``: the default C mode)."""
    from theanompi.models import create_model

    sec = dict(name="resnet50", input_size=32, channels=3, n_classes=10, arch={"width": 0.0625})
    return create_model(sec).build(4, mode=mode)


def test_a_resnet_step_is_the_same_bits_and_frees_each_bn_output_before_the_backward_pass():
    """In the order the C VM runs the train step, every kept fused BN output has had its last
    reader before the first recompute; two steps train the same bits as without the rewrite,
    the second with a NaN."""
    with_rc = _tiny_resnet()
    without = _tiny_resnet(c_mode().excluding("recompute_batch_norm"))
    fgraph = with_rc._fn("train").maker.fgraph
    order = cvm_order(fgraph)
    assert not any(
        isinstance(n.op, BatchNormRecompute) for n in without._fn("train").maker.fgraph.apply_nodes
    )
    at = {n: i for i, n in enumerate(order)}

    def last_read(v):
        return max(at[c] for c, _ in fgraph.clients[v])

    fused = [n for n in order if isinstance(n.op, BatchNormTrain) and n.op.relu]
    again = [n for n in order if isinstance(n.op, BatchNormRecompute)]
    assert len(fused) == 33 and len(again) == 33
    assert max(last_read(n.outputs[0]) for n in fused) < at[again[0]], "z lives into the backward"
    x = R.normal(0, 1, (2, 4, 3, 32, 32)).astype("float32")
    x[1, 2, 1, 5, 5] = np.nan
    y = R.integers(0, 10, 4).astype("int32")
    for batch in x:
        for model in (with_rc, without):
            model.train_step(batch, y)
        for a, b in zip(get_values(with_rc.params), get_values(without.params), strict=True):
            np.testing.assert_array_equal(a, b)
