"""One process of ``test_graph_cache``: build the digits model (batch 8), train 2 steps and
evaluate on fixed data, and print what the test compares as JSON: the graph cache's hits and
misses, the losses, a digest of the parameters and eval outputs, and the order of the train
function's nodes."""

from __future__ import annotations

import hashlib
import json

import numpy as np

import theanompi.pytensor_env  # noqa: F401  (float32, the C linker, the compile dir)
from theanompi.config import load_config
from theanompi.models import create_model
from theanompi.models.ops import _graph_cache

model = create_model(load_config(model="digits").model).build(8)
train, evaluate = model._steps.fns["train"], model._steps.fns["eval"]
rng = np.random.default_rng(0)
x = rng.standard_normal((8, *model.input_shape)).astype("float32")
y = rng.integers(0, 10, 8).astype("int32")
losses = [float(train(x, y)[0]) for _ in range(2)]
values = hashlib.sha256()
for p in model.params:
    values.update(p.get_value().tobytes())
for out in evaluate(x, y):
    values.update(np.asarray(out).tobytes())
order = [f"{n.op} {[i.type for i in n.inputs]}" for n in train.maker.fgraph.toposort()]
print(
    json.dumps(
        {
            "stats": _graph_cache.stats,
            "losses": losses,
            "values": values.hexdigest(),
            "order": hashlib.sha256("\n".join(order).encode()).hexdigest(),
        }
    )
)
