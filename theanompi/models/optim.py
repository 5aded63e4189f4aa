"""Optimisers (registry :data:`OPTIMIZERS`) and learning-rate policies (:data:`LR_POLICIES`).

``model.optimizer`` names one of ``sgd``, ``adam``, ``adamw``, ``lars`` (or gives
``package.module:Class``); ``model.lr_policy`` one of ``step``, ``fixed``, ``cosine``, ``poly``.
Every optimiser reads the parameter tags (:func:`param_tags`: weight decay where
``regularizable``, learning rate ``lr * lr_mult``) and keeps its state in shared variables
(:attr:`Optimizer.state`: checkpointed, never exchanged). Importing this module does not
import PyTensor (the config loader reads the registries); an optimiser imports it when built.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from theanompi.registry import Registry

__all__ = [
    "OPTIMIZERS",
    "Optimizer",
    "SGD",
    "LARS",
    "Adam",
    "AdamW",
    "create_optimizer",
    "param_tags",
    "LR_POLICIES",
    "LRPolicy",
    "StepLR",
    "FixedLR",
    "CosineLR",
    "PolyLR",
    "lr_policy",
    "step_lr",
]


def _pytensor() -> Any:
    from theanompi.pytensor_env import configure

    configure()  # a no-op once the params exist: whoever made them configured PyTensor
    import pytensor

    return pytensor


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


# -- optimisers ------------------------------------------------------------------------------
class Optimizer:
    """Base of the optimisers: parameters, a shared scalar ``lr`` and the state to checkpoint.

    A subclass sets :attr:`state` (shared variables with unique names, saved in checkpoints
    as ``model.opt_state`` and restored exactly; never exchanged between ranks) and
    implements :meth:`updates`. :meth:`from_config` builds it from a model config section,
    so a new optimiser is one class registered in :data:`OPTIMIZERS` (or named by reference).

    Parameters
    ----------
    params : list of SharedVariable
        Trainable parameters (tags: :func:`param_tags`).
    lr : SharedVariable
        Scalar learning rate (set by the lr policy between steps).
    weight_decay : float
        ``wd`` >= 0, applied to regularizable parameters only.
    """

    name = "optimizer"

    def __init__(self, params: Sequence[Any], lr: Any, weight_decay: float = 0.0) -> None:
        if weight_decay < 0:
            raise ValueError(f"weight_decay={weight_decay!r} must be >= 0, e.g. 0.0005")
        self.params = list(params)
        for p in self.params:
            mult = param_tags(p)[1]
            if not np.isfinite(mult) or mult < 0:
                raise ValueError(f"{p.name}: tag.lr_mult={mult!r} must be >= 0, e.g. 2.0")
        self.lr = lr
        self.weight_decay = float(weight_decay)
        self.state: list[Any] = []

    @classmethod
    def from_config(cls, params: Sequence[Any], lr: Any, section: Mapping[str, Any]) -> Optimizer:
        """The optimiser of a model config section (each class takes the keys it uses)."""
        return cls(params, lr, weight_decay=float(section["weight_decay"]))

    def updates(self, grads: Sequence[Any]) -> list[tuple[Any, Any]]:
        """``(shared, new_value)`` pairs for one step given symbolic ``grads``."""
        raise NotImplementedError

    def _make_state(self) -> None:
        """Create :attr:`state` for :attr:`params` (zeros)."""

    def slots(self, i: int) -> list[Any]:
        """The state variables shaped like parameter ``i`` (:attr:`state` less the scalars)."""
        return []

    def over(self, params: Sequence[Any]) -> Optimizer:
        """This optimiser (its class, settings and ``lr``) over other ``params`` (tagged as the
        ones they stand for), with zero state: the same compiled arithmetic on other arrays,
        as ZeRO-1's shard of the parameters (:mod:`theanompi.rules.sharded`) needs."""
        new = copy.copy(self)
        new.params = list(params)
        new._make_state()
        return new

    def _slot(self, p: Any, suffix: str) -> Any:
        """A zero state variable shaped like ``p``, named ``<p.name>.<suffix>``."""
        return _pytensor().shared(_zeros_like(p), name=f"{p.name}.{suffix}", borrow=True)

    def _check(self, grads: Sequence[Any]) -> tuple[str, Any]:
        """floatX and the lr in it, after checking one gradient per parameter."""
        if len(grads) != len(self.params):
            raise ValueError(f"got {len(grads)} gradients for {len(self.params)} parameters")
        fx = _pytensor().config.floatX
        return fx, self.lr.astype(fx) if hasattr(self.lr, "astype") else self.lr


