"""A numpy softmax-regression model implementing the ``Model`` protocol (no compile: fast tests).

It has params, momentum ``opt_state``, ``grads``, an ``lr`` shared scalar, and a
shared ``numpy.random.Generator`` ("input dropout") so that checkpoints must
carry RNG state for a resume to be bit-exact.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytensor

__all__ = ["FakeModel"]


class FakeModel:
    def __init__(self, section: Any) -> None:
        c, s, k = int(section["channels"]), int(section["input_size"]), int(section["n_classes"])
        self.input_shape = (c, s, s)
        self.n_classes = k
        self.base_lr = float(section["learning_rate"])
        self.momentum = float(section["momentum"])
        self.lr_step = list(section.get("lr_step", []))
        self.lr_gamma = float(section.get("lr_gamma", 0.1))
        f = c * s * s
        init = np.random.default_rng(7)
        self.params = [
            pytensor.shared((init.standard_normal((f, k)) * 0.01).astype(np.float32), name="fc.W"),
            pytensor.shared(np.zeros(k, np.float32), name="fc.b"),
        ]
        self.opt_state = [
            pytensor.shared(np.zeros_like(p.get_value()), name=f"{p.name}.v") for p in self.params
        ]
        self.grads = [
            pytensor.shared(np.zeros_like(p.get_value()), name=f"{p.name}.grad")
            for p in self.params
        ]
        self.lr = pytensor.shared(np.float32(self.base_lr), name="lr")
        self.noise = pytensor.shared(np.random.default_rng(0), name="drop.rng")
        self.built_with: int | None = None

    @property
    def rng_vars(self) -> list[Any]:
        return [self.noise]

    def build(self, batch_size: int, backend: str = "c") -> FakeModel:
        """Numpy stands in for both compilers, so ``backend`` changes nothing."""
        self.built_with = batch_size
        return self

    def _forward(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        feats = x.reshape(len(x), -1).astype(np.float32) / np.float32(255)
        W, b = (p.get_value(borrow=True) for p in self.params)
        z = feats @ W + b
        z = z - z.max(axis=1, keepdims=True)
        p = np.exp(z)
        return feats, p / p.sum(axis=1, keepdims=True)

    def _grads(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float, list[np.ndarray]]:
        g = self.noise.get_value(borrow=True)
        keep = (g.random(x.shape[1:]) < 0.9).astype(np.float32)
        self.noise.set_value(g, borrow=True)
        feats, p = self._forward(x * keep)
        n = len(y)
        loss = float(-np.log(p[np.arange(n), y] + 1e-12).mean())
        err = float((p.argmax(1) != y).mean())
        d = p.copy()
        d[np.arange(n), y] -= 1
        d /= n
        return loss, err, [(feats.T @ d).astype(np.float32), d.sum(0).astype(np.float32)]

    def _apply(self, grads: list[np.ndarray]) -> None:
        lr = np.float32(self.lr.get_value())
        for p, v, g in zip(self.params, self.opt_state, grads, strict=True):
            nv = np.float32(self.momentum) * v.get_value() - lr * g
            v.set_value(nv.astype(np.float32))
            p.set_value((p.get_value() + nv).astype(np.float32))

    def train_step(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        loss, err, g = self._grads(x, y)
        self._apply(g)
        return loss, err

    def compute_grads(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        loss, err, g = self._grads(x, y)
        for s, a in zip(self.grads, g, strict=True):
            s.set_value(a)
        return loss, err

    def apply_grads(self) -> None:
        self._apply([g.get_value() for g in self.grads])

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self._forward(x)[1].astype(np.float32)

    def val_step(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
        p = self.predict(x)
        n = len(y)
        true = p[np.arange(n), y]
        higher = (p > true[:, None]).sum(1)
        return (
            float(-np.log(true + 1e-12).mean()),
            float((higher >= 1).mean()),
            float((higher >= 5).mean()),
        )

    def adjust_hyperparams(self, epoch: int) -> None:
        lr = self.base_lr * self.lr_gamma ** sum(epoch >= s for s in self.lr_step)
        self.lr.set_value(np.float32(lr))
