"""The overlapped gradient step hands each bucket over as soon as it exists, in bucket order,
with the gradients ``compute_grads`` computes."""

from __future__ import annotations

import numpy as np

from theanompi.models.overlap import BucketReady
from theanompi.models.small_cnn import SmallCNN

CFG = {"name": "small_cnn", "input_size": 12, "channels": 3, "n_classes": 5}
ARCH = {"channels": [4, 8], "fc": 16, "dropout": 0.0, "seed": 3}


def test_each_bucket_leaves_right_after_its_gradients() -> None:
    model = SmallCNN(CFG | {"arch": ARCH}).build(4)
    buckets = [[7, 6, 5, 4], [3, 2], [1, 0]]  # fc2+fc1, conv2, conv1: the backward order
    got: list[tuple[int, list[np.ndarray]]] = []
    model.compile_overlapped_grads(buckets, lambda k, vs: got.append((k, [v.copy() for v in vs])))
    fn = model._steps.fns["grads_overlap"]
    order = list(fn.vm.nodes)
    marks = [i for i, n in enumerate(order) if isinstance(n.op, BucketReady)]
    assert [order[i].op.k for i in marks] == [0, 1, 2]
    # nothing runs before bucket 0's Op but what it needs (its inputs' producers, and what
    # must run before those because they overwrite a value in place)
    before = fn.maker.fgraph.orderings()
    needed, todo = set(), [order[marks[0]]]
    while todo:
        node = todo.pop()
        for p in [v.owner for v in node.inputs if v.owner is not None] + list(before.get(node, ())):
            if p not in needed:
                needed.add(p)
                todo.append(p)
    assert set(order[: marks[0]]) == needed
    late = {v.owner for v in order[marks[2]].inputs}  # conv1's gradients: after bucket 0
    assert min(order.index(n) for n in late) > marks[0]

    rng = np.random.default_rng(0)
    x = rng.random((4, 3, 12, 12), dtype=np.float32) * 255
    y = rng.integers(0, 5, 4).astype(np.int32)
    model.compute_grads_overlapped(x, y)
    model.compute_grads(x, y)
    assert [k for k, _ in got] == [0, 1, 2]
    for (_, values), bucket in zip(got, buckets, strict=True):
        for v, i in zip(values, bucket, strict=True):
            np.testing.assert_array_equal(v, model.grads[i].get_value())
