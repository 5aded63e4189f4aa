"""``DistributedOptimizer``: an optimiser whose step averages the gradients over the ranks first
(Horovod's ``DistributedOptimizer``, for PyTensor's compiled functions)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["DistributedOptimizer", "STALL_TIMEOUT_ENV"]

#: seconds a rank may wait in the exchange before the job ends naming the late rank(s)
#: (default :data:`~theanompi.launch.watchdog.DEFAULT_STALL_TIMEOUT`; 0: no watchdog)
STALL_TIMEOUT_ENV = "THEANOMPI_STALL_TIMEOUT"


def _default_stall_timeout() -> float:
    from theanompi.launch.watchdog import DEFAULT_STALL_TIMEOUT

    text = os.environ.get(STALL_TIMEOUT_ENV, "")
    try:
        return float(text) if text else DEFAULT_STALL_TIMEOUT
    except ValueError:
        from theanompi.errors import ConfigError

        raise ConfigError(f"${STALL_TIMEOUT_ENV}={text!r} is not a number of seconds") from None


class DistributedOptimizer:
    """Wrap an optimiser so that each step exchanges the gradients before it updates.

    The constructor compiles two functions: one that computes the loss (and ``outputs``)
    and writes the gradients of ``loss`` into float32 buffers (shared variables, one per
    parameter), and one that applies the wrapped optimiser's updates from those buffers.
    :meth:`step` runs the first, combines the buffers over the ranks in place with the
    exchanger ``strategy`` names (:func:`theanompi.exchange.create_exchanger`, prepared
    once), then runs the second. The loop stays one line::

        opt = tm.DistributedOptimizer(tm.SGD(params, lr=0.1), loss, [x, y])
        tm.broadcast_parameters(params)   # every rank starts from rank 0's values
        for xb, yb in batches:
            loss_value = opt.step(xb, yb)

    With ``op="mean"`` every rank applies the same averaged gradient, so replicas that
    start equal stay equal (the exchangers give bit-identical results on every rank).
    Other attributes (``lr``, ``state``, ...) are the wrapped optimiser's.

    Creating it is collective (a check that every rank holds the same parameter list, and
    the stall watchdog); so is :meth:`step`.

    Parameters
    ----------
    optimizer
        A :class:`theanompi.models.optim.Optimizer` (``tm.SGD``, ``tm.Adam``, ...; any
        object with ``updates(grads)`` and ``params``), or a function ``grads -> [(shared,
        new value), ...]`` given with ``params``.
    loss
        The symbolic scalar to minimise.
    inputs
        The symbolic inputs of ``loss`` (and ``outputs``): :meth:`step` takes their values
        in this order.
    params
        The shared variables to train (default: ``optimizer.params``); float32.
    outputs
        More symbolic values that :meth:`step` returns after the loss (an error rate, ...).
    updates
        More ``(shared, new value)`` pairs of the gradient function (batch-norm statistics).
    strategy, compression, op
        The exchange: a name of :data:`theanompi.exchange.STRATEGIES`, of
        :data:`~theanompi.exchange.compression.COMPRESSORS`, and ``"mean"`` or ``"sum"``.
    shard
        ZeRO-1 (:mod:`theanompi.rules.sharded`): each rank keeps the state of a built-in
        optimiser for 1/N of the parameters and updates only those, then the parameters are
        all-gathered (``op="mean"``, a strategy that reduces by chunks: ``ar``, ``asa*``).
        :meth:`whole_state` gathers the state on rank 0 for a checkpoint.
    comm
        Default: the world.
    stall_timeout
        Seconds a rank may wait in the exchange (after the first step) before the job ends
        with one line naming the late rank(s), as ``tmpi train``'s watchdog; 0: none.
        Default ``$THEANOMPI_STALL_TIMEOUT``, else 300.
    mode
        The ``pytensor.function`` mode (default: the C linker's, whose rewritten graphs are
        kept for the next process; the configured one where that is not ``cvm``).
    """

    def __init__(
        self,
        optimizer: Any,
        loss: Any,
        inputs: Sequence[Any],
        *,
        params: Sequence[Any] | None = None,
        outputs: Sequence[Any] = (),
        updates: Sequence[tuple[Any, Any]] = (),
        strategy: str = "ar",
        compression: str = "none",
        op: str = "mean",
        shard: bool = False,
        comm: Any = None,
        stall_timeout: float | None = None,
        mode: Any = None,
    ) -> None:
        from theanompi.distributed.world import _stall_watchdog, init

        init()
        import pytensor

        from theanompi.comm import world
        from theanompi.exchange import create_exchanger
        from theanompi.models.ops import c_mode
        from theanompi.models.params import check_same_layout, get_values

        mode = c_mode() if mode is None else mode
        self.optimizer = optimizer
        self.params = list(params if params is not None else optimizer.params)
        self._check_params()
        self.comm = world() if comm is None else comm
        self.grads = [
            pytensor.shared(np.zeros_like(p.get_value(borrow=True)), name=f"{p.name}.grad")
            for p in self.params
        ]
        self.n_outputs = len(outputs)
        grads = pytensor.grad(loss, self.params)
        self._grads_fn = pytensor.function(
            list(inputs),
            [loss, *outputs],
            updates=[*zip(self.grads, grads, strict=True), *updates],
            mode=mode,
            name="DistributedOptimizer.grads",
        )
        check_same_layout(self.params, self.comm, "param")
        self.sharded: Any = None
        if shard:
            self.sharded = self._sharded(strategy, compression, op)
        else:
            self._apply_fn = pytensor.function(
                [], [], updates=self._updates(), mode=mode, name="DistributedOptimizer.apply"
            )
            self.exchanger = create_exchanger(strategy, self.comm, op=op, compression=compression)
            self.exchanger.prepare(get_values(self.grads))
        timeout = _default_stall_timeout() if stall_timeout is None else float(stall_timeout)
        self.watchdog = _stall_watchdog(timeout) if self.comm.Get_size() > 1 else None
        self.steps = 0

    def _sharded(self, strategy: str, compression: str, op: str) -> Any:
        """The ZeRO-1 update of the wrapped optimiser over :attr:`params` and :attr:`grads`."""
        from theanompi.errors import ConfigError
        from theanompi.rules.sharded import ShardedUpdate

        if op != "mean":
            raise ConfigError(f"shard=True averages the gradients: op='mean', got op={op!r}")
        if self.params != list(getattr(self.optimizer, "params", [])):
            raise ConfigError("shard=True updates the optimizer's own params; leave params unset")
        return ShardedUpdate(self.optimizer, self.grads, self.comm, strategy, compression)

    def whole_state(self) -> Any:
        """Collective context: ``optimizer.state`` whole on rank 0 (a checkpoint's), when
        sharded; a no-op otherwise."""
        import contextlib

        return self.sharded.whole_state() if self.sharded is not None else contextlib.nullcontext()

    def _check_params(self) -> None:
        if not self.params:
            raise ValueError("DistributedOptimizer needs at least one parameter")
        for p in self.params:
            dtype = p.get_value(borrow=True).dtype
            if dtype != np.float32:
                from theanompi.errors import ConfigError

                raise ConfigError(
                    f"parameter {p.name!r} is {dtype}; the exchange takes float32: create it "
                    f"from a float32 array (np.asarray(value, 'float32'))"
                )

    def _updates(self) -> list[tuple[Any, Any]]:
        rule: Callable[[Sequence[Any]], Any] | None = getattr(self.optimizer, "updates", None)
        if rule is None:
            if not callable(self.optimizer):
                raise TypeError(
                    f"optimizer must have updates(grads) or be a function grads -> updates, "
                    f"got {type(self.optimizer).__name__}"
                )
            rule = self.optimizer
        return list(rule(self.grads))

    def __getattr__(self, name: str) -> Any:
        if name == "optimizer":  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def compute_grads(self, *values: Any) -> list[Any]:
        """The loss (and outputs) on this rank's batch; its gradients into :attr:`grads`."""
        return list(self._grads_fn(*values))

    def exchange(self) -> None:
        """Combine :attr:`grads` over the ranks, in place (collective); sharded, the whole
        step: this rank's chunk of the mean gradient, its update, the parameters' all-gather."""
        from theanompi.models.params import get_values, set_values

        if self.sharded is not None:
            if self.watchdog is not None:
                with self.watchdog.waiting("the sharded update"):
                    self.sharded.step()
            else:
                self.sharded.step()
            return

        arrays = get_values(self.grads)
        if self.watchdog is not None:
            with self.watchdog.waiting("the gradient exchange"):
                self.exchanger.exchange(arrays)
        else:
            self.exchanger.exchange(arrays)
        set_values(self.grads, arrays)

    def apply(self) -> None:
        """One update of the wrapped optimiser from the values in :attr:`grads` (sharded:
        done in :meth:`exchange`)."""
        if self.sharded is None:
            self._apply_fn()

    def step(self, *values: Any) -> Any:
        """One training step on this rank's batch (the values of ``inputs``, in order):
        gradients, exchange, update. Returns this rank's loss as a float, or ``(loss,
        *outputs)`` when ``outputs`` were given."""
        out = self.compute_grads(*values)
        self.exchange()
        self.apply()
        self.steps += 1
        if self.steps == 1 and self.watchdog is not None:
            self.watchdog.arm()  # compiled and exchanged once: from now on a wait is a stall
        loss = float(out[0])
        return loss if not self.n_outputs else (loss, *out[1:])
