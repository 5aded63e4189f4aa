"""Typed, frozen config sections: a key is declared once (type, default, choices or range) and
checked at load time, each failure one ``ConfigError`` line naming the key and the fix.

The generic part of the configs: :mod:`theanompi.config` declares the run's sections and
:mod:`theanompi.models.section` the model's, both with :func:`key` and :class:`Section`.
May import only ``theanompi.errors`` and ``theanompi.registry``.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import MISSING, Field, field, fields
from functools import cache
from pathlib import Path
from typing import Any, get_origin, get_type_hints

from theanompi.errors import ConfigError
from theanompi.registry import Registry, is_reference

__all__ = [
    "Section",
    "key",
    "to_plain",
    "freeze",
    "fields_of",
    "checked",
    "path_ok",
    "show",
    "suggest",
]


# -- ranges: (predicate, what the message says the value must be) -----------------------------
MAX_LR = 100.0  # model.learning_rate above this is a typo (1e18), not a schedule

Range = tuple[Callable[[Any], bool], str]
POSITIVE: Range = (lambda v: v > 0, "positive")
AT_LEAST_1: Range = (lambda v: v >= 1, ">= 1")
NON_NEGATIVE: Range = (lambda v: v >= 0, ">= 0")
UNIT: Range = (lambda v: 0.0 < v <= 1.0, "in (0, 1]")
FRACTION: Range = (lambda v: 0.0 <= v < 1.0, "in [0, 1)")
SEED: Range = (lambda v: 0 <= v < 2**63, "in [0, 2**63)")
LR: Range = (lambda v: 0.0 < v <= MAX_LR, f"in (0, {MAX_LR:g}] (a larger lr diverges at once)")
EPOCHS: Range = (lambda v: all(s >= 1 for s in v), "a list of epoch counts >= 1, e.g. [20, 40]")
_PATH_MAX, _NAME_MAX = 4096, 255  # Linux limits: whole path, one component (bytes)


def path_ok(p: str, required: bool) -> bool:
    if not p:
        return not required
    return (
        "\x00" not in p
        and len(p.encode(errors="replace")) <= _PATH_MAX
        and all(len(part.encode(errors="replace")) <= _NAME_MAX for part in p.split("/"))
    )


PATH: Range = (
    lambda v: path_ok(v, False),
    f"a path of <= {_PATH_MAX} bytes, names <= {_NAME_MAX}",
)
DIR: Range = (
    lambda v: path_ok(v, True),
    f"a non-empty path of <= {_PATH_MAX} bytes, names <= {_NAME_MAX}",
)


def key(
    default: Any,
    *,
    choices: tuple[str, ...] | Callable[[], Iterable[str]] | None = None,
    check: Range | None = None,
) -> Any:
    """A config key with ``choices`` (a tuple, or a registry read when validating) or a range."""
    meta = {"choices": choices, "check": check}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: freeze(default), metadata=meta)
    return field(default=default, metadata=meta)


class _FrozenDict(Mapping[str, Any]):
    """A read-only dict (the model's ``arch``)."""

    def __init__(self, items: Mapping[str, Any]) -> None:
        self._items = dict(items)

    def __getitem__(self, name: str) -> Any:
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return repr(self._items)


def freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return _FrozenDict({k: freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def to_plain(value: Any) -> Any:
    """A config value as YAML/JSON holds it: mappings become dicts, tuples lists (a copy).

    >>> to_plain({"arch": freeze({"hidden": [5, 3]})})
    {'arch': {'hidden': [5, 3]}}
    """
    if isinstance(value, Mapping):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    return value


@cache
def fields_of(cls: type) -> dict[str, Field[Any]]:
    return {f.name: f for f in fields(cls)}


class Section(Mapping[str, Any]):
    """Base of the typed sections: frozen dataclasses that also read as read-only mappings,
    so ``cfg.data.dir``, ``cfg.data["dir"]`` and ``dict(cfg.model)`` all work."""

    def __getitem__(self, name: str) -> Any:
        if name not in fields_of(type(self)):
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(fields_of(type(self)))

    def __len__(self) -> int:
        return len(fields_of(type(self)))

    def to_dict(self) -> dict[str, Any]:
        """The section as plain YAML/JSON values."""
        return {name: to_plain(getattr(self, name)) for name in self}

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every key's default as plain values."""
        out = {}
        for f in fields(cls):
            value = f.default if f.default_factory is MISSING else f.default_factory()
            out[f.name] = to_plain(value)
        return out


def suggest(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{hint}valid keys: {', '.join(valid)}"


@cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _yaml_type(hint: Any) -> type:
    """The YAML type a field is written as: ``tuple[...]`` is a list, ``Mapping`` a dict."""
    origin = get_origin(hint) or hint
    return {tuple: list, Mapping: dict}.get(origin, origin)


def show(value: Any, limit: int = 60) -> str:
    """``repr(value)``, shortened for a one-line message (a 200 kB path stays readable)."""
    text = repr(value)
    return (
        text if len(text) <= limit else f"{text[: limit - 20]}...{text[-12:]} ({len(text)} chars)"
    )


def _as_float(value: Any) -> Any:
    """``1e-3`` is a str to YAML 1.1 (no dot): read such a str as the float it spells."""
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return value
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _check_choice(where: str, name: str, valid: Any, value: Any, base: Path | None) -> str:
    """A choice: one of a tuple, or a registered name or a reference that a registry resolves."""
    if isinstance(valid, Registry) and isinstance(value, str) and is_reference(value):
        try:
            return valid.check(value, base)
        except ConfigError as err:
            raise ConfigError(f"{where}: {name}: {err}") from None
    if not isinstance(value, str) or value not in valid:
        more = (
            ", or package.module:Class or path/to/file.py:Class"
            if isinstance(valid, Registry)
            else ""
        )
        raise ConfigError(
            f"{where}: {name} is {show(value)}; it must be one of {', '.join(map(repr, valid))}{more}"
        )
    return value


def _check_choices(
    where: str, name: str, valid: Any, value: Any, base: Path | None
) -> tuple[str, ...]:
    """A list of choices, e.g. ``output.loggers: [csv, tensorboard]``: each item checked as
    :func:`_check_choice` does, none twice (a tuple: a value checked before passes again)."""
    if not isinstance(value, (list, tuple)):
        raise ConfigError(
            f"{where}: {name} must be a list, got {show(value)} ({type(value).__name__}); "
            f"write e.g. [{', '.join(list(valid)[:2])}], or [] for none"
        )
    items = tuple(_check_choice(where, name, valid, v, base) for v in value)
    twice = next((v for i, v in enumerate(items) if v in items[:i]), None)
    if twice is not None:
        raise ConfigError(f"{where}: {name} lists {show(twice)} twice; name it once")
    return items


def _check_value(
    where: str, name: str, f: Field[Any], hint: Any, value: Any, base: Path | None
) -> Any:
    valid = f.metadata.get("choices")
    kind = _yaml_type(hint)
    if valid is not None:
        valid = valid() if callable(valid) else valid
        if kind is list:  # a list of choices (tuple[str, ...]): each item one of them, once
            return _check_choices(where, name, valid, value, base)
        return _check_choice(where, name, valid, value, base)
    if kind is float:
        value = _as_float(value)
    if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
        raise ConfigError(
            f"{where}: {name} must be {kind.__name__}, got {show(value)} ({type(value).__name__})"
        )
    if kind is float and not math.isfinite(value):
        raise ConfigError(f"{where}: {name} must be a finite number, got {value!r}")
    if kind is list:  # tuple[int, ...]: every item of that type
        item = (getattr(hint, "__args__", None) or (Any,))[0]
        bad = [
            v for v in value if item is not Any and (isinstance(v, bool) or not isinstance(v, item))
        ]
        if bad:
            raise ConfigError(
                f"{where}: {name} must be a list of {item.__name__}, got {show(value)} "
                f"({show(bad[0])} is {type(bad[0]).__name__})"
            )
    check = f.metadata.get("check")
    if check is not None and not check[0](value):
        raise ConfigError(f"{where}: {name} must be {check[1]}, got {show(value)}")
    return freeze(value)


def checked(
    where: str, cls: type[Section], given: dict[str, Any], prefix: str, base: Path | None = None
) -> dict[str, Any]:
    """``given`` validated against ``cls``'s fields (the section's kwargs); ``base`` is the
    folder that a ``path/to/file.py:Class`` choice is relative to (the file's; else the cwd)."""
    known = fields_of(cls)
    unknown = [str(k) for k in given if k not in known]
    if unknown:
        raise ConfigError(
            f"{where}: unknown key {show(prefix + unknown[0])}; {suggest(unknown[0], list(known))}"
        )
    hints = _hints(cls)
    return {
        name: _check_value(where, prefix + name, known[name], hints[name], value, base)
        for name, value in given.items()
    }
