#!/usr/bin/env bash
# First run on a GPU machine: install the gpu extra, run the JAX Op/backend tests on the GPU, then
# time AlexNet b=128 train steps with training.backend jax against PyTorch CUDA and print a table.
# Usage: pipelines/gpu_check.sh [STEPS]     (SKIP_INSTALL=1: use the .venv as it is)
set -euo pipefail
STEPS=${1:-20}
cd "$(dirname "$0")/.."
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
    make venv
    .venv/bin/pip install -q -e '.[gpu,dev]'
fi
PY=.venv/bin/python
$PY -c "import jax; d = jax.devices(); print('jax', jax.__version__, d); assert d[0].platform == 'gpu', 'JAX sees no GPU: install the gpu extra (jax[cuda12])'"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

# 1. our Ops and the small CNN under JAX on the GPU vs the C Ops on the CPU (float32, 1e-5 / 1e-4)
JAX_PLATFORMS=cuda $PY -m pytest -q -p no:cacheprovider -m "not mpi" \
    tests/models/test_jax_ops.py tests/train/test_jax_backend.py

# 2. AlexNet b=128: JAX backend (GPU) vs the same net in PyTorch CUDA, median of STEPS steps each
JAX_PLATFORMS=cuda $PY - "$STEPS" <<'EOF'
import statistics, sys, time
import numpy as np
import torch  # before theanompi configures the environment (as in theanompi.bench.model)
from theanompi.bench.model import CASES, _torch_net
from theanompi.models import create_model

steps, batch = int(sys.argv[1]), 128
sec = {**CASES["alexnet"], "batch_size": batch}
rng = np.random.default_rng(0)
x = rng.normal(0, 50, (batch, 3, 227, 227)).astype(np.float32)
y = rng.integers(0, 1000, batch).astype(np.int32)

def median_s(step):
    step()  # compile / warm up, untimed
    out = []
    for _ in range(steps):
        t = time.perf_counter(); step(); out.append(time.perf_counter() - t)
    return statistics.median(out)

t0 = time.perf_counter()
m = create_model(sec).build(batch, backend="jax")
m.train_step(x, y)  # float(loss): each step ends on the host, so the timing is synchronous
jax_compile = time.perf_counter() - t0
jax_s = median_s(lambda: m.train_step(x, y))

net = _torch_net(create_model(sec)).cuda().train()
opt = torch.optim.SGD(net.parameters(), lr=0.001, momentum=0.9, weight_decay=5e-4)
xt, yt = torch.from_numpy(x / 255).cuda(), torch.from_numpy(y).long().cuda()
loss_fn = torch.nn.CrossEntropyLoss()
def torch_step():
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(net(xt), yt); loss.backward(); opt.step()
    float(loss)  # the same host sync as ours
torch_s = median_s(torch_step)

print(f"\nAlexNet b={batch}, median of {steps} train steps on {torch.cuda.get_device_name(0)}")
print("| backend | s/step | img/s | vs PyTorch CUDA |")
print("|---|---|---|---|")
print(f"| theanompi JAX (compile {jax_compile:.0f} s) | {jax_s:.4f} | {batch / jax_s:.0f} | {torch_s / jax_s:.2f} |")
print(f"| PyTorch CUDA | {torch_s:.4f} | {batch / torch_s:.0f} | 1.00 |")
EOF
