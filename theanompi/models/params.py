"""Parameter values across ranks: read/write shared variables, broadcast, layout and identity checks,
and one fused float32 buffer over a parameter list (for the point-to-point rules).

With the JAX backend the shared variables hold device arrays: reading copies them to host
numpy arrays and writing puts them back on the device, so the exchangers see numpy only."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from theanompi.errors import ConfigError
from theanompi.io.checkpoint import array_names

__all__ = [
    "on_device",
    "to_device",
    "get_values",
    "set_values",
    "holding",
    "bcast_values",
    "check_same_layout",
    "value_digests",
    "assert_identical",
    "ParamBuffer",
]


def on_device(value: Any) -> bool:
    """Whether a shared variable's value is a JAX device array (not a numpy array)."""
    return not isinstance(value, np.ndarray) and hasattr(value, "block_until_ready")


def to_device(vars_: Sequence[Any]) -> None:
    """Move the values of shared variables onto the default JAX device (once; stays there)."""
    import jax

    for v in vars_:
        if not on_device(v.get_value(borrow=True)):
            # set_value would filter the value back to numpy: write the container's storage;
            # device_put may read (or alias) its source later: give it a private copy
            v.container.storage[0] = jax.device_put(np.array(v.get_value(borrow=True)))


def get_values(vars_: Sequence[Any]) -> list[np.ndarray]:
    """Current values of shared variables as numpy arrays (``borrow=True``: no copy of a host
    value, do not keep them; a device value is copied to a new host array)."""
    out = []
    for v in vars_:
        a = v.get_value(borrow=True)
        out.append(np.array(a) if on_device(a) else a)
    return out


def set_values(vars_: Sequence[Any], arrays: Sequence[np.ndarray]) -> None:
    """``v.set_value(a, borrow=True)`` for each pair; a variable on the JAX device gets a
    device copy of ``a`` instead."""
    for v, a in zip(vars_, arrays, strict=True):
        cur = v.get_value(borrow=True)
        if on_device(cur):
            import jax

            # a private copy: device_put may read (or alias) it after the caller reuses ``a``
            v.container.storage[0] = jax.device_put(np.array(a, dtype=cur.dtype, copy=True))
        else:
            v.set_value(a, borrow=True)


@contextmanager
def holding(vars_: Sequence[Any], values: Sequence[np.ndarray] | None) -> Iterator[None]:
    """Context: ``vars_`` hold ``values`` (a rule's: EASGD's centre, GOSGD's weighted mean),
    their own values back after it; ``None``: their own, untouched."""
    if values is None:
        yield
        return
    own = [np.array(a, copy=True) for a in get_values(vars_)]
    set_values(vars_, values)
    try:
        yield
    finally:
        set_values(vars_, own)


def bcast_values(vars_: Sequence[Any], comm: Any, root: int = 0) -> None:
    """Overwrite every rank's shared variables with ``root``'s values (``comm.Bcast``)."""
    if comm.Get_size() == 1:
        return
    for v in vars_:
        a = np.array(v.get_value(borrow=True), copy=True, order="C")
        comm.Bcast(a, root=root)
        set_values([v], [a])


def _layout(vars_: Sequence[Any]) -> list[tuple[str, tuple[int, ...], str]]:
    vals = [v.get_value(borrow=True) for v in vars_]
    return [
        (n, tuple(a.shape), str(a.dtype))
        for n, a in zip(array_names(list(vars_), "param"), vals, strict=True)
    ]


