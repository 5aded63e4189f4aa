"""The lr of each step: the model's lr policy, linear scaling and gradual warm-up.

Goyal et al. 2017 (arXiv:1706.02677): with ``k`` times the reference global batch, use ``k``
times the learning rate, and reach it by a linear ramp over the first epochs (Theano-MPI's
BSP ``lr_warmup``). The model's policy (``theanompi.models.optim.LR_POLICIES``) sets the lr
of each epoch (``step``/``fixed``: ``Model.adjust_hyperparams``) and a factor per global step
over the whole run (``cosine``/``poly``); this schedule multiplies them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from theanompi.models.optim import LRPolicy, lr_policy

__all__ = ["LRSchedule", "LRSetter", "lr_scale"]


def lr_scale(scaling: str, global_batch: int, reference_batch: int) -> float:
    """The lr factor: 1 for ``none``, ``global_batch / reference_batch`` for ``linear``.

    >>> lr_scale("linear", 512, 256), lr_scale("none", 512, 256)
    (2.0, 1.0)
    """
    if scaling == "none":
        return 1.0
    if scaling == "linear":
        return global_batch / reference_batch
    raise ValueError(f"unknown lr scaling {scaling!r}; choose from none, linear")


class LRSchedule:
    """``lr(epoch_lr, step)``: the lr of 0-based global ``step`` given the policy's epoch lr.

    ``lr = epoch_lr * k * warmup(t) * policy.step_factor(t, T)``, where ``epoch_lr`` is
    ``Model.adjust_hyperparams``' lr of the step's epoch, ``T = n_epochs * steps_per_epoch``
    and ``step_factor`` is 1 for ``step``/``fixed`` (so their lr is bit-identical to a
    schedule without a policy), ``(1 + cos(pi t/T)) / 2`` for ``cosine`` and
    ``(1 - t/T) ** lr_power`` for ``poly``: the decay runs over the whole run, warm-up
    included, and the warm-up multiplies it (as torch's ``ChainedScheduler`` of ``LinearLR``
    and ``CosineAnnealingLR``).

    Parameters
    ----------
    scale
        The linear-scaling factor ``k`` (:func:`lr_scale`).
    warmup_steps
        Steps of the ramp ``W`` (``warmup_epochs`` x steps per epoch); 0 turns it off.
    policy
        The model's :class:`~theanompi.models.optim.LRPolicy` (``None``: no per-step factor).
    total_steps
        ``T``, the run's steps (``n_epochs`` x steps per epoch); needed by ``cosine``/``poly``.

    During the ramp the factor rises linearly, per step, from ``1/k`` (the unscaled lr, as
    in Goyal et al. and Horovod) when ``k > 1``, or from ``1/W`` (nearly 0) otherwise, to 1
    at the end of warm-up: ``warmup(t) = s + (1 - s) * (t + 1) / W`` for ``t < W`` (``s``
    = ``1/k`` or 0), 1 after.

    >>> s = LRSchedule(scale=4.0, warmup_steps=3)
    >>> [round(s.lr(0.1, t), 3) for t in range(4)]
    [0.2, 0.3, 0.4, 0.4]
    >>> from theanompi.models.optim import CosineLR
    >>> c = LRSchedule(policy=CosineLR(), total_steps=4)
    >>> [round(c.lr(0.1, t), 4) for t in range(4)]
    [0.1, 0.0854, 0.05, 0.0146]
    """

    def __init__(
        self,
        scale: float = 1.0,
        warmup_steps: int = 0,
        policy: LRPolicy | None = None,
        total_steps: int = 0,
    ) -> None:
        if scale <= 0:
            raise ValueError(f"lr scale must be > 0, got {scale!r}")
        self.scale = float(scale)
        self.warmup_steps = max(0, int(warmup_steps))
        self.start = 1.0 / self.scale if self.scale > 1 else 0.0
        self.policy = policy if policy is not None else LRPolicy()
        self.total_steps = int(total_steps)
        self.policy.step_factor(0, self.total_steps)  # a per-step policy without T fails here

    @classmethod
    def from_config(
        cls, section: Mapping[str, Any], scale: float, warmup_steps: int, total_steps: int
    ) -> LRSchedule:
        """The schedule of a run: the model section's ``lr_policy`` (and ``lr_power``)."""
        return cls(scale, warmup_steps, lr_policy(section), total_steps)

    def factor(self, step: int) -> float:
        """The warm-up factor in (0, 1] of 0-based global ``step``."""
        if step >= self.warmup_steps:
            return 1.0
        return self.start + (1.0 - self.start) * (step + 1) / self.warmup_steps

    def lr(self, epoch_lr: float, step: int) -> float:
        """The lr to train ``step`` with."""
        return (
            epoch_lr
            * self.scale
            * self.factor(step)
            * self.policy.step_factor(step, self.total_steps)
        )


class LRSetter:
    """The model's ``lr`` variable kept at the schedule's lr of each step.

    ``new_epoch(epoch_lr, step)`` at an epoch's start (``epoch_lr``: what
    ``Model.adjust_hyperparams`` set), then ``at_step(step)`` before each step; the variable is
    written only when the value changes (a write costs a transfer under JAX).
    """

    def __init__(self, schedule: LRSchedule, lr_var: Any) -> None:
        self.schedule, self.var = schedule, lr_var
        self.epoch_lr = float(lr_var.get_value())
        self.current: float | None = None

    def new_epoch(self, epoch_lr: float, step: int) -> float:
        """A new epoch at global ``step``, from the policy's ``epoch_lr``; returns the lr."""
        self.epoch_lr, self.current = float(epoch_lr), None
        return self.at_step(step)

    def at_step(self, step: int) -> float:
        """The lr of global ``step``, set on the model."""
        lr = self.schedule.lr(self.epoch_lr, step)
        if lr != self.current:
            self.var.set_value(np.asarray(lr, dtype=self.var.get_value().dtype))
            self.current = lr
        return lr
