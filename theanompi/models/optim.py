"""SGD with momentum / Nesterov momentum, L2 weight decay and the step learning-rate policy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from theanompi.pytensor_env import configure

configure()

import pytensor  # noqa: E402

__all__ = ["SGD", "param_tags", "step_lr"]


def _zeros_like(p: Any) -> np.ndarray:
    v = p.get_value(borrow=True)
    return np.zeros(v.shape, dtype=v.dtype)  # calloc: pages are touched only when written


def param_tags(p: Any) -> tuple[bool, float]:
    """``(regularizable, lr_mult)`` of a parameter: its tags (set by ``Layer._param``), or
    for an untagged one the old rule ``(p.ndim > 1, 1.0)``.

    >>> import numpy as np, pytensor
    >>> b = pytensor.shared(np.zeros(3, "float32"), name="b")
    >>> param_tags(b)
    (False, 1.0)
    >>> b.tag.regularizable, b.tag.lr_mult = True, 2.0
    >>> param_tags(b)
    (True, 2.0)
    """
    regularizable = getattr(p.tag, "regularizable", None)
    lr_mult = getattr(p.tag, "lr_mult", 1.0)
    return bool(p.ndim > 1 if regularizable is None else regularizable), float(lr_mult)


def step_lr(
    base_lr: float, epoch: int, steps: Sequence[int], gamma: float, policy: str = "step"
) -> float:
    """Learning rate for 0-based ``epoch``: ``base_lr * gamma ** #{s in steps: epoch >= s}``.

    ``steps`` are the epoch counts after which the rate is multiplied by ``gamma``
    (``policy="fixed"`` ignores them).

    >>> step_lr(0.01, 19, [20, 40], 0.1), round(step_lr(0.01, 20, [20, 40], 0.1), 6)
    (0.01, 0.001)
    """
    if policy == "fixed":
        return float(base_lr)
    if policy != "step":
        raise ValueError(f"lr_policy={policy!r} is unknown; choose 'step' or 'fixed'")
    return float(base_lr) * float(gamma) ** sum(1 for s in steps if epoch >= s)


class SGD:
    """Stochastic gradient descent with (Nesterov) momentum and L2 weight decay.

    Velocity ``v <- mu*v - lr*m*(g + d*wd*w)``; plain momentum sets ``w <- w + v``, Nesterov
    ``w <- w + mu*v - lr*m*(g + d*wd*w)``. Per parameter, ``m`` and ``d`` come from the tags
    that :meth:`~theanompi.models.layers.Layer._param` sets (as Lasagne's
    ``add_param(..., regularizable=...)``): ``m = p.tag.lr_mult`` (learning-rate
    multiplier, e.g. 2 for Caffe/Theano-MPI biases) and ``d = p.tag.regularizable`` (weight
    decay or not). A parameter without tags (a hand-made graph) keeps the old rule: decay
    iff ``ndim > 1`` (weights, not biases or batch-norm scales), ``m = 1``; see
    :func:`param_tags`. ``state`` holds one velocity per parameter (named ``<param>.v``),
    which is what a checkpoint must keep.

    Parameters
    ----------
    params : list of SharedVariable
        Trainable parameters.
    lr : SharedVariable
        Scalar learning rate (changed by the lr policy between epochs).
    momentum, weight_decay : float
        ``mu`` in [0, 1) and ``wd`` >= 0.
    nesterov : bool
        Nesterov's accelerated gradient instead of heavy-ball momentum.

    Examples
    --------
    >>> import numpy as np, pytensor
    >>> w = pytensor.shared(np.ones((2, 2), "float32"), name="w")
    >>> opt = SGD([w], pytensor.shared(np.float32(0.1)), momentum=0.9)
    >>> [s.name for s in opt.state], len(opt.updates([w * 0 + 1]))
    (['w.v'], 2)
    """

    def __init__(
        self,
        params: Sequence[Any],
        lr: Any,
        momentum: float = 0.9,
        nesterov: bool = False,
        weight_decay: float = 0.0,
    ) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum={momentum!r} must be in [0, 1), e.g. 0.9")
        if weight_decay < 0:
            raise ValueError(f"weight_decay={weight_decay!r} must be >= 0, e.g. 0.0005")
        if nesterov and momentum == 0:
            raise ValueError("nesterov=True needs momentum > 0, e.g. momentum=0.9")
        self.params = list(params)
        for p in self.params:
            mult = param_tags(p)[1]
            if not np.isfinite(mult) or mult < 0:
                raise ValueError(f"{p.name}: tag.lr_mult={mult!r} must be >= 0, e.g. 2.0")
        self.lr = lr
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self.weight_decay = float(weight_decay)
        self.state = [
            pytensor.shared(_zeros_like(p), name=f"{p.name}.v", borrow=True) for p in self.params
        ]

    def updates(self, grads: Sequence[Any]) -> list[tuple[Any, Any]]:
        """``(shared, new_value)`` pairs for one step given symbolic ``grads``."""
        if len(grads) != len(self.params):
            raise ValueError(f"got {len(grads)} gradients for {len(self.params)} parameters")
        fx = pytensor.config.floatX
        mu, wd = np.asarray(self.momentum, fx), np.asarray(self.weight_decay, fx)
        lr = self.lr.astype(fx) if hasattr(self.lr, "astype") else self.lr
        out: list[tuple[Any, Any]] = []
        for p, v, g in zip(self.params, self.state, grads, strict=True):
            g = g.astype(fx)
            regularizable, lr_mult = param_tags(p)
            if self.weight_decay and regularizable:
                g = g + wd * p
            step = -(lr * np.asarray(lr_mult, fx) if lr_mult != 1.0 else lr) * g
            if self.momentum:
                v_new = mu * v + step
                out.append((v, v_new))
                out.append((p, p + (mu * v_new + step if self.nesterov else v_new)))
            else:
                out.append((p, p + step))
        return out