class SGD(Optimizer):
    """Stochastic gradient descent with (Nesterov) momentum and L2 weight decay.

    Velocity ``v <- mu*v - lr*m*(g + d*wd*w)``; plain momentum sets ``w <- w + v``, Nesterov
    ``w <- w + mu*v - lr*m*(g + d*wd*w)`` (``torch.optim.SGD`` with ``dampening=0``, whose
    buffer is ``-v / (lr*m)`` at a constant lr). Per parameter, ``m`` and ``d`` come from the
    tags that :meth:`~theanompi.models.layers.Layer._param` sets (as Lasagne's
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
        Scalar learning rate (changed by the lr policy between steps).
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

    name = "sgd"

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
        if nesterov and momentum == 0:
            raise ValueError("nesterov=True needs momentum > 0, e.g. momentum=0.9")
        super().__init__(params, lr, weight_decay)
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self._make_state()

    def _make_state(self) -> None:
        self.state = [self._slot(p, "v") for p in self.params]

    def slots(self, i: int) -> list[Any]:
        return [self.state[i]]

    @classmethod
    def from_config(cls, params: Sequence[Any], lr: Any, section: Mapping[str, Any]) -> Optimizer:
        return cls(
            params,
            lr,
            momentum=float(section["momentum"]),
            nesterov=bool(section["nesterov"]),
            weight_decay=float(section["weight_decay"]),
        )

    def _direction(self, p: Any, g: Any, regularizable: bool, fx: str) -> Any:
        """The step direction of one parameter before ``lr * lr_mult``: ``g + wd*w``."""
        if self.weight_decay and regularizable:
            g = g + np.asarray(self.weight_decay, fx) * p
        return g

    def updates(self, grads: Sequence[Any]) -> list[tuple[Any, Any]]:
        fx, lr = self._check(grads)
        mu = np.asarray(self.momentum, fx)
        out: list[tuple[Any, Any]] = []
        for p, v, g in zip(self.params, self.state, grads, strict=True):
            regularizable, lr_mult = param_tags(p)
            g = self._direction(p, g.astype(fx), regularizable, fx)
            step = -(lr * np.asarray(lr_mult, fx) if lr_mult != 1.0 else lr) * g
            if self.momentum:
                v_new = mu * v + step
                out.append((v, v_new))
                out.append((p, p + (mu * v_new + step if self.nesterov else v_new)))
            else:
                out.append((p, p + step))
        return out


def _norm(x: Any, fx: str) -> Any:
    """``||x||``: the float32 squares summed in float64, then rounded once. A ZeRO-1 shard
    (:mod:`theanompi.rules.sharded`) adds up pieces' sums the same way and gets the same
    float32 norm (but for a float64 rounding at a float32 boundary), where a float32 sum in
    another order would differ in its last bits and LARS's ratio with it."""
    import pytensor.tensor as pt

    return pt.sqrt(pt.sum(pt.sqr(x), acc_dtype="float64", dtype="float64")).astype(fx)


