"""A model's compiled step functions: its symbolic graph, built once, and the functions compiled from it on first use."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from theanompi.io import startup_trace
from theanompi.pytensor_env import configure

configure()

import pytensor  # noqa: E402
import pytensor.tensor as pt  # noqa: E402
from pytensor.tensor.special import softmax  # noqa: E402

from theanompi.models.metrics import symbolic_metrics  # noqa: E402
from theanompi.models.params import to_device  # noqa: E402

__all__ = ["StepFunctions"]


class StepFunctions:
    """The compiled functions of one :class:`~theanompi.models.base.Model`, by name.

    Kept apart from the model so that a model says *what* it computes (``forward``,
    ``state_updates``, its optimiser) and this says *how* that is compiled and cached:
    ``train`` and ``eval`` at :meth:`build`, the gradient-only steps (``grads``,
    ``grads_add``, ``apply``, ``scale``) on first use, ``eval<n>`` per batch size under JAX.

    Parameters
    ----------
    model
        The model whose ``forward``, ``params``, ``grads``, ``optimizer`` ... are compiled.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.fns: dict[str, Any] = {}
        self.mode: Any = None
        self.backend = "c"
        #: seconds spent per function (``graph``: building the symbolic graph)
        self.seconds: dict[str, float] = {}
        self.graph: dict[str, Any] = {}

    # -- the symbolic graph ---------------------------------------------------------------
    def inputs(self, batch: int | None) -> tuple[Any, Any]:
        """Symbolic ``(x, y)``. Static (C, H, W): shape graphs constant-fold, so graph
        building and rewriting stay fast; the batch axis is free for C (one compiled function
        serves any batch size) and static for JAX, whose jit needs every shape concrete."""
        x = pt.tensor4("x", dtype=pytensor.config.floatX, shape=(batch, *self.model.input_shape))
        return x, pt.tensor("y", dtype="int32", shape=(batch,))

    def eval_outputs(self, x: Any, y: Any) -> list[Any]:
        """Loss, top-1 and top-5 error and the softmax, dropout off."""
        logits = self.model.forward(x, train=False)
        loss, top1, top5 = symbolic_metrics(logits, y)
        return [loss, top1, top5, softmax(logits, axis=-1)]

    def _graphs(self) -> dict[str, Any]:
        m = self.model
        x, y = self.inputs(m.batch_size if self.backend == "jax" else None)
        logits = m.forward(x, train=True)
        smoothing = float(m.config.get("label_smoothing", 0.0))
        loss, top1, _ = symbolic_metrics(logits, y, label_smoothing=smoothing)
        return {
            "x": x,
            "y": y,
            "loss": loss,
            "top1": top1,
            "grads": pytensor.grad(loss, m.params),
            "state_up": m.state_updates(),
            "eval": self.eval_outputs(x, y),
        }

    # -- compiling ------------------------------------------------------------------------
    def build(self, mode: Any, backend: str) -> None:
        """Compile ``train`` and ``eval`` (once: later calls keep the first backend)."""
        if "train" in self.fns:
            return
        from theanompi.models.ops import compile_mode

        self.backend = backend
        self.mode = compile_mode(backend) if mode is None else mode
        startup_trace.mark("build_start")
        t0 = time.perf_counter()
        with pytensor.config.change_flags(traceback__limit=0):  # stack traces cost ~15%
            g = self.graph = self._graphs()
        self.seconds["graph"] = time.perf_counter() - t0
        train_up = self.model.optimizer.updates(g["grads"]) + g["state_up"]
        self.compile("train", [g["x"], g["y"]], [g["loss"], g["top1"]], train_up)
        self.compile("eval", [g["x"], g["y"]], g["eval"], [])
        startup_trace.mark("build_end")

    def compile(
        self, key: str, inputs: list[Any], outputs: list[Any], updates: list[Any], mode: Any = None
    ) -> Any:
        """``pytensor.function`` named ``<model>.<key>``, timed and kept under ``key``."""
        m = self.model
        t0 = time.perf_counter()
        with pytensor.config.change_flags(traceback__limit=0):
            fn = pytensor.function(
                inputs, outputs, updates=updates, name=f"{m.name}.{key}", mode=mode or self.mode
            )
        if self.backend == "jax":
            fn.trust_input = True  # xy hands it device arrays of the right types
            to_device(m.params + m.opt_state + m.grads + [m.lr] + m.buffers)
        self.seconds[key] = time.perf_counter() - t0
        startup_trace.add("compile", self.seconds[key])
        self.fns[key] = fn
        return fn

    def get(self, key: str) -> Any:
        """The function ``key``, compiled now if it is a gradient-only step not used yet."""
        if "train" not in self.fns:
            self.model.build()
        if key not in self.fns:
            g, grads = self.graph, self.model.grads
            xy, metrics = [g["x"], g["y"]], [g["loss"], g["top1"]]
            if key == "grads":
                self.compile(
                    key, xy, metrics, list(zip(grads, g["grads"], strict=True)) + g["state_up"]
                )
            elif key == "grads_add":  # gradient accumulation: grads += this batch's
                ups = [(s, s + d) for s, d in zip(grads, g["grads"], strict=True)]
                self.compile(key, xy, metrics, ups + g["state_up"])
            elif key == "apply":
                self.compile(key, [], [], self.model.optimizer.updates(grads))
            elif key == "scale":
                f = pt.scalar("factor", dtype=pytensor.config.floatX)
                self.compile(key, [f], [], [(s, s * f) for s in grads])
        return self.fns[key]

    def eval_fn(self, n: int) -> Any:
        """The eval function for a batch of ``n`` (JAX: compiled once per new size)."""
        if self.backend != "jax" or n == self.model.batch_size:
            return self.get("eval")
        key = f"eval{n}"
        if key not in self.fns:
            with pytensor.config.change_flags(traceback__limit=0):
                x, y = self.inputs(n)
                outs = self.eval_outputs(x, y)
            self.compile(key, [x, y], outs, [])
        return self.fns[key]

    def overlapped(
        self, buckets: list[list[int]], sink: Callable[[int, Sequence[np.ndarray]], None]
    ) -> None:
        """Compile ``grads_overlap``: the gradient step that hands each bucket's gradients
        to ``sink`` as soon as they exist (:mod:`theanompi.models.overlap`; C backend)."""
        from theanompi.models.overlap import BucketReady, overlap_mode

        if self.backend == "jax":
            raise ValueError("overlapped gradients need the C backend (JAX compiles one XLA call)")
        self.model.build()
        g = self.graph
        marks = [BucketReady(k, sink)(*[g["grads"][i] for i in b]) for k, b in enumerate(buckets)]
        outputs = [g["loss"], g["top1"], *marks]
        self.compile(
            "grads_overlap", [g["x"], g["y"]], outputs, g["state_up"], overlap_mode(self.mode)
        )

    # -- batches --------------------------------------------------------------------------
    def xy(self, x: Any, y: Any) -> tuple[Any, Any]:
        """The batch as the compiled functions take it (on the JAX device for ``jax``)."""
        xy = (np.asarray(x, dtype=pytensor.config.floatX), np.asarray(y, dtype=np.int32))
        if self.backend == "jax":
            import jax

            return jax.device_put(xy[0]), jax.device_put(xy[1])
        return xy

    def train_xy(self, x: Any, y: Any) -> tuple[Any, Any]:
        """:meth:`xy`, refusing under JAX a batch of another size than the compiled one."""
        b = self.model.batch_size
        if self.backend == "jax" and len(x) != b:
            raise ValueError(
                f"backend jax compiled the training step for batches of {b}, "
                f"got {len(x)}; call build(batch_size={len(x)}) on a new model"
            )
        return self.xy(x, y)

    def scalar(self, value: float) -> Any:
        """A floatX scalar argument (on the JAX device for ``jax``)."""
        f = np.asarray(value, dtype=pytensor.config.floatX)
        if self.backend == "jax":
            import jax

            return jax.device_put(f)
        return f
