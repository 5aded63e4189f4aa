"""Parity with PyTorch: the small CNN and AlexNet rebuilt by hand in PyTorch (an independent
reference, not ``theanompi.bench``'s translation), our initial weights copied in, the same
photo-like batch, dropout off, 3 SGD steps with momentum 0.9 and weight decay (weights only;
biases at ``lr * bias_lr_mult``) done by ``torch.optim.SGD``. Per step, the losses and every
parameter's update (L2 norm of the difference over the norm of the update, per parameter
and step) must agree with a float64 reference.

The photos are letterboxed (a black border, as scans and non-square photos get): with zero
biases many pre-activations are then exactly 0, where PyTensor's ``maximum(x, 0)`` would
send gradient 1 and PyTorch sends 0; ``test_exact_zero_preactivations_exist`` checks that
the batch has them, so the ReLU convention is tested (with ``maximum`` the small CNN's
``conv1.b`` update is off by 87%, AlexNet's by 24-29%).

Tolerances. Small CNN: updates within 1e-3 relative, losses 1e-5 (measured ~1e-4 and
~5e-8: float32 arithmetic). AlexNet: losses within 1e-5 relative; updates within 1e-4
relative once the float32 spacing (ulp) of the parameter is forgiven: an update smaller
than that cannot be stored (the theanompi recipe's conv biases of 0.1 have ulp 7e-9 and
see updates of 1e-11, which float32 drops, ours and PyTorch's float32 alike). Measured:
~6e-7 (PyTorch's own float32 run: ~5e-7).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from theanompi.models import create_model  # noqa: E402

STEPS = 3
LR, MU, WD = 0.01, 0.9, 0.0005


def _section(name: str, size: int, arch: dict) -> dict:
    return {
        "name": name,
        "input_size": size,
        "channels": 3,
        "n_classes": 10,
        "learning_rate": LR,
        "momentum": MU,
        "weight_decay": WD,
        "arch": arch,
    }


# ------------------------------------------------------------------ the PyTorch references
def _small_cnn_ref(p: dict, x, n_blocks: int):
    """conv3x3(pad 1) -> ReLU -> maxpool 2, ``n_blocks`` times; fc -> ReLU -> fc."""
    h = x * (1.0 / 255.0)
    for i in range(1, n_blocks + 1):
        h = F.relu(F.conv2d(h, p[f"conv{i}.W"], p[f"conv{i}.b"], padding=1))
        if h.shape[-1] >= 2:
            h = F.max_pool2d(h, 2)
    h = F.relu(h.flatten(1) @ p["fc1.W"] + p["fc1.b"])
    return h @ p["fc2.W"] + p["fc2.b"]


_ALEX = [  # kernel, stride, pad, groups, lrn, pool: Krizhevsky et al. 2012
    (11, 4, 0, 1, True, True),
    (5, 1, 2, 2, True, True),
    (3, 1, 1, 1, False, False),
    (3, 1, 1, 2, False, False),
    (3, 1, 1, 2, False, True),
]


def _alexnet_ref(p: dict, x, lrn_after_pool: bool, alpha_over_n: bool, scale: float):
    h = x * scale
    alpha = 1e-4 if alpha_over_n else 1e-4 * 5  # torch's LRN divides alpha by n
    for i, (_k, s, pad, g, lrn, pool) in enumerate(_ALEX, 1):
        h = F.relu(F.conv2d(h, p[f"conv{i}.W"], p[f"conv{i}.b"], stride=s, padding=pad, groups=g))
        ops = [("lrn", lrn), ("pool", pool)]
        for what, on in reversed(ops) if lrn_after_pool else ops:
            if on and what == "lrn":
                h = F.local_response_norm(h, 5, alpha=alpha, beta=0.75, k=2.0)
            elif on:
                h = F.max_pool2d(h, 3, 2)
    h = h.flatten(1)
    for i in (6, 7):
        h = F.relu(h @ p[f"fc{i}.W"] + p[f"fc{i}.b"])
    return h @ p["fc8.W"] + p["fc8.b"]


# ------------------------------------------------------------------ running both sides
def _ours(model, x, y):
    """(losses, per-step updates {name: [delta]}, {name: [float32 spacing]}) of our model:
    the spacing (ulp) of each parameter before each step bounds how much of an update
    float32 can hold (a 1e-11 step on a bias of 0.1, whose ulp is 7e-9, is lost)."""
    model.build(batch_size=len(x))
    before = {q.name: q.get_value().copy() for q in model.params}
    losses, deltas, ulps = [], {n: [] for n in before}, {n: [] for n in before}
    for _ in range(STEPS):
        for n, v in before.items():
            ulps[n].append(float(np.linalg.norm(np.spacing(v))))
        losses.append(model.train_step(x, y)[0])
        for q in model.params:
            now = q.get_value()
            deltas[q.name].append(now.astype(np.float64) - before[q.name])
            before[q.name] = now.copy()
    return losses, deltas, ulps


def _reference(model, forward, x, y, dtype, bias_lr_mult=1.0):
    """The same 3 steps in PyTorch from our initial weights; ``forward(params, x)``; our
    Dense ``W`` is (n_in, n_out), so the references compute ``h @ W`` as we do."""
    params, groups = {}, []
    for q in model.params:
        t = torch.tensor(q.get_value(), dtype=dtype, requires_grad=True)
        params[q.name] = t
        decay = q.name.endswith(".W")  # stated here, not read from our tags
        mult = 1.0 if decay else bias_lr_mult
        groups.append({"params": [t], "weight_decay": WD if decay else 0.0, "lr": LR * mult})
    opt = torch.optim.SGD(groups, lr=LR, momentum=MU)
    xt, yt = torch.tensor(x, dtype=dtype), torch.tensor(y, dtype=torch.long)
    losses, deltas = [], {n: [] for n in params}
    for _ in range(STEPS):
        before = {n: t.detach().clone() for n, t in params.items()}
        opt.zero_grad()
        loss = F.cross_entropy(forward(params, xt), yt)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        for n, t in params.items():
            deltas[n].append((t.detach() - before[n]).double().numpy())
    return losses, deltas


def _worst(ours: dict, ref: dict, ulps: dict | None = None) -> tuple[float, str]:
    """Largest relative L2 difference of an update over parameters and steps; with
    ``ulps``, the float32 spacing of the parameter is forgiven first."""
    worst, where = 0.0, ""
    for n, steps in ref.items():
        for i, (a, b) in enumerate(zip(ours[n], steps, strict=True)):
            excess = max(float(np.linalg.norm(a - b)) - (ulps[n][i] if ulps else 0.0), 0.0)
            err = excess / max(float(np.linalg.norm(b)), 1e-30)
            if err > worst:
                worst, where = err, f"{n} step {i + 1}"
    return worst, where


def _rel(a: list[float], b: list[float]) -> float:
    return float(np.max(np.abs(np.subtract(a, b)) / np.abs(b)))


def _letterboxed(photos, inner: int, size: int, n: int, seed: int):
    """Photo-like ``inner``-pixel images centred on a black ``size`` canvas (as letterboxed
    or scanned photos come): the border is 0 in every image, so 0 after mean subtraction."""
    x, y = photos(inner, n, 10, seed=seed)
    lo = (size - inner) // 2
    out = np.zeros((n, 3, size, size), np.float32)
    out[:, :, lo : lo + inner, lo : lo + inner] = x
    return out, y


# ------------------------------------------------------------------ the tests
@pytest.fixture(scope="module")
def small_cnn_batch(photos):
    return _letterboxed(photos, 18, 28, 32, seed=3)


def test_small_cnn_matches_a_float64_pytorch_reference(small_cnn_batch):
    x, y = small_cnn_batch
    m = create_model(_section("small_cnn", 28, {"dropout": 0.0}))
    ref_losses, ref = _reference(m, lambda p, xt: _small_cnn_ref(p, xt, 2), x, y, torch.float64)
    losses, ours, _ = _ours(m, x, y)
    worst, where = _worst(ours, ref)
    print(f"small_cnn: losses {losses} vs {ref_losses}; worst update {worst:.2e} ({where})")
    assert _rel(losses, ref_losses) < 1e-5, (losses, ref_losses)
    assert worst < 1e-3, f"update of {where} differs by {worst:.2e} relative"


def test_exact_zero_preactivations_exist(small_cnn_batch):
    """The batch must put pre-activations at exactly 0 (else the ReLU convention is untested)."""
    x, _ = small_cnn_batch
    m = create_model(_section("small_cnn", 28, {"dropout": 0.0}))
    p = {q.name: torch.tensor(q.get_value(), dtype=torch.float64) for q in m.params}
    xt = torch.tensor(x, dtype=torch.float64) / 255
    pre1 = F.conv2d(xt, p["conv1.W"], p["conv1.b"], padding=1)
    pre2 = F.conv2d(F.max_pool2d(F.relu(pre1), 2), p["conv2.W"], p["conv2.b"], padding=1)
    fracs = [float((t == 0).double().mean()) for t in (pre1, pre2)]
    print(f"exact zeros among conv1, conv2 pre-activations: {fracs[0]:.1%}, {fracs[1]:.1%}")
    assert min(fracs) > 0.01


@pytest.mark.parametrize("recipe", ["ours", "theanompi"])
def test_alexnet_matches_a_float64_pytorch_reference(photos, recipe):
    """Reduced width (1/16) and fc_units (32) at 67x67, same structure: groups, LRN,
    overlapping 3x3/2 pools; both recipes (LRN order and alpha, init, 2x bias lr, input)."""
    from theanompi.models.alexnet import RECIPES

    x, y = _letterboxed(photos, 43, 67, 16, seed=5)
    m = create_model(
        _section("alexnet", 67, {"recipe": recipe, "width": 0.0625, "fc_units": 32, "dropout": 0.0})
    )
    r = RECIPES[recipe]
    fwd = lambda p, xt: _alexnet_ref(  # noqa: E731
        p, xt, r.lrn_after_pool, r.lrn_alpha_over_n, m.arch["input_scale"]
    )
    ref_losses, ref = _reference(m, fwd, x, y, torch.float64, {"ours": 1, "theanompi": 2}[recipe])
    losses, ours, ulps = _ours(m, x, y)
    worst, where = _worst(ours, ref, ulps)
    print(f"alexnet/{recipe}: losses {losses} vs {ref_losses}; worst update {worst:.2e} ({where})")
    assert _rel(losses, ref_losses) < 1e-5, (losses, ref_losses)
    assert worst < 1e-4, f"update of {where} differs by {worst:.2e} relative (beyond its ulp)"