class LARS(SGD):
    """Layer-wise adaptive rate scaling (You, Gitman & Ginsburg 2017, arXiv:1708.03888,
    Algorithm 1) on :class:`SGD` with momentum: NVIDIA apex's ``LARC(clip=False)`` around
    ``torch.optim.SGD``.

    Per regularizable parameter ``w`` (one tensor: a layer's weights) with gradient ``g``,
    trust ratio ``r = eta * ||w|| / (||g|| + wd * ||w|| + eps)`` when ``||w|| > 0`` and
    ``||g|| > 0``, and the step direction ``d = r * (g + wd*w)``; otherwise (a zero norm)
    ``d = g``, as apex. Then SGD's momentum on ``d``: ``v <- mu*v - lr*m*d``, ``w <- w + v``
    (Nesterov: ``w <- w + mu*v - lr*m*d``). Non-regularizable parameters (biases, batch-norm
    scales) are excluded from the adaptation and the decay, as usual: ``d = g``. ``state``
    is SGD's velocity ``<param>.v``.

    Parameters
    ----------
    eta : float
        The trust coefficient (``model.lars_eta``, default 0.001 as in the paper).
    eps : float
        Added to the ratio's denominator (``model.eps``, default 1e-8 as apex).
    """

    name = "lars"

    def __init__(
        self,
        params: Sequence[Any],
        lr: Any,
        momentum: float = 0.9,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        eta: float = 0.001,
        eps: float = 1e-8,
    ) -> None:
        if not eta > 0 or not eps >= 0:
            raise ValueError(f"LARS needs eta > 0 and eps >= 0, got eta={eta!r}, eps={eps!r}")
        super().__init__(params, lr, momentum, nesterov, weight_decay)
        self.eta, self.eps = float(eta), float(eps)
        #: parameter -> symbolic ``(||w||, ||g||)`` to use instead of its own: a ZeRO-1 piece
        #: of a parameter (:meth:`over`) needs the norms of the whole one
        self.norms: dict[Any, tuple[Any, Any]] = {}

    def over(self, params: Sequence[Any]) -> Optimizer:
        new = super().over(params)
        new.norms = {}  # type: ignore[attr-defined]
        return new

    @classmethod
    def from_config(cls, params: Sequence[Any], lr: Any, section: Mapping[str, Any]) -> Optimizer:
        return cls(
            params,
            lr,
            momentum=float(section["momentum"]),
            nesterov=bool(section["nesterov"]),
            weight_decay=float(section["weight_decay"]),
            eta=float(section["lars_eta"]),
            eps=float(section["eps"]),
        )

    def _direction(self, p: Any, g: Any, regularizable: bool, fx: str) -> Any:
        if not regularizable:
            return g
        import pytensor.tensor as pt

        wd = np.asarray(self.weight_decay, fx)
        if p in self.norms:  # a shard's piece: its whole parameter's norms, given
            w_norm, g_norm = self.norms[p]
        else:
            w_norm, g_norm = _norm(p, fx), _norm(g, fx)
        ratio = (
            np.asarray(self.eta, fx) * w_norm / (g_norm + wd * w_norm + np.asarray(self.eps, fx))
        )
        adapt = pt.and_(pt.gt(w_norm, 0), pt.gt(g_norm, 0))
        return pt.switch(adapt, ratio * (g + wd * p if self.weight_decay else g), g)


