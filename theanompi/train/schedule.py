"""The large-batch recipe on top of a model's lr policy: linear scaling and gradual warm-up per step.

Goyal et al. 2017 (arXiv:1706.02677): with ``k`` times the reference global batch, use ``k``
times the learning rate, and reach it by a linear ramp over the first epochs (Theano-MPI's
BSP ``lr_warmup``). The model's own policy (``lr_step``/``lr_gamma``) still sets the lr of
each epoch; this schedule multiplies it.
"""

from __future__ import annotations

__all__ = ["LRSchedule", "lr_scale"]


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

    Parameters
    ----------
    scale
        The linear-scaling factor ``k`` (:func:`lr_scale`).
    warmup_steps
        Steps of the ramp (``warmup_epochs`` x steps per epoch); 0 turns it off.

    During the ramp the factor rises linearly, per step, from ``1/k`` (the unscaled lr, as
    in Goyal et al. and Horovod) when ``k > 1``, or from ``1/warmup_steps`` (nearly 0)
    otherwise, to 1 at the end of warm-up.

    >>> s = LRSchedule(scale=4.0, warmup_steps=3)
    >>> [round(s.lr(0.1, t), 3) for t in range(4)]
    [0.2, 0.3, 0.4, 0.4]
    """

    def __init__(self, scale: float = 1.0, warmup_steps: int = 0) -> None:
        if scale <= 0:
            raise ValueError(f"lr scale must be > 0, got {scale!r}")
        self.scale = float(scale)
        self.warmup_steps = max(0, int(warmup_steps))
        self.start = 1.0 / self.scale if self.scale > 1 else 0.0

    def factor(self, step: int) -> float:
        """The warm-up factor in (0, 1] of 0-based global ``step``."""
        if step >= self.warmup_steps:
            return 1.0
        return self.start + (1.0 - self.start) * (step + 1) / self.warmup_steps

    def lr(self, epoch_lr: float, step: int) -> float:
        """The lr to train ``step`` with."""
        return epoch_lr * self.scale * self.factor(step)
