"""PyTensor's module cache, found through an index instead of by unpickling every ``key.pkl``.

PyTensor's ``ModuleCache`` unpickles the ``key.pkl`` of every module in the compile dir when
a process first links a graph (its keys hold Ops, some with graphs of their own): 0.4 s for
370 modules, in every rank of every run, growing with the cache, although a run needs a few
dozen of them. :class:`IndexedModuleCache` starts empty and keeps an index beside the
modules, ``<name> <module folder>`` lines, where a name is the digest of a pickled key or
the module's code hash (for keys whose pickle differs from process to process). A key
missing from memory is looked up there, and only that folder's ``key.pkl`` is unpickled and
checked to hold an equal key (or that code). A key the index lacks falls back to PyTensor's
own path (a full walk of the folder under its lock, before any compile), after which its
names are added, so the next process finds it. An index line is a hint, never trusted: a
wrong or stale line only costs the walk."""

from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path
from typing import Any

from pytensor.link.c import cmodule

__all__ = ["INDEX_FILE", "IndexedModuleCache", "has_module_hash", "install", "key_digest"]

#: in the compile dir: ``<digest> <module folder>`` lines, appended by every process
INDEX_FILE = "theanompi-key-index.txt"


def key_digest(key: Any) -> str | None:
    """A digest of the pickled ``key``: equal bytes unpickle to equal keys; None if unpicklable."""
    try:
        data = pickle.dumps(key, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - PyTensor keeps such keys out of its files too
        return None
    return hashlib.blake2b(data, digest_size=16).hexdigest()


class IndexedModuleCache(cmodule.ModuleCache):
    """A ``ModuleCache`` that loads a module's key data when a key or a module hash asks for it.

    The index maps two kinds of names to a module folder: the digest of a key (32 hex digits)
    and a module hash (PyTensor's ``m`` and 32 hex digits of the code), which finds a module
    compiled for another key with the same code.
    """

    def __init__(self, dirname: Path | str, **kwargs: Any) -> None:
        kwargs["do_refresh"] = False
        super().__init__(dirname, **kwargs)
        self.index_path = self.dirname / INDEX_FILE
        self._index: dict[str, str] | None = None  # name -> module folder
        self._noted: set[str] = set()  # names (and module files) this process checked
        self._first_digest: dict[Any, str | None] = {}  # key -> its digest when first asked
        self.walked = False  # a full refresh ran: the age clean-up at exit may run too

    def _read_index(self) -> dict[str, str]:
        if self._index is None:
            self._index = {}
            try:
                text = self.index_path.read_text()
            except OSError:
                text = ""
            for line in text.splitlines():
                name, _, folder = line.partition(" ")
                if folder and "/" not in folder:
                    self._index[name] = folder
        return self._index

    def _note(self, name: str | None, entry: str) -> None:
        """Put ``name`` (a key digest or a module hash) in the index unless there; once per
        process. Deduplicated by name, not by key: equal keys can pickle to different bytes
        (pickle's memo follows object identity), and each digest must find the module.
        One ``write`` of one short line: atomic beside other processes' appends."""
        if name is None or name in self._noted:
            return
        self._noted.add(name)
        folder = os.path.basename(os.path.dirname(entry))
        index = self._read_index()
        if index.get(name) == folder:
            return
        index[name] = folder
        try:
            fd = os.open(self.index_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError:
            return  # a read-only cache: every process walks it
        try:
            os.write(fd, f"{name} {folder}\n".encode())
        finally:
            os.close(fd)

    def _load(self, name: str | None, fits: Any) -> None:
        """Register the key data of ``name``'s folder, as ``refresh`` would, if ``fits`` it."""
        folder = self._read_index().get(name) if name else None
        if folder is None:
            return
        root = os.path.join(self.dirname, folder)
        key_pkl = os.path.join(root, "key.pkl")
        if key_pkl in self.loaded_key_pkl:
            return
        try:
            entry = cmodule.module_name_from_dir(root, err=False)
            with open(key_pkl, "rb") as f:
                key_data = pickle.load(f)
        except Exception:  # noqa: BLE001 - gone, half-written, or foreign: PyTensor's walk decides
            return
        if (
            entry is None
            or not isinstance(key_data, cmodule.KeyData)
            or key_data.get_entry() != entry
            or not fits(key_data)
            or key_data.module_hash in self.module_hash_to_key_data
            or any(k in self.entry_from_key or not k[0] for k in key_data.keys)
        ):
            return
        self.module_hash_to_key_data[key_data.module_hash] = key_data
        for k in key_data.keys:
            self.entry_from_key[k] = entry
            self.similar_keys.setdefault(cmodule.get_safe_part(k), []).append(k)
        self.loaded_key_pkl.add(key_pkl)

    def _get_from_key(self, key: Any, key_data: Any = None) -> Any:
        if key is None or not key[0]:  # by key data, or unversioned (PyTensor keeps those apart)
            return super()._get_from_key(key, key_data)
        digest = self._digest(key)
        if key not in self.entry_from_key:
            self._load(digest, lambda kd: key in kd.keys)
        module = super()._get_from_key(key)
        if module is not None:
            self._note(digest, module.__file__)
            self._note_hash(module.__file__)
        return module

    def _note_hash(self, entry: str) -> None:
        """Put the module hash of ``entry`` in the index: a key whose digest differs in the
        next process (the inner graph of a ``Composite`` pickles with names that count the
        variables made before it) is found by its code's hash instead."""
        if entry in self._noted:
            return
        self._noted.add(entry)
        for key_data in self.module_hash_to_key_data.values():
            if key_data.get_entry() == entry:
                self._note(key_data.module_hash, entry)
                return

    def _digest(self, key: Any) -> str | None:
        """The digest of ``key`` as first asked for in this process. An Op's pickle can change
        once its C code is generated (a ``Composite``'s inner graph does), and a fresh process
        looks a key up before that: the index must hold the digest of that first state."""
        if key not in self._first_digest:
            self._first_digest[key] = key_digest(key)
        return self._first_digest[key]

    def has_module_hash(self, module_hash: str) -> bool:
        """Whether a module of this code is cached (found through the index if not loaded)."""
        if module_hash not in self.module_hash_to_key_data:
            self._load(module_hash, lambda kd: kd.module_hash == module_hash)
        key_data = self.module_hash_to_key_data.get(module_hash)
        if key_data is None:
            return False
        self._note(module_hash, key_data.get_entry())
        return True

    def _get_from_hash(self, module_hash: str, key: Any) -> Any:
        self.has_module_hash(module_hash)
        if key in self.entry_from_key:  # the folder found by its hash holds this very key
            return super()._get_from_key(key)  # (PyTensor's would add it again, and assert)
        return super()._get_from_hash(module_hash, key)

    def _update_mappings(self, key: Any, key_data: Any, name: str, check_in_keys: bool) -> None:
        super()._update_mappings(key, key_data, name, check_in_keys)
        if key[0]:  # a module compiled now, or a new key of one compiled before (same code)
            self._note(self._digest(key), name)
            self._note(key_data.module_hash, name)

    def refresh(self, *args: Any, **kwargs: Any) -> Any:
        self.walked = True
        return super().refresh(*args, **kwargs)

    def _on_atexit(self) -> None:
        """PyTensor's age clean-up walks every folder: only where this process walked anyway."""
        if self.walked:
            super()._on_atexit()
        else:
            self.clear_unversioned()


def has_module_hash(cache: Any, module_hash: str) -> bool:
    """Whether ``cache`` (indexed or PyTensor's own) holds a module of this code."""
    if isinstance(cache, IndexedModuleCache):
        return cache.has_module_hash(module_hash)
    return module_hash in cache.module_hash_to_key_data


def install() -> None:
    """Make PyTensor's module cache an :class:`IndexedModuleCache`, unless one already exists."""
    import atexit

    from pytensor.configdefaults import config

    if cmodule._module_cache is None:
        cmodule._module_cache = IndexedModuleCache(config.compiledir)
        atexit.register(cmodule._module_cache._on_atexit)