def check_same_layout(vars_: Sequence[Any], comm: Any, what: str = "param") -> None:
    """Every rank must hold the same names, shapes and dtypes in the same order.

    Compares a digest over ``comm`` (one ``allgather``); on a mismatch every rank
    raises the same one-line ``ConfigError`` naming the rank and the parameter.
    """
    mine = _layout(vars_)
    digest = hashlib.sha1(repr(mine).encode()).hexdigest()
    digests = comm.allgather(digest)
    if len(set(digests)) == 1:
        return
    bad = next(r for r, d in enumerate(digests) if d != digests[0])
    layouts = comm.allgather(mine if comm.Get_rank() in (0, bad) else None)
    ref, other = layouts[0], layouts[bad]
    for i in range(max(len(ref), len(other))):
        a = ref[i] if i < len(ref) else None
        b = other[i] if i < len(other) else None
        if a != b:
            raise ConfigError(
                f"rank {bad} holds {what} #{i} {_fmt_layout(b)} but rank 0 holds {_fmt_layout(a)}; "
                "every rank must build the same model config"
            )
    raise ConfigError(f"rank {bad} holds a different {what} list than rank 0")  # pragma: no cover


def _fmt_layout(entry: tuple[str, tuple[int, ...], str] | None) -> str:
    if entry is None:
        return "nothing"
    return f"{entry[0]!r} {entry[1]} {entry[2]}"


def value_digests(arrays: Sequence[np.ndarray]) -> list[str]:
    """A short BLAKE2 digest of each array's bytes."""
    return [
        hashlib.blake2b(memoryview(np.ascontiguousarray(a)).cast("B"), digest_size=8).hexdigest()
        for a in arrays
    ]


def assert_identical(vars_: Sequence[Any], comm: Any, step: int) -> None:
    """Debug check (``check_every``): raise ``RuntimeError`` on every rank if any rank's values
    differ from rank 0's, naming the first differing parameter."""
    if comm.Get_size() == 1:
        return
    mine = value_digests(get_values(vars_))
    everyone = comm.allgather(mine)
    names = array_names(list(vars_), "param")
    for r, theirs in enumerate(everyone[1:], 1):
        for i, (d0, d) in enumerate(zip(everyone[0], theirs, strict=True)):
            if d0 != d:
                raise RuntimeError(
                    f"ranks diverged after step {step}: rank {r} differs from rank 0 in {names[i]!r}"
                )


class ParamBuffer:
    """One fused float32 buffer over a list of PyTensor shared variables.

    Parameters
    ----------
    params
        Shared variables (float32); their order and shapes fix the buffer layout.

    >>> import numpy as np, pytensor
    >>> p = [pytensor.shared(np.ones((2, 2), np.float32)), pytensor.shared(np.zeros(3, np.float32))]
    >>> buf = ParamBuffer(p)
    >>> buf.gather().shape
    (7,)
    """

    def __init__(self, params: Sequence[Any]) -> None:
        self.params = list(params)
        if not self.params:
            raise ValueError("ParamBuffer needs at least one shared variable")
        self.shapes = [tuple(p.get_value(borrow=True).shape) for p in self.params]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(int)
        self.data = np.empty(int(self.offsets[-1]), dtype=np.float32)

    @property
    def size(self) -> int:
        return int(self.data.size)

    def gather(self) -> np.ndarray:
        """Copy the shared variables' values into :attr:`data` and return it."""
        for p, a, b in zip(self.params, self.offsets[:-1], self.offsets[1:], strict=True):
            self.data[a:b] = np.asarray(p.get_value(borrow=True)).ravel()
        return self.data

    def split(self, data: np.ndarray) -> list[np.ndarray]:
        """``data`` cut into arrays shaped like the parameters (views)."""
        return [
            data[a:b].reshape(shape)
            for shape, a, b in zip(self.shapes, self.offsets[:-1], self.offsets[1:], strict=True)
        ]

    def scatter(self, data: np.ndarray | None = None) -> None:
        """Set the shared variables from ``data`` (default :attr:`data`); copies."""
        src = self.data if data is None else data
        for p, shape, a, b in zip(
            self.params, self.shapes, self.offsets[:-1], self.offsets[1:], strict=True
        ):
            set_values([p], [np.array(src[a:b], dtype=np.float32).reshape(shape)])
