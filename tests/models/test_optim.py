"""Optimisers, lr policies and label smoothing against torch (an independent reference).

Each optimiser (sgd, sgd + Nesterov, adam, adamw, lars) gets the same start parameters and the
same 5 fixed random gradients as ``torch.optim``'s (lars: a float64 numpy reference of the
documented formula, torch has none), with weight decay, a non-regularizable parameter, lr
multipliers and a zero parameter; each lr policy's per-step lr, as the Trainer computes it,
equals torch's scheduler stepped once per step (with warm-up: the documented formula and
torch's ``ChainedScheduler`` with ``LinearLR``); the label-smoothed loss equals
``CrossEntropyLoss(label_smoothing)``; Adam's state survives a checkpoint exactly.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.compile.mode import Mode

from theanompi.errors import ConfigError
from theanompi.models import create_model
from theanompi.models.optim import LR_POLICIES, OPTIMIZERS, lr_policy
from theanompi.train.schedule import LRSchedule

torch = pytest.importorskip("torch")

PY = Mode(linker="py", optimizer="fast_compile")
STEPS = 5
#: name -> (shape, regularizable, lr_mult); "z" starts at 0 (LARS: no adaptation)
PARAMS = {
    "w": ((4, 3), True, 1.0),
    "b": ((3,), False, 2.0),
    "u": ((3, 2), True, 0.5),
    "z": ((2, 2), True, 1.0),
}
CASES = {
    "sgd": {"momentum": 0.9, "weight_decay": 0.01},
    "sgd_nesterov": {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    "adam": {"beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.05},
    "adamw": {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1},
    "lars": {"momentum": 0.9, "weight_decay": 0.01, "eta": 0.02, "eps": 1e-8},
    "lars_nesterov": {"momentum": 0.8, "nesterov": True, "weight_decay": 0.0, "eta": 0.05},
}
LR = {"sgd": 0.1, "adam": 0.01, "adamw": 0.01, "lars": 1.0}


def _start() -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    rng = np.random.default_rng(7)
    init = {n: rng.standard_normal(s).astype(np.float32) for n, (s, _, _) in PARAMS.items()}
    init["z"][:] = 0
    grads = [
        {n: rng.standard_normal(s).astype(np.float32) for n, (s, _, _) in PARAMS.items()}
        for _ in range(STEPS)
    ]
    return init, grads


def _ours(name: str, kw: dict, lr: float) -> dict[str, np.ndarray]:
    init, grads = _start()
    params = []
    for n, (_, regularizable, mult) in PARAMS.items():
        p = pytensor.shared(init[n].copy(), name=n)
        p.tag.regularizable, p.tag.lr_mult = regularizable, mult
        params.append(p)
    opt = OPTIMIZERS.get(name)(params, pytensor.shared(np.float32(lr), name="lr"), **kw)
    g_in = [pt.tensor(f"g_{p.name}", dtype="float32", shape=p.type.shape) for p in params]
    step = pytensor.function(g_in, [], updates=opt.updates(g_in), mode=PY)
    for g in grads:
        step(*(g[n] for n in PARAMS))
    return {p.name: p.get_value() for p in params}


def _torch(name: str, kw: dict, lr: float) -> dict[str, np.ndarray]:
    init, grads = _start()
    ps = {n: torch.tensor(init[n], dtype=torch.float64, requires_grad=True) for n in PARAMS}
    wd = kw.get("weight_decay", 0.0)
    groups = [
        {"params": [ps[n]], "lr": lr * mult, "weight_decay": wd if reg else 0.0}
        for n, (_, reg, mult) in PARAMS.items()
    ]
    if name == "sgd":
        opt = torch.optim.SGD(
            groups, lr=lr, momentum=kw["momentum"], nesterov=kw.get("nesterov", False)
        )
    else:
        cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
        opt = cls(groups, lr=lr, betas=(kw["beta1"], kw["beta2"]), eps=kw["eps"])
    for g in grads:
        for n, p in ps.items():
            p.grad = torch.tensor(g[n], dtype=torch.float64)
        opt.step()
    return {n: p.detach().numpy() for n, p in ps.items()}


def _lars_numpy(kw: dict, lr: float) -> dict[str, np.ndarray]:
    """The documented LARS (apex LARC(clip=False) around SGD) in float64."""
    init, grads = _start()
    w = {n: init[n].astype(np.float64) for n in PARAMS}
    v = {n: np.zeros_like(w[n]) for n in PARAMS}
    mu, wd, eta, eps = kw["momentum"], kw["weight_decay"], kw["eta"], kw.get("eps", 1e-8)
    for g in grads:
        for n, (_, reg, mult) in PARAMS.items():
            gn = g[n].astype(np.float64)
            wn, gnorm = np.linalg.norm(w[n]), np.linalg.norm(gn)
            d = gn
            if reg and wn > 0 and gnorm > 0:
                d = eta * wn / (gnorm + wd * wn + eps) * (gn + wd * w[n])
            v[n] = mu * v[n] - lr * mult * d
            w[n] = w[n] + (mu * v[n] - lr * mult * d if kw.get("nesterov") else v[n])
    return w


@pytest.mark.parametrize("case", list(CASES))
def test_optimizer_matches_the_reference_after_5_steps(case: str) -> None:
    name = case.split("_")[0]
    kw = CASES[case]
    lr = LR[name]
    ours = _ours(name, kw, lr)
    ref = _lars_numpy(kw, lr) if name == "lars" else _torch(name, kw, lr)
    init, _ = _start()
    for n in PARAMS:
        assert not np.allclose(ours[n], init[n], atol=1e-3), f"{case}: {n} barely moved"
        np.testing.assert_allclose(ours[n], ref[n], rtol=0, atol=1e-5, err_msg=f"{case}: {n}")


def test_lars_adapts_only_regularizable_nonzero_params() -> None:
    """The zero and the bias parameter take plain SGD steps; the others are scaled."""
    kw = {"momentum": 0.0, "weight_decay": 0.0, "eta": 0.02}
    lars, sgd = _ours("lars", kw, 1.0), _ours("sgd", {"momentum": 0.0}, 1.0)
    np.testing.assert_array_equal(lars["b"], sgd["b"])
    assert not np.allclose(lars["w"], sgd["w"])
    init, grads = _start()  # z: its first step is plain SGD, then it is no longer 0
    assert np.linalg.norm(lars["z"] - init["z"]) > np.linalg.norm(lars["w"] - init["w"])


def test_state_names_and_adam_step_count() -> None:
    m = create_model(_mlp("adamw"))
    names = [s.name for s in m.opt_state]
    assert names[0] == "adamw.step" and names[1:3] == ["fc1.W.exp_avg", "fc1.W.exp_avg_sq"]
    assert len(names) == 1 + 2 * len(m.params)
    lars = create_model(_mlp("lars"))
    assert [s.name for s in lars.opt_state] == [f"{p.name}.v" for p in lars.params]


# -- checkpoint ------------------------------------------------------------------------------
def _mlp(optimizer: str, **extra: object) -> dict:
    return {
        "name": "mlp",
        "input_size": 4,
        "channels": 1,
        "n_classes": 5,
        "batch_size": 8,
        "optimizer": optimizer,
        "learning_rate": 0.01,
        "weight_decay": 0.01,
        "arch": {"hidden": [6], "dropout": 0.0},
        **extra,
    }


def _batches(n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(3)
    return [
        (rng.standard_normal((8, 1, 4, 4)).astype(np.float32) * 50, rng.integers(0, 5, 8, np.int32))
        for _ in range(n)
    ]


def _values(model) -> list[np.ndarray]:
    return [np.array(v.get_value()) for v in model.params + model.opt_state]


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_adam_state_resumes_exactly_from_a_checkpoint(tmp_path, optimizer: str) -> None:
    from theanompi.io.checkpoint import apply_checkpoint, load_checkpoint, save_checkpoint

    batches = _batches(STEPS)
    whole = create_model(_mlp(optimizer)).build(mode=PY)
    for x, y in batches:
        whole.train_step(x, y)
    first = create_model(_mlp(optimizer)).build(mode=PY)
    for x, y in batches[:3]:
        first.train_step(x, y)
    path = save_checkpoint(tmp_path / "epoch_0001.npz", first, {"epoch": 1, "step": 3})
    fresh = create_model(_mlp(optimizer, arch={"hidden": [6], "dropout": 0.0, "seed": 9}))
    fresh.build(mode=PY)
    assert not np.array_equal(fresh.params[0].get_value(), first.params[0].get_value())
    apply_checkpoint(fresh, load_checkpoint(path))
    assert float(fresh.opt_state[0].get_value()) == 3.0
    for x, y in batches[3:]:
        fresh.train_step(x, y)
    for a, b, var in zip(
        _values(fresh), _values(whole), whole.params + whole.opt_state, strict=True
    ):
        np.testing.assert_array_equal(a, b, err_msg=var.name)
    assert float(whole.opt_state[0].get_value()) == STEPS


def test_a_checkpoint_of_another_optimizer_is_one_line(tmp_path) -> None:
    from theanompi.io.checkpoint import apply_checkpoint, load_checkpoint, save_checkpoint

    path = save_checkpoint(tmp_path / "epoch_0001.npz", create_model(_mlp("sgd")), {"epoch": 1})
    with pytest.raises(ConfigError) as info:
        apply_checkpoint(create_model(_mlp("adam")), load_checkpoint(path))
    assert "\n" not in str(info.value) and "'fc1.W.v' in the checkpoint but 'adam.step'" in str(
        info.value
    )


def test_adam_apply_grads_equals_train_step() -> None:
    """The split step (BSP cdd) runs the same optimiser updates."""
    batches = _batches(3)
    a, b = (create_model(_mlp("adam")).build(mode=PY) for _ in range(2))
    for x, y in batches:
        a.train_step(x, y)
        b.compute_grads(x, y)
        b.apply_grads()
    for u, v in zip(_values(a), _values(b), strict=True):
        np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-7)


# -- lr policies -----------------------------------------------------------------------------
SPE, EPOCHS, BASE = 3, 4, 0.1  # steps per epoch, epochs, learning_rate
TOTAL = SPE * EPOCHS


def _trainer_lrs(policy: str, scale: float = 1.0, warmup: int = 0, **keys: object) -> list[float]:
    """The lr of each global step as the Trainer sets it (``adjust_hyperparams`` per epoch,
    then ``LRSchedule.lr`` per step), built as ``theanompi.train.run`` builds the schedule."""
    section = _mlp("sgd", learning_rate=BASE, lr_policy=policy, n_epochs=EPOCHS, **keys)
    model = create_model(section)
    schedule = LRSchedule.from_config(model.config, scale, warmup, TOTAL)
    out = []
    for epoch in range(EPOCHS):
        model.adjust_hyperparams(epoch)
        epoch_lr = float(model.lr.get_value())
        out += [schedule.lr(epoch_lr, epoch * SPE + k) for k in range(SPE)]
    return out


def _torch_lrs(policy: str, lr: float = BASE, warmup_start: float | None = None, warmup: int = 0):
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=lr)
    sch = torch.optim.lr_scheduler
    main = {
        "step": lambda: sch.MultiStepLR(opt, milestones=[1 * SPE, 3 * SPE], gamma=0.5),
        "fixed": lambda: sch.ConstantLR(opt, factor=1.0, total_iters=0),
        "cosine": lambda: sch.CosineAnnealingLR(opt, T_max=TOTAL, eta_min=0),
        "poly": lambda: sch.PolynomialLR(opt, total_iters=TOTAL, power=0.9),
    }[policy]()
    if warmup_start is not None:
        # ours at t < W: s + (1 - s)(t + 1)/W == LinearLR from s + (1 - s)/W over W - 1 steps
        first = warmup_start + (1 - warmup_start) / warmup
        ramp = sch.LinearLR(opt, start_factor=first, end_factor=1.0, total_iters=warmup - 1)
        main = sch.ChainedScheduler([ramp, main])
    out = []
    for _ in range(TOTAL):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        main.step()
    return out


KEYS = {"lr_step": [1, 3], "lr_gamma": 0.5, "lr_power": 0.9}


@pytest.mark.parametrize("policy", ["step", "fixed", "cosine", "poly"])
def test_lr_policy_matches_torch_scheduler(policy: str) -> None:
    ours = _trainer_lrs(policy, **KEYS)
    np.testing.assert_allclose(ours, _torch_lrs(policy), rtol=0, atol=1e-6)
    if policy in ("cosine", "poly"):
        assert ours[0] > ours[SPE] > ours[-1] > 0  # per step: it decays within an epoch too
        assert ours[SPE - 1] < ours[0]


@pytest.mark.parametrize("policy", ["step", "fixed", "cosine", "poly"])
@pytest.mark.parametrize("scale", [1.0, 2.0])
def test_lr_policy_with_warmup(policy: str, scale: float) -> None:
    """lr(t) = policy lr(t) * k * warm(t), warm(t) = s + (1 - s)(t + 1)/W for t < W, else 1."""
    warmup = 5
    ours = _trainer_lrs(policy, scale=scale, warmup=warmup, **KEYS)
    plain = _torch_lrs(policy)
    s = 1 / scale if scale > 1 else 0.0
    warm = [s + (1 - s) * (t + 1) / warmup if t < warmup else 1.0 for t in range(TOTAL)]
    formula = [lr * scale * w for lr, w in zip(plain, warm, strict=True)]
    np.testing.assert_allclose(ours, formula, rtol=0, atol=1e-6)
    chained = _torch_lrs(policy, BASE * scale, warmup_start=s, warmup=warmup)
    np.testing.assert_allclose(ours, chained, rtol=0, atol=1e-6)


@pytest.mark.parametrize("policy", ["step", "fixed"])
def test_step_and_fixed_are_bit_identical_to_the_epoch_schedule(policy: str) -> None:
    """The per-step factor of an epoch policy is exactly 1: the lr the Trainer set before."""
    sched = LRSchedule.from_config({**KEYS, "lr_policy": policy}, 4.0, 7, TOTAL)
    old = LRSchedule(4.0, 7)
    for epoch_lr in (0.1, 0.0125, np.float32(0.01).item(), 1e-3 / 3):
        for t in range(TOTAL):
            assert sched.lr(epoch_lr, t) == epoch_lr * old.scale * old.factor(t)
    m = create_model(_mlp("sgd", learning_rate=0.01, lr_policy="step", lr_step=[2, 4]))
    for epoch in range(6):
        m.adjust_hyperparams(epoch)
        expected = 0.01 * 0.1 ** sum(1 for s in (2, 4) if epoch >= s)  # the old step_lr
        assert m.lr.get_value() == np.float32(expected)


def test_per_step_policy_needs_the_run_length() -> None:
    with pytest.raises(ValueError, match="total_steps >= 1"):
        LRSchedule(1.0, 0, lr_policy({**KEYS, "lr_policy": "cosine"}), 0)
    assert list(LR_POLICIES) == ["step", "fixed", "cosine", "poly"]


# -- label smoothing -------------------------------------------------------------------------
@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.35])
def test_label_smoothing_loss_matches_torch(smoothing: float) -> None:
    from theanompi.models.metrics import symbolic_metrics

    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((16, 7)) * 3).astype(np.float32)
    y = rng.integers(0, 7, 16).astype(np.int32)
    lv, yv = pt.matrix("logits", dtype="float32"), pt.vector("y", dtype="int32")
    loss, _, _ = symbolic_metrics(lv, yv, label_smoothing=smoothing)
    ours = pytensor.function([lv, yv], loss, mode=PY)(logits, y)
    ce = torch.nn.CrossEntropyLoss(label_smoothing=smoothing)
    ref = ce(torch.tensor(logits, dtype=torch.float64), torch.tensor(y, dtype=torch.long)).item()
    assert abs(float(ours) - ref) < 1e-5


def test_label_smoothing_changes_the_training_loss_only() -> None:
    (x, y), s = _batches(1)[0], 0.2
    m = create_model(_mlp("sgd", label_smoothing=s)).build(mode=PY)
    logp = torch.tensor(np.log(m.predict(x).astype(np.float64)))
    yt = torch.tensor(y, dtype=torch.long)
    val_loss = m.val_step(x, y)[0]
    assert abs(val_loss - torch.nn.CrossEntropyLoss()(logp, yt).item()) < 1e-5
    train_loss = m.train_step(x, y)[0]
    smoothed = torch.nn.CrossEntropyLoss(label_smoothing=s)(logp, yt).item()
    assert abs(train_loss - smoothed) < 1e-5 and abs(train_loss - val_loss) > 1e-3


# -- config ----------------------------------------------------------------------------------
def test_bad_optimizer_name_is_one_config_error_line(tmp_path) -> None:
    import yaml

    from theanompi.config import load_config

    run, model = tmp_path / "config.yaml", tmp_path / "m.yaml"
    run.write_text("{}\n")
    model.write_text(yaml.safe_dump(_mlp("adma")))
    with pytest.raises(ConfigError) as info:
        load_config(run, model)
    msg = str(info.value)
    assert "\n" not in msg and "optimizer is 'adma'" in msg
    assert all(repr(n) in msg for n in ("sgd", "adam", "adamw", "lars"))
    with pytest.raises(ConfigError) as info:
        create_model(_mlp("adma"))
    msg = str(info.value)
    assert "\n" not in msg and "did you mean 'adam'" in msg and "'lars'" in msg
    model.write_text(yaml.safe_dump(_mlp("adam", lr_policy="cosine", lr_power=0.9)))
    cfg = load_config(run, model)
    assert (cfg.model.optimizer, cfg.model.lr_policy, cfg.model.lr_power) == ("adam", "cosine", 0.9)
    for key, bad, rule in [
        ("lr_policy", "exp", "one of 'step', 'fixed', 'cosine', 'poly'"),
        ("label_smoothing", 1.0, "in [0, 1)"),
        ("beta2", 1.0, "in [0, 1)"),
        ("eps", 0, "positive"),
        ("lars_eta", -1, "positive"),
        ("lr_power", 0, "positive"),
    ]:
        model.write_text(yaml.safe_dump(_mlp("sgd", **{key: bad})))
        with pytest.raises(ConfigError) as info:
            load_config(run, model)
        assert f"model.{key}" in str(info.value) and rule in str(info.value), str(info.value)


def test_nesterov_is_refused_for_adam() -> None:
    with pytest.raises(ConfigError, match="nesterov applies to sgd and lars, not adam"):
        create_model(_mlp("adam", nesterov=True))


def test_importing_the_registries_does_not_import_pytensor() -> None:
    """The config loader reads OPTIMIZERS and LR_POLICIES: that must stay cheap."""
    code = "import sys, theanompi.models.optim; sys.exit('pytensor' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_doctests() -> None:
    import doctest

    import theanompi.models.optim
    import theanompi.train.schedule

    for module in (theanompi.models.optim, theanompi.train.schedule):
        assert doctest.testmod(module).failed == 0, module.__name__
