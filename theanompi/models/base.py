"""The ``Model`` protocol the trainer relies on, and a base class that implements it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from theanompi.errors import ConfigError
from theanompi.pytensor_env import configure

configure()

import pytensor  # noqa: E402
import pytensor.tensor as pt  # noqa: E402

from theanompi.models._steps import StepFunctions  # noqa: E402
from theanompi.models.layers import Layer  # noqa: E402
from theanompi.models.optim import _zeros_like, create_optimizer, lr_policy  # noqa: E402
from theanompi.models.params import set_values  # noqa: E402

__all__ = ["Model", "FunctionModel", "scaled_width", "wrap_network"]

from theanompi.models.section import ModelSection  # noqa: E402
from theanompi.schema import to_plain  # noqa: E402

#: every model key's default, read from the one schema (theanompi.models.section.ModelSection)
_COMMON_DEFAULTS = ModelSection.defaults()


# ranges of the arch keys several models share (checked once their types are right)
_ARCH_RANGES: dict[str, tuple[Any, str]] = {
    "width": (lambda v: v > 0, "> 0"),
    "fc_units": (lambda v: v >= 1, ">= 1"),
    "dropout": (lambda v: 0 <= v < 1, "in [0, 1)"),
}


def scaled_width(n: int, width: float, multiple: int = 1) -> int:
    """``n`` channels times ``arch.width``, rounded to a positive multiple of ``multiple``
    (a grouped conv's group count), so that narrow test models keep every layer."""
    return max(multiple, int(round(n * width / multiple)) * multiple)


class Model:
    """A trainable classifier: what ``tmpi train`` / ``tmpi eval`` need from a network.

    The protocol (duck-typed; subclassing is optional):

    ``params``
        list of float32 shared variables with unique ``.name`` (``conv1.W``): exchanged
        between workers and checkpointed.
    ``opt_state``
        list of shared variables (SGD's momentum buffers ``conv1.W.v``, Adam's moments and
        step count): checkpointed only, never exchanged.
    ``buffers``
        list of non-trainable shared variables that the training step updates (batch-norm
        running ``bn1.mean``/``bn1.var``; empty without BN): per rank while training,
        averaged over the workers at each epoch end and before each checkpoint, checkpointed.
    ``grads``
        shared variables shaped like ``params``, written by :meth:`compute_grads`.
    ``input_shape``, ``n_classes``, ``lr``
        ``(C, H, W)`` of one input, the class count, and the scalar learning rate.
    ``build(batch_size)``
        compile the step functions (once).
    ``train_step(x, y) -> (loss, top1_err)``
        forward, backward and parameter update on float32 ``x`` (b, C, H, W), int32 ``y``.
    ``compute_grads(x, y, accumulate=False)`` / ``apply_grads()``
        the same split in two (for gradient averaging between workers); with
        ``accumulate=True`` the gradients are added to ``grads`` instead of replacing them.
    ``scale_grads(factor)``
        multiply ``grads`` by ``factor`` (``1/K`` after ``K`` accumulated sub-batches:
        ``training.accumulate_steps``).
    ``val_step(x, y) -> (loss, top1_err, top5_err)`` and ``predict(x) -> probs``
        without dropout.
    ``adjust_hyperparams(epoch)``
        set ``lr`` for a 0-based epoch from the config's lr policy (a per-step policy's
        factor is the Trainer's :class:`~theanompi.train.schedule.LRSchedule`).

    This class implements all of it from a network given by :meth:`build_network` (a
    :class:`~theanompi.models.layers.Layer`); override :meth:`forward` instead to plug in a
    graph written by hand or with any library whose parameters are PyTensor shared
    variables (then set ``self.params`` yourself before calling ``super().__init__``'s
    optimiser set-up, see :meth:`setup_optimizer`).

    Parameters
    ----------
    section : Mapping
        A model config section (the keys of :class:`~theanompi.models.section.ModelSection`); missing keys
        take the schema defaults; ``arch`` is checked against ``ARCH_DEFAULTS``.

    Examples
    --------
    >>> from theanompi.models import create_model
    >>> m = create_model({"name": "mlp", "input_size": 4, "channels": 1, "n_classes": 3,
    ...                   "arch": {"hidden": [5]}})
    >>> [p.name for p in m.params], m.input_shape
    (['fc1.W', 'fc1.b', 'out.W', 'out.b'], (1, 4, 4))
    """

    name = "model"
    #: non-trainable state (batch-norm running statistics); a hand-made graph sets its own
    buffers: list[Any] = []
    #: model-specific ``arch`` keys and their defaults; unknown keys raise ConfigError
    ARCH_DEFAULTS: dict[str, Any] = {}

    def __init__(self, section: Mapping[str, Any]) -> None:
        cfg = dict(_COMMON_DEFAULTS)
        cfg.update(to_plain(section))  # a config's frozen ModelSection, or any mapping
        self.config = cfg
        for key in ("input_size", "channels", "n_classes", "batch_size"):
            if not isinstance(cfg[key], int) or isinstance(cfg[key], bool) or cfg[key] < 1:
                raise ConfigError(f"model.{key} must be a positive int, got {cfg[key]!r}")
        self.arch = self._check_arch(cfg.get("arch") or {})
        self.input_shape: tuple[int, int, int] = (
            cfg["channels"],
            cfg["input_size"],
            cfg["input_size"],
        )
        self.n_classes: int = cfg["n_classes"]
        self.batch_size: int = cfg["batch_size"]
        self.base_lr = float(cfg["learning_rate"])
        self.lr = pytensor.shared(np.asarray(self.base_lr, dtype=pytensor.config.floatX), name="lr")
        self.rng = np.random.default_rng(int(self.arch.get("seed", 0)))
        self.lr_policy = lr_policy(cfg)
        try:
            self.net: Layer | None = self.build_network()
        except ValueError as err:  # a layer refused the shapes the config implies
            raise ConfigError(f"model {self.name!r}: {err}") from None
        if self.net is not None:
            if tuple(self.net.out_shape) != (self.n_classes,):
                raise ConfigError(
                    f"model {self.name!r}: network outputs {self.net.out_shape}, expected "
                    f"({self.n_classes},); check n_classes and arch"
                )
            self.params = list(self.net.params)
            self.buffers = list(self.net.state)
        self.setup_optimizer()
        self._steps = StepFunctions(self)  # graph and compiled functions, built on demand

    # -- construction -------------------------------------------------------------------
    def _check_arch(self, arch: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(arch, Mapping):
            raise ConfigError(f"model.arch must be a mapping, got {arch!r}")
        known = {**self.ARCH_DEFAULTS, "seed": 0, "input_scale": 1 / 255}
        unknown = sorted(set(arch) - set(known))
        if unknown:
            raise ConfigError(
                f"model.arch: unknown key {unknown[0]!r} for {self.name!r}; valid keys: "
                f"{', '.join(sorted(known))}"
            )
        out = {**known, **arch}
        for key, default in known.items():
            val = out[key]
            if default is None:
                continue
            kind = type(default)
            ok = isinstance(val, kind) or (kind is float and isinstance(val, int))
            if isinstance(val, bool) and kind is not bool:
                ok = False
            if not ok:
                raise ConfigError(
                    f"model.arch.{key} must be {kind.__name__} (e.g. {default!r}), got {val!r}"
                )
        for key, (ok, rule) in _ARCH_RANGES.items():
            if key in self.ARCH_DEFAULTS and not ok(out[key]):
                raise ConfigError(f"model.arch.{key} must be {rule}, got {out[key]!r}")
        return out

    def build_network(self) -> Layer | None:
        """Return the network as one :class:`Layer` mapping ``input_shape`` to ``(n_classes,)``
        scores (logits). Return ``None`` and override :meth:`forward` for a hand-made graph."""
        raise NotImplementedError

    def setup_optimizer(self) -> None:
        """Create the optimiser ``model.optimizer`` names (``theanompi.models.optim.OPTIMIZERS``),
        ``opt_state`` and ``grads`` for ``self.params``."""
        names = [p.name for p in self.params]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup or any(not n for n in names):
            raise ValueError(f"parameter names must be unique and non-empty; repeated: {dup}")
        self.optimizer = create_optimizer(self.params, self.lr, self.config)
        self.opt_state = list(self.optimizer.state)
        self.grads = [
            pytensor.shared(_zeros_like(p), name=f"{p.name}.grad", borrow=True) for p in self.params
        ]

    # -- graph ----------------------------------------------------------------------------
    def forward(self, x: pt.TensorVariable, train: bool) -> pt.TensorVariable:
        """Symbolic logits (b, n_classes) for input ``x`` (b, C, H, W)."""
        assert self.net is not None
        scale = float(self.arch.get("input_scale", 1.0))
        if scale != 1.0:
            x = x * np.asarray(scale, dtype=pytensor.config.floatX)
        return self.net(x, train)

    def n_params(self) -> int:
        """Number of trainable scalars."""
        return int(sum(p.get_value(borrow=True).size for p in self.params))

    def flops_per_image(self) -> int:
        """Forward multiply-add FLOPs (x2) per image through GEMM-like layers."""
        return self.net.flops() if self.net is not None else 0

    def state_updates(self) -> list[tuple[Any, Any]]:
        """Non-gradient updates of a training step (batch-norm running statistics)."""
        return list(self.net.updates) if self.net is not None else []

    def build(self, batch_size: int | None = None, mode: Any = None, backend: str = "c") -> Model:
        """Compile ``train_step`` and ``val_step``/``predict`` (``compute_grads`` and
        ``apply_grads`` are compiled on first use). Idempotent; returns ``self``.

        ``backend`` names the compiler (``theanompi.models.BACKENDS``): ``c`` (the
        configured FAST_RUN + C linker) or ``jax`` (XLA; the shared variables then live on
        the JAX device between steps and only the batch and the metrics cross to and from
        it). ``mode``, when given, is passed to ``pytensor.function`` instead; tests use
        ``Mode(linker="py", optimizer="fast_compile")`` to skip C compiles.
        """
        if batch_size is not None:
            if not isinstance(batch_size, int) or batch_size < 1:
                raise ValueError(f"batch_size={batch_size!r} must be a positive int")
            self.batch_size = batch_size
        self._steps.build(mode, backend)
        return self

    @property
    def backend(self) -> str:
        """The compiler the step functions were built with (``c`` until :meth:`build`)."""
        return self._steps.backend

    @property
    def compile_seconds(self) -> dict[str, float]:
        """Seconds spent building the graph (``graph``) and compiling each function."""
        return self._steps.seconds

    def _fn(self, key: str) -> Any:
        """The compiled function ``key`` (``train``, ``eval``, ``grads``, ...): benchmarks
        and tests look at it."""
        return self._steps.get(key)

    def _xy(self, x: Any, y: Any) -> tuple[Any, Any]:
        """The batch as the compiled functions take it (on the JAX device for ``jax``)."""
        return self._steps.xy(x, y)

    # -- steps ----------------------------------------------------------------------------
    def train_step(self, x: Any, y: Any) -> tuple[float, float]:
        """One optimiser step on (x, y); returns (loss, top-1 error) before the update (the
        loss is the training objective: label-smoothed when ``model.label_smoothing`` > 0)."""
        loss, err = self._steps.get("train")(*self._steps.train_xy(x, y))
        return float(loss), float(err)

    def compute_grads(self, x: Any, y: Any, accumulate: bool = False) -> tuple[float, float]:
        """Write the gradients of the loss on (x, y) into ``grads`` (``accumulate``: add
        them to what ``grads`` hold); params unchanged. Returns (loss, top-1 error) of (x, y)."""
        loss, err = self._steps.get("grads_add" if accumulate else "grads")(
            *self._steps.train_xy(x, y)
        )
        return float(loss), float(err)

    def compile_overlapped_grads(
        self, buckets: list[list[int]], sink: Callable[[int, Sequence[np.ndarray]], None]
    ) -> None:
        """Compile :meth:`compute_grads_overlapped`: the gradient step that calls
        ``sink(k, values)`` with bucket ``k``'s gradients (indices into ``grads``) as soon as
        they exist, while it computes the rest (:mod:`theanompi.models.overlap`; C backend)."""
        self._steps.overlapped(buckets, sink)

    def compute_grads_overlapped(self, x: Any, y: Any) -> tuple[float, float]:
        """:meth:`compute_grads`, except that the gradients go to the sink given to
        :meth:`compile_overlapped_grads`, not to ``grads``. Returns (loss, top-1 error)."""
        loss, err, *_ = self._steps.fns["grads_overlap"](*self._steps.train_xy(x, y))
        return float(loss), float(err)

    def scale_grads(self, factor: float) -> None:
        """Multiply ``grads`` by ``factor``: after ``K`` accumulated sub-batches of equal
        size, ``1/K`` leaves the gradient of their union (the loss is a mean over the batch)."""
        self._steps.get("scale")(self._steps.scalar(factor))

    def apply_grads(self) -> None:
        """One optimiser step from the values in ``grads``."""
        self._steps.get("apply")()

    def val_step(self, x: Any, y: Any) -> tuple[float, float, float]:
        """(loss, top-1 error, top-5 error), means over the batch, dropout off."""
        loss, t1, t5, _ = self._steps.eval_fn(len(x))(*self._steps.xy(x, y))
        return float(loss), float(t1), float(t5)

    def predict(self, x: Any) -> np.ndarray:
        """Softmax probabilities (b, n_classes), float32, dropout off."""
        x = np.asarray(x, dtype=pytensor.config.floatX)
        *_, probs = self._steps.eval_fn(len(x))(
            *self._steps.xy(x, np.zeros(len(x), dtype=np.int32))
        )
        return np.asarray(probs, dtype=np.float32)

    def adjust_hyperparams(self, epoch: int) -> None:
        """Set ``lr`` for 0-based ``epoch`` from ``lr_policy``/``lr_step``/``lr_gamma``
        (``step``: ``learning_rate * lr_gamma ** #{s in lr_step: epoch >= s}``; the others:
        ``learning_rate``, which ``cosine``/``poly`` then decay per step in the Trainer)."""
        lr = self.base_lr * self.lr_policy.epoch_factor(int(epoch))
        set_values([self.lr], [np.asarray(lr, dtype=pytensor.config.floatX)])


class FunctionModel(Model):
    """A network built elsewhere, as its forward function and its shared variables: trained,
    checkpointed and exchanged like any :class:`Model` (see :func:`wrap_network`)."""

    name = "function"

    def __init__(
        self,
        forward: Callable[[Any, bool], Any],
        params: Sequence[Any],
        section: Mapping[str, Any] | None = None,
        buffers: Sequence[Any] = (),
    ) -> None:
        self._forward_fn, self._given = forward, (list(params), list(buffers))
        super().__init__(section or {})

    def build_network(self) -> None:
        self.params, self.buffers = (list(v) for v in self._given)
        return None

    def forward(self, x: pt.TensorVariable, train: bool) -> pt.TensorVariable:
        return self._forward_fn(x, train)


def wrap_network(
    forward: Callable[[Any, bool], Any],
    params: Sequence[Any],
    section: Mapping[str, Any] | None = None,
    buffers: Sequence[Any] = (),
) -> Model:
    """A :class:`Model` from a network built elsewhere (Lasagne-style code, a graph of your own).

    Parameters
    ----------
    forward
        ``forward(x, train) -> logits``: symbolic (b, n_classes) scores for the symbolic
        input ``x`` (b, C, H, W), the mean-subtracted image in 0..255 units; ``train`` says
        whether dropout and the like are on.
    params
        The trainable shared variables ``forward`` reads (unique, non-empty names).
    section
        Model config keys (``input_size``, ``channels``, ``n_classes``, ``learning_rate``,
        ``optimizer``, ...); missing keys take the schema defaults.
    buffers
        Non-trainable state shared variables (averaged over the workers, checkpointed).

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> W = pytensor.shared(np.zeros((3 * 8 * 8, 4), "float32"), name="W")
    >>> m = wrap_network(lambda x, train: pt.dot(x.flatten(2), W), [W],
    ...                  {"input_size": 8, "n_classes": 4})
    >>> m.input_shape, [p.name for p in m.params]
    ((3, 8, 8), ['W'])
    """
    return FunctionModel(forward, params, section, buffers)
