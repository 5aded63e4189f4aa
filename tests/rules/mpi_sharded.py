"""Per-rank program: 10 BSP cdd steps of a real PyTensor CNN with each optimiser, its state whole
on every rank and sharded (ZeRO-1); checks both give the same parameters bit for bit (LARS's
norms too: float64 sums of the float32 squares, piece by piece or whole),
that every rank holds the same bits, that the model's whole state variables are emptied while
sharded, that the state gathered for a checkpoint is the unsharded one, and that a run taken
up from it, sharded or not, goes on as the unsharded run does. Prints ``OK`` on rank 0.

``python mpi_sharded.py STRATEGY:OPTIMIZER[:K] ...`` (K: sub-batches accumulated per step)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from theanompi.pytensor_env import configure  # noqa: E402

configure()

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from theanompi.config import load_config  # noqa: E402
from theanompi.models import create_model  # noqa: E402
from theanompi.models.params import bcast_values, get_values, set_values  # noqa: E402
from theanompi.rules.bsp import BSP  # noqa: E402
from theanompi.train.rng import get_rng_states, set_rng_states  # noqa: E402

STEPS, MORE, B = 10, 5, 8
OPTIMIZERS = {  # every tag in play: weight decay on the weights only, Nesterov, LARS's ratio
    "sgd": {"model.optimizer": "sgd", "model.nesterov": True, "model.learning_rate": 0.05},
    "adam": {"model.optimizer": "adam", "model.learning_rate": 0.002},
    "adamw": {"model.optimizer": "adamw", "model.learning_rate": 0.002, "model.weight_decay": 0.01},
    "lars": {"model.optimizer": "lars", "model.learning_rate": 0.5, "model.lars_eta": 0.02},
}
_BUILT: dict[str, tuple[object, tuple]] = {}  # one compiled model per optimiser, and its start


def model_with(optimizer: str):
    """The model with ``optimizer``, back at its start values (parameters, state, dropout's
    random state): built once, as building costs a second and training a tenth of that."""
    if optimizer not in _BUILT:  # the digits CNN of configs/digits.yaml, sub-batches of B
        over = {"model.batch_size": B, "model.weight_decay": 5e-4, **OPTIMIZERS[optimizer]}
        model = create_model(load_config(None, "digits", over).model).build(B)
        start = tuple(
            [np.array(a) for a in get_values(vs)] for vs in (model.params, model.opt_state)
        )
        _BUILT[optimizer] = model, (*start, get_rng_states(model))
    model, (params, opt_state, rngs) = _BUILT[optimizer]
    set_values(model.params, [np.array(a) for a in params])
    set_values(model.opt_state, [np.array(a) for a in opt_state])
    set_rng_states(model, rngs)
    return model


def steps(model, rule: BSP, first: int, count: int, k: int) -> None:
    comm = MPI.COMM_WORLD
    size = model.config["input_size"]
    for step in range(first, first + count):
        rng = np.random.default_rng(1000 * step + comm.Get_rank())  # this rank's batches
        for i in range(k):
            x = rng.random((B, 3, size, size), dtype=np.float32) * 255
            y = rng.integers(0, 10, B).astype(np.int32)
            rule.accumulate(model, x, y, i, k)
        rule.after_step(model, step)


def train(strategy: str, optimizer: str, shard: bool, k: int, state=None):
    """``STEPS`` steps (``MORE`` after taking ``state`` as a resume would: a checkpoint's
    parameters and whole optimiser state on every rank): the parameters and the whole state
    (as a checkpoint holds it), and the rule."""
    comm = MPI.COMM_WORLD
    model = model_with(optimizer)
    if state is not None:
        params, opt_state = state
        set_values(model.params, [np.array(a) for a in params])
        set_values(model.opt_state, [np.array(a) for a in opt_state])
    bcast_values(model.opt_state, comm)
    rule = BSP(strategy, "cdd", shard_optimizer=shard)
    rule.setup(model, comm)
    steps(model, rule, 1 if state is None else STEPS + 1, STEPS if state is None else MORE, k)
    emptied = [
        v.get_value(borrow=True).size == 0 for i in range(3) for v in model.optimizer.slots(i)
    ]
    assert all(emptied) == shard, "the whole state variables are emptied while sharded, only then"
    with rule.whole_state(model):  # as Checkpoints.save_* reads it: on rank 0
        whole = comm.bcast([np.array(a) for a in get_values(model.opt_state)], root=0)
    rule.finish(model)
    return [np.array(a) for a in get_values(model.params)], whole, rule


#: unsharded ``ar`` at N > 2 sums the ranks' gradients in MPI's order, the reduce-scatter in
#: rank order: a float32 rounding in the first step, grown by a chaotic run to 2e-4 of a few
#: values over 20 steps (measured); a chunk misplaced by the padding would be off by O(1)
RTOL, FLOOR = 1e-3, 1e-4


def same(got: list[np.ndarray], want: list[np.ndarray], what: str, exact: bool = True) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if exact:
            np.testing.assert_array_equal(a, b, err_msg=f"{what} {i}")
        else:
            atol = FLOOR * float(np.abs(b).max()) if b.size else 0.0
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=atol, err_msg=f"{what} {i}")


def check(strategy: str, optimizer: str, k: str = "1") -> None:
    comm = MPI.COMM_WORLD
    start = get_values(model_with(optimizer).params)
    start = [np.array(a) for a in start]
    want, plain_state, _ = train(strategy, optimizer, False, int(k))
    got, state, rule = train(strategy, optimizer, True, int(k))
    assert rule.sharded is not None and "sharded 1/" in rule.describe()
    assert any(not np.array_equal(p, q) for p, q in zip(want, start, strict=True)), "trained"
    exact = strategy != "ar" or comm.Get_size() <= 2  # a + b = b + a
    same(got, want, "parameter", exact)
    everyone = comm.allgather([v.tobytes() for v in got])
    assert all(e == everyone[0] for e in everyone), "ranks hold different parameters"
    same(state, plain_state, "gathered state", exact)
    if optimizer in ("sgd", "adam"):  # one state slot and two: the rest lays them out alike
        # a resume from the sharded run's checkpoint, unsharded and sharded, goes on as the
        # unsharded run does (on any N: the whole state is laid out as an unsharded run's)
        ref, _, _ = train(strategy, optimizer, False, int(k), state=(want, plain_state))
        for shard in (False, True):
            again, _, _ = train(strategy, optimizer, shard, int(k), state=(got, state))
            same(again, ref, f"resumed (shard={shard})", exact)
    if comm.Get_rank() == 0:
        print("OK", strategy, optimizer, k, flush=True)


if __name__ == "__main__":
    for spec in sys.argv[1:]:
        check(*spec.split(":"))
