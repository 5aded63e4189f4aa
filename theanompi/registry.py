"""One registry type for every choice by name: models, sync rules, exchange strategies, compressors,
backends, each resolving a registered name, ``package.module:Class`` or ``path/to/file.py:Class``.

A registry maps names to ``"module:attr"`` strings (imported on first use, so listing the choices
imports nothing) or to objects. Users extend it without editing our files, by ``register`` or by
naming their class directly. May import only ``theanompi.errors``.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

from theanompi.errors import ConfigError

__all__ = ["Registry", "is_reference", "load_object", "source_of", "source_changed"]

T = TypeVar("T")

#: ``sys.modules`` prefix of the modules loaded from a ``file.py:Class`` reference
_FILE_MODULES = "theanompi_user"


def is_reference(text: str) -> bool:
    """``package.module:Class`` or ``path/to/file.py:Class``, rather than a registered name."""
    return ":" in text


def _module_from_file(path: Path) -> Any:
    """The module of ``path``, loaded once per file (its name derives from the absolute path)."""
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = f"{_FILE_MODULES}.{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{path}: not a Python file; give path/to/file.py:Class")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _import(module: str, ref: str, base: Path | None) -> Any:
    """The module named by the part of ``ref`` before the colon: a ``.py`` path (relative to
    ``base``, else the working directory) or a dotted module name."""
    try:
        if module.endswith(".py"):
            path = Path(module).expanduser()
            if not path.is_absolute():
                path = (base or Path.cwd()) / path
            if not path.is_file():
                raise ConfigError(f"{ref!r}: no file {str(path)!r}; check the path")
            return _module_from_file(path.resolve())
        return importlib.import_module(module)
    except ConfigError:
        raise
    except ModuleNotFoundError as err:
        if module.endswith(".py") or err.name is None or not module.startswith(err.name):
            raise ConfigError(f"{ref!r}: importing it failed: {err}") from None
        raise ConfigError(
            f"{ref!r}: no module {module!r}; check the name, or give path/to/file.py:Class"
        ) from None
    except Exception as err:  # noqa: BLE001 - the user's module raised: one line naming it
        raise ConfigError(f"{ref!r}: importing it failed: {type(err).__name__}: {err}") from None


def load_object(ref: str, base: Path | None = None) -> Any:
    """The object named by ``package.module:attr`` or ``path/to/file.py:attr`` (a relative path
    from ``base``, else the working directory); one ``ConfigError`` line when it cannot be had."""
    module, sep, attr = ref.rpartition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"{ref!r}: give package.module:Class or path/to/file.py:Class")
    obj: Any = _import(module, ref, base)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{ref!r}: {module!r} has no {attr!r}; check the name")
        obj = getattr(obj, part)
    return obj


def source_of(ref: str) -> dict[str, str] | None:
    """``{"file", "sha256"}`` of the source file a reference's class lives in (None for a
    registered name: our own code), so a checkpoint can say which file it was trained with."""
    if not is_reference(ref):
        return None
    module = sys.modules.get(getattr(load_object(ref), "__module__", ""), None)
    path = getattr(module, "__file__", None)
    if not path:
        return None
    try:
        return {"file": path, "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest()}
    except OSError:
        return None


def source_changed(stored: Any, ref: str) -> str | None:
    """One line when the file a checkpoint's class came from (``stored``, as
    :func:`source_of` gave it then) differs now; None when unchanged or unknown."""
    if not isinstance(stored, dict) or "sha256" not in stored:
        return None
    now = source_of(ref)
    if now is not None and now.get("sha256") == stored["sha256"]:
        return None
    where = stored.get("file", "?")
    return f"model source {where} changed since this checkpoint was written (sha256 " + (
        f"{stored['sha256'][:12]} then, {now['sha256'][:12]} now)" if now else "unknown now)"
    )


class Registry(Generic[T]):
    """Names of one kind of component, each resolved to its object on first use.

    Parameters
    ----------
    kind : str
        What the names name, for messages ("model", "sync rule", ...).
    entries : dict
        ``name -> "module:attr"`` (imported when resolved) or the object itself.
    check : callable, optional
        ``check(obj)`` says why a resolved object cannot serve (a user's class that is not a
        model, say), or returns None; its reason becomes the one ``ConfigError`` line.

    Examples
    --------
    >>> r = Registry("codec", {"json": "json:dumps"})
    >>> r.get("json")({"a": 1}), list(r), "json" in r
    ('{"a": 1}', ['json'], True)
    >>> r.get("jsn")
    Traceback (most recent call last):
    ...
    theanompi.errors.ConfigError: unknown codec 'jsn' (did you mean 'json'?); choose from 'json', or give package.module:Class or path/to/file.py:Class
    >>> r.get("json:loads")('[1]')
    [1]
    """

    def __init__(
        self,
        kind: str,
        entries: dict[str, Any] | None = None,
        check: Callable[[Any], str | None] | None = None,
    ) -> None:
        self.kind = kind
        self._check = check
        self._entries: dict[str, Any] = dict(entries or {})

    def register(self, name: str, target: Any = None) -> Any:
        """Add ``name`` -> ``target`` (an object or ``"module:attr"``); without ``target``, a
        class decorator. A name already taken is an error: names are never silently replaced."""
        if target is None:

            def decorate(obj: Any) -> Any:
                self.register(name, obj)
                return obj

            return decorate
        if is_reference(name) or not name:
            raise ValueError(f"{self.kind} name {name!r} must be non-empty and have no ':'")
        if name in self._entries and self._entries[name] is not target:
            raise ValueError(f"{self.kind} {name!r} is registered already")
        self._entries[name] = target
        return target

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self._entries)!r})"

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._entries)

    def check(self, ref: str, base: Path | None = None) -> str:
        """``ref`` as stored in a config, once :meth:`get` resolved it (a reference is imported
        now): a ``file.py:Class`` with a relative path becomes absolute, so the ranks and a
        later ``--resume`` find the same file wherever they start."""
        self.get(ref, base)
        module, _, attr = ref.rpartition(":")
        if ref in self._entries or not module.endswith(".py"):
            return ref
        path = Path(module).expanduser()
        return f"{(path if path.is_absolute() else (base or Path.cwd()) / path).resolve()}:{attr}"

    def get(self, ref: str, base: Path | None = None) -> T:
        """The object of a registered name, a ``package.module:Class`` or a
        ``path/to/file.py:Class`` (relative to ``base``, else the working directory)."""
        if ref in self._entries:
            target = self._entries[ref]
            obj = load_object(target) if isinstance(target, str) else target
        elif isinstance(ref, str) and is_reference(ref):
            obj = load_object(ref, base)
        else:
            raise ConfigError(self._unknown(ref))
        why = self._check(obj) if self._check is not None else None
        if why:
            raise ConfigError(f"{ref!r}: {why}")
        return obj

    def _unknown(self, ref: Any) -> str:
        close = difflib.get_close_matches(str(ref), list(self._entries), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        choices = ", ".join(map(repr, self._entries))
        return (
            f"unknown {self.kind} {ref!r}{hint}; choose from {choices}, "
            "or give package.module:Class or path/to/file.py:Class"
        )