class Adam(Optimizer):
    """Adam (Kingma & Ba 2015) as ``torch.optim.Adam``, with L2 weight decay added to the gradient.

    Per parameter, at step ``t = 1, 2, ...`` with ``lr_p = lr * lr_mult``::

        g <- g + wd*w                      (regularizable only; AdamW: see below)
        m <- b1*m + (1 - b1)*g;   s <- b2*s + (1 - b2)*g*g
        w <- w - lr_p / (1 - b1**t) * m / (sqrt(s) / sqrt(1 - b2**t) + eps)

    The bias corrections are computed in float64 (as torch does in Python). ``state``: the
    step count ``<name>.step`` (a float32 scalar, exact up to 2**24 steps), then per parameter
    ``<param>.exp_avg`` (``m``) and ``<param>.exp_avg_sq`` (``s``).

    >>> import numpy as np, pytensor
    >>> w = pytensor.shared(np.ones(2, "float32"), name="w")
    >>> [s.name for s in Adam([w], pytensor.shared(np.float32(0.1))).state]
    ['adam.step', 'w.exp_avg', 'w.exp_avg_sq']
    """

    name = "adam"
    #: weight decay decoupled from the gradient (AdamW) instead of L2 added to it
    decoupled = False

    def __init__(
        self,
        params: Sequence[Any],
        lr: Any,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        for label, b in (("beta1", beta1), ("beta2", beta2)):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"{label}={b!r} must be in [0, 1), e.g. 0.9 / 0.999")
        if not eps > 0:
            raise ValueError(f"eps={eps!r} must be > 0, e.g. 1e-8")
        super().__init__(params, lr, weight_decay)
        self.beta1, self.beta2, self.eps = float(beta1), float(beta2), float(eps)
        self._make_state()

    def _make_state(self) -> None:
        pytensor = _pytensor()
        self.t = pytensor.shared(np.zeros((), pytensor.config.floatX), name=f"{self.name}.step")
        self.moments = [
            (self._slot(p, "exp_avg"), self._slot(p, "exp_avg_sq")) for p in self.params
        ]
        self.state = [self.t, *(s for pair in self.moments for s in pair)]

    def slots(self, i: int) -> list[Any]:
        return list(self.moments[i])

    @classmethod
    def from_config(cls, params: Sequence[Any], lr: Any, section: Mapping[str, Any]) -> Optimizer:
        if section.get("nesterov"):
            from theanompi.errors import ConfigError

            raise ConfigError(
                f"model.nesterov applies to sgd and lars, not {cls.name}; set nesterov: false"
            )
        return cls(
            params,
            lr,
            beta1=float(section["beta1"]),
            beta2=float(section["beta2"]),
            eps=float(section["eps"]),
            weight_decay=float(section["weight_decay"]),
        )

    def updates(self, grads: Sequence[Any]) -> list[tuple[Any, Any]]:
        import pytensor.tensor as pt

        fx, lr = self._check(grads)
        b1, b2, eps, wd = (
            np.asarray(v, fx) for v in (self.beta1, self.beta2, self.eps, self.weight_decay)
        )
        one = np.asarray(1, fx)
        t_new = self.t + one
        t64 = t_new.astype("float64")
        bc1 = np.float64(1.0) - np.float64(self.beta1) ** t64
        sqrt_bc2 = pt.sqrt(np.float64(1.0) - np.float64(self.beta2) ** t64).astype(fx)
        out: list[tuple[Any, Any]] = [(self.t, t_new)]
        for p, (m, s), g in zip(self.params, self.moments, grads, strict=True):
            regularizable, lr_mult = param_tags(p)
            lr_p = lr * np.asarray(lr_mult, fx) if lr_mult != 1.0 else lr
            g = g.astype(fx)
            decay = bool(self.weight_decay and regularizable)
            if decay and not self.decoupled:
                g = g + wd * p
            m_new = b1 * m + (one - b1) * g
            s_new = b2 * s + (one - b2) * pt.sqr(g)
            step_size = (pt.cast(lr_p, "float64") / bc1).astype(fx)
            w = p * (one - lr_p * wd) if decay and self.decoupled else p
            out += [(m, m_new), (s, s_new)]
            out.append((p, w - step_size * m_new / (pt.sqrt(s_new) / sqrt_bc2 + eps)))
        return out


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter 2019) as ``torch.optim.AdamW``:
    ``w <- w * (1 - lr*lr_mult*wd)`` (regularizable only) before :class:`Adam`'s step, whose
    gradient then carries no L2 term. ``state`` as Adam's, the count named ``adamw.step``."""

    name = "adamw"
    decoupled = True


#: ``model.optimizer``: each class built as ``Cls.from_config(params, lr, model_section)``
OPTIMIZERS: Registry[type[Optimizer]] = Registry(
    "optimizer", {"sgd": SGD, "adam": Adam, "adamw": AdamW, "lars": LARS}
)


def create_optimizer(params: Sequence[Any], lr: Any, section: Mapping[str, Any]) -> Optimizer:
    """The optimiser ``section["optimizer"]`` names (default ``sgd``), built from the section."""
    return OPTIMIZERS.get(section.get("optimizer", "sgd")).from_config(params, lr, section)


