"""Run under ``mpirun -n N``: the pieces of a loop of your own, every rank checking its own values.

``python mpi_distributed.py OUT.npz``: ``DistributedOptimizer`` against a float64 numpy
reference of averaged-gradient SGD (per strategy), ``broadcast_parameters``, ``allreduce``;
rank 0 prints ``all checks passed`` and writes each rank's final parameters to OUT.npz.
"""

from __future__ import annotations

import sys

import numpy as np
import pytensor
import pytensor.tensor as pt

import theanompi as tm
from theanompi.errors import ConfigError

D, K, B, STEPS, LR = 6, 3, 8, 5, 0.1


def batch(rank: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s batch at ``step``: any rank can draw any rank's."""
    rng = np.random.default_rng([rank, step])
    x = rng.standard_normal((B, D)).astype("float32")
    return x, rng.standard_normal((B, K)).astype("float32")


def start_values() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(123)
    return rng.standard_normal((D, K)).astype("float32"), rng.standard_normal(K).astype("float32")


def reference(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Averaged-gradient SGD in float64 on ``loss = mean((xW + b - y)**2)``."""
    w, b = (v.astype(np.float64) for v in start_values())
    for step in range(STEPS):
        gw, gb = np.zeros_like(w), np.zeros_like(b)
        for r in range(size):
            x, y = (v.astype(np.float64) for v in batch(r, step))
            resid = x @ w + b - y
            gw += 2 * x.T @ resid / resid.size
            gb += 2 * resid.sum(axis=0) / resid.size
        w, b = w - LR * gw / size, b - LR * gb / size
    return w, b


def train(strategy: str, compression: str = "none") -> list[np.ndarray]:
    me = tm.rank()
    w0, b0 = start_values()
    noise = np.float32(me)  # each rank starts elsewhere: the broadcast must fix it
    W = pytensor.shared(w0 + noise, name="W")
    b = pytensor.shared(b0 - noise, name="b")
    tm.broadcast_parameters([W, b])
    x, y = pt.matrix("x"), pt.matrix("y")
    loss = pt.mean(pt.sqr(pt.dot(x, W) + b - y))
    opt = tm.DistributedOptimizer(
        tm.SGD([W, b], LR, momentum=0.0),
        loss,
        [x, y],
        outputs=[loss * 2],
        strategy=strategy,
        compression=compression,
    )
    for step in range(STEPS):
        value, twice = opt.step(*batch(me, step))
        assert isinstance(value, float) and np.isclose(twice, 2 * value), (value, twice)
    assert opt.steps == STEPS and opt.lr == LR  # the wrapped optimiser's attributes
    return [W.get_value(), b.get_value()]


def check_optimizer(comm, strategy: str, compression: str, tol: float) -> None:
    got = train(strategy, compression)
    assert all(v.dtype == np.float32 for v in got)
    ref = reference(comm.Get_size())
    for g, r in zip(got, ref, strict=True):
        np.testing.assert_allclose(g, r, rtol=tol, atol=tol)
    everyone = comm.allgather([v.tobytes() for v in got])
    assert all(e == everyone[0] for e in everyone), f"{strategy}: ranks differ"
    if comm.Get_rank() == 0:
        print(f"  {strategy}+{compression}: equal on every rank, within {tol:g} of float64")


def adam_loop(shard: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``STEPS`` steps of ``tm.Adam`` with weight decay; the parameters and the whole state
    (rank 0's, as a checkpoint reads it inside ``whole_state``)."""
    w0, b0 = start_values()
    W, b = pytensor.shared(w0, name="W"), pytensor.shared(b0, name="b")
    x, y = pt.matrix("x"), pt.matrix("y")
    loss = pt.mean(pt.sqr(pt.dot(x, W) + b - y))
    adam = tm.Adam([W, b], pytensor.shared(np.float32(0.01)), weight_decay=0.01)
    opt = tm.DistributedOptimizer(adam, loss, [x, y], strategy="ar", shard=shard)
    for step in range(STEPS):
        opt.step(*batch(tm.rank(), step))
    with opt.whole_state():
        state = [np.array(v.get_value()) for v in adam.state]
    return [W.get_value(), b.get_value()], state


def check_sharded(comm) -> None:
    """``shard=True``: each rank's 1/N of Adam's state and update, the same parameters."""
    (plain, plain_state), (got, state) = adam_loop(False), adam_loop(True)
    pairs = list(zip(got, plain, strict=True))
    if comm.Get_rank() == 0:  # the whole state is gathered there
        pairs += list(zip(state, plain_state, strict=True))
    for g, r in pairs:
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6 * float(np.abs(r).max()))
    everyone = comm.allgather([v.tobytes() for v in got])
    assert all(e == everyone[0] for e in everyone), "sharded: ranks differ"
    if comm.Get_rank() == 0:
        print("  ar+shard: the unsharded parameters and state, equal on every rank")


def check_broadcast(comm) -> None:
    me = comm.Get_rank()
    a = pytensor.shared(np.full(4, me, "float32"), name="a")
    c = pytensor.shared(np.full((2, 2), 10 + me, "float32"), name="c")
    tm.broadcast_parameters({"a": a, "c": c})
    assert (a.get_value() == 0).all() and (c.get_value() == 10).all()
    root = comm.Get_size() - 1
    a.set_value(np.full(4, me, "float32"))
    tm.broadcast_parameters([a], root=root)
    assert (a.get_value() == root).all()
    if comm.Get_size() == 1:
        return
    extra = [pytensor.shared(np.zeros(3, "float32"), name="extra")] if me == 1 else []
    try:
        tm.broadcast_parameters([a, *extra])
    except ConfigError as err:
        assert "rank 1 holds param #1 'extra'" in str(err), err
    else:
        raise AssertionError("a different parameter list was accepted")


def check_allreduce(comm) -> None:
    me, n = comm.Get_rank(), comm.Get_size()
    assert tm.allreduce(float(me)) == (n - 1) / 2
    assert tm.allreduce(me, op="sum") == n * (n - 1) // 2
    assert isinstance(tm.allreduce(me, op="sum"), int)
    assert tm.allreduce(me, op="max") == n - 1 and tm.allreduce(me, op="min") == 0
    got = tm.allreduce(np.float32(me))
    assert isinstance(got, np.float32) and got == np.float32((n - 1) / 2)
    arr = tm.allreduce(np.arange(3) + me, op="sum")
    assert arr.dtype == np.arange(3).dtype and list(arr) == [
        n * i + n * (n - 1) // 2 for i in range(3)
    ]
    mean = tm.allreduce(np.array([me, 2 * me]))
    assert mean.dtype == np.float64 and np.allclose(mean, [(n - 1) / 2, n - 1])
    assert tm.allreduce(np.array([me == 0, True]), op="sum").tolist() == [1, n]
    try:
        tm.allreduce(1.0, op="avg")
    except ValueError as err:
        assert "'mean', 'sum', 'max', 'min'" in str(err)
    else:
        raise AssertionError("allreduce accepted op='avg'")
    try:
        tm.allreduce("text")
    except TypeError:
        pass
    else:
        raise AssertionError("allreduce accepted a string")


def main() -> None:
    tm.init()
    tm.init()  # idempotent
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    assert (tm.rank(), tm.size()) == (comm.Get_rank(), comm.Get_size())
    assert 0 <= tm.local_rank() < tm.local_size() <= tm.size()
    check_broadcast(comm)
    check_allreduce(comm)
    check_optimizer(comm, "ar", "none", 1e-5)
    check_sharded(comm)
    if comm.Get_size() & (comm.Get_size() - 1) == 0:
        check_optimizer(comm, "copper", "none", 1e-5)
        check_optimizer(comm, "asa32", "fp16", 3e-3)
    final = train("ar")
    everyone = comm.gather(final)
    if comm.Get_rank() == 0:
        np.savez(
            sys.argv[1],
            **{f"r{r}_{i}": v for r, vs in enumerate(everyone) for i, v in enumerate(vs)},
        )
        print("all checks passed", flush=True)


if __name__ == "__main__":
    main()