# -- learning-rate policies ------------------------------------------------------------------
class LRPolicy:
    """An lr policy: the factor on ``learning_rate`` per 0-based epoch (applied by
    ``Model.adjust_hyperparams``) times a factor per 0-based global step (applied by the
    Trainer's :class:`~theanompi.train.schedule.LRSchedule`, which knows the run's
    ``total_steps = n_epochs * steps_per_epoch``). Both are 1 unless a policy overrides them.

    Parameters
    ----------
    steps : sequence of int
        ``model.lr_step``: the epoch counts after which :class:`StepLR` multiplies by ``gamma``.
    gamma : float
        ``model.lr_gamma``.
    power : float
        ``model.lr_power`` (:class:`PolyLR`).
    """

    def __init__(self, steps: Sequence[int] = (), gamma: float = 0.1, power: float = 1.0) -> None:
        self.steps = [int(s) for s in steps]
        self.gamma = float(gamma)
        self.power = float(power)

    @classmethod
    def from_config(cls, section: Mapping[str, Any]) -> LRPolicy:
        return cls(section["lr_step"], section["lr_gamma"], section.get("lr_power", 1.0))

    def epoch_factor(self, epoch: int) -> float:
        """Factor on the base lr for 0-based ``epoch``."""
        return 1.0

    def step_factor(self, step: int, total_steps: int) -> float:
        """Factor on the epoch's lr for 0-based global ``step`` of ``total_steps``."""
        return 1.0


class StepLR(LRPolicy):
    """``gamma ** #{s in lr_step: epoch >= s}`` per epoch (Caffe's ``multistep``; per step
    ``torch.optim.lr_scheduler.MultiStepLR(milestones=[s * steps_per_epoch])``)."""

    def epoch_factor(self, epoch: int) -> float:
        return self.gamma ** sum(1 for s in self.steps if epoch >= s)


class FixedLR(LRPolicy):
    """The base lr throughout."""


def _progress(step: int, total_steps: int) -> float:
    if total_steps < 1:
        raise ValueError(f"a per-step lr policy needs total_steps >= 1, got {total_steps!r}")
    return min(max(step, 0), total_steps) / total_steps


class CosineLR(LRPolicy):
    """``(1 + cos(pi * t / T)) / 2`` at global step ``t`` of ``T`` (per step): as
    ``torch.optim.lr_scheduler.CosineAnnealingLR(T_max=T, eta_min=0)`` stepped once per step."""

    def step_factor(self, step: int, total_steps: int) -> float:
        return 0.5 * (1.0 + math.cos(math.pi * _progress(step, total_steps)))


class PolyLR(LRPolicy):
    """``(1 - t / T) ** lr_power`` at global step ``t`` of ``T`` (per step): as
    ``torch.optim.lr_scheduler.PolynomialLR(total_iters=T, power=lr_power)`` stepped once per
    step (``lr_power`` defaults to 1.0, torch's default: linear decay; 0.9 is DeepLab's)."""

    def step_factor(self, step: int, total_steps: int) -> float:
        return (1.0 - _progress(step, total_steps)) ** self.power


#: ``model.lr_policy``: each class built as ``Cls.from_config(model_section)``
LR_POLICIES: Registry[type[LRPolicy]] = Registry(
    "lr policy", {"step": StepLR, "fixed": FixedLR, "cosine": CosineLR, "poly": PolyLR}
)


def lr_policy(section: Mapping[str, Any]) -> LRPolicy:
    """The policy ``section["lr_policy"]`` names, built from the section's keys."""
    return LR_POLICIES.get(section.get("lr_policy", "step")).from_config(section)


def step_lr(
    base_lr: float, epoch: int, steps: Sequence[int], gamma: float, policy: str = "step"
) -> float:
    """The epoch lr for 0-based ``epoch``: ``base_lr * gamma ** #{s in steps: epoch >= s}``
    for ``step``; ``base_lr`` for ``fixed`` and for the per-step policies (``cosine``,
    ``poly``: :class:`~theanompi.train.schedule.LRSchedule` applies their factor per step).

    >>> step_lr(0.01, 19, [20, 40], 0.1), round(step_lr(0.01, 20, [20, 40], 0.1), 6)
    (0.01, 0.001)
    """
    return float(base_lr) * LR_POLICIES.get(policy)(steps, gamma).epoch_factor(int(epoch))
