"""Rewritten graphs kept in the compile dir, so that a process does not rewrite a graph that
another process on the node (or an earlier run) has already rewritten.

PyTensor rewrites every function's graph in every process: 0.6 s of each rank's 2.1 s start
under ``tmpi train -n 2`` on digits, 8 s of ResNet-50's build, and about a quarter of the test
suite's CPU time (hundreds of 2-rank jobs). Theano could keep rewritten graphs
(``cache_optimizations``); PyTensor dropped it. :class:`CachedRewriteMaker` keys a graph,
before it is rewritten, by a digest of its structure (every Apply's Op, every Variable's type
and name, every constant's value), the input and output specs (mutable, borrowed, updated),
the rewrites asked for, PyTensor's config, the PyTensor, NumPy and Python versions, and the
code of our own Ops and rewrites (:mod:`theanompi.models.ops`). On a hit it puts the kept
rewritten outputs in place of the graph's own, with the kept node orderings, so that the nodes
run in the order of the process that rewrote them; on a miss it rewrites as PyTensor does and
keeps the result (written atomically: ranks that miss together write the same file). Inputs,
shared variables among them, are kept as their positions, never their values, so a hit reads
and updates the current values. Anything unexpected falls back to rewriting.

``THEANOMPI_GRAPH_CACHE=0`` turns it off (needed only while editing graph rewrites of one's
own outside theanompi: the key does not see their code); a path there keeps the graphs in it.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytensor
from pytensor.compile.maker import FunctionMaker
from pytensor.compile.mode import Mode
from pytensor.graph.basic import Variable
from pytensor.graph.features import Feature
from pytensor.graph.fg import FunctionGraph, Output

from theanompi.io.atomic import atomic_write

__all__ = [
    "CACHE_DIR",
    "CachedRewriteMaker",
    "CachedRewriteMode",
    "cache_dir",
    "graph_key",
    "stats",
]

#: in the compile dir: one ``<digest>.pkl`` per rewritten graph
CACHE_DIR = "theanompi-graphs"
#: bumped when what a kept graph holds changes
_FORMAT = 2
#: this process's hits and misses (the tests read them)
stats = {"hit": 0, "miss": 0}
_stamp: str | None = None


def cache_dir() -> Path | None:
    """Where rewritten graphs are kept: ``$THEANOMPI_GRAPH_CACHE`` when it is a path, none when
    it is ``0``/``off``, else ``theanompi-graphs`` in PyTensor's compile dir."""
    env = os.environ.get("THEANOMPI_GRAPH_CACHE", "").strip()
    if env.lower() in ("0", "off", "no", "false"):
        return None
    if env and env.lower() not in ("1", "on", "yes", "true"):
        return Path(env)
    return Path(pytensor.config.compiledir) / CACHE_DIR


def _code_stamp() -> str:
    """What the rewrites' code is: PyTensor's, NumPy's and Python's versions and a digest of
    the files of our own rewrites and Ops (once a process: ~1 ms)."""
    global _stamp
    if _stamp is None:
        h = hashlib.sha256()
        for f in sorted(Path(__file__).parent.glob("*.py")):
            h.update(f.name.encode() + f.read_bytes())
        _stamp = "|".join([h.hexdigest(), pytensor.__version__, np.__version__, sys.version])
        _stamp += f"|{_FORMAT}"
    return _stamp


class _GraphPickler(pickle.Pickler):
    """Pickles the rewritten outputs with the graph's inputs as their positions."""

    def __init__(self, file: io.BytesIO, inputs: list[Variable]) -> None:
        super().__init__(file, protocol=5)
        self._inputs = {id(v): i for i, v in enumerate(inputs)}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, Variable) and id(obj) in self._inputs:
            return ("in", self._inputs[id(obj)])
        return None


class _KeyPickler(_GraphPickler):
    """Pickles a graph for its digest: inputs as their positions, Variables without their
    process-local ``auto_name`` and ``tag`` (traces) but for ``indestructible``."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, FunctionGraph):  # an inner graph (OpFromGraph): its sets and timings
            return (_inner_graph, (list(obj.inputs), list(obj.outputs)))
        if not isinstance(obj, Variable):
            return NotImplemented
        # (the Variables of Composite Ops' frozen inner graphs pickle as their place already)
        if "__reduce__" not in type(obj).__dict__ and "__reduce_ex__" not in obj.__dict__:
            state = {k: v for k, v in obj.__dict__.items() if k not in ("auto_name", "tag")}
            state["indestructible"] = _indestructible(obj)  # the one tag rewrites read
            return (object.__new__, (type(obj),), state)
        return NotImplemented


def _indestructible(v: Variable) -> bool:
    """Whether in-place Ops must leave ``v`` alone (``tag.indestructible``)."""
    return bool(getattr(v.tag, "indestructible", False))


def _inner_graph(inputs: list[Variable], outputs: list[Variable]) -> None:
    """Stands for an inner FunctionGraph in a key (never called: keys are not unpickled)."""


class _GraphUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, inputs: list[Variable]) -> None:
        super().__init__(file)
        self._inputs = inputs

    def persistent_load(self, pid: Any) -> Any:
        kind, i = pid
        if kind != "in":
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        return self._inputs[i]


def graph_key(fgraph: Any, inputs: list[Any], outputs: list[Any], mode: Any) -> str | None:
    """The digest of ``fgraph`` before rewriting, with everything that decides its rewrite
    (None: the mode's rewrites cannot be named, so the graph is not kept)."""
    asked = _rewrites_asked(mode.provided_optimizer)
    if asked is None:
        return None
    buf = io.BytesIO()
    _KeyPickler(buf, list(fgraph.inputs)).dump(
        (
            [(v.type, _indestructible(v)) for v in fgraph.inputs],
            list(fgraph.outputs),
            sorted(fgraph.update_mapping.items()),
            [(bool(i.mutable), bool(i.borrow), i.update is not None) for i in inputs],
            [bool(o.borrow) for o in outputs],
        )
    )
    h = hashlib.sha256(buf.getvalue())
    h.update(asked.encode())
    h.update(_config_values().encode())
    h.update(_code_stamp().encode())
    return h.hexdigest()


def _rewrites_asked(query: Any) -> str | None:
    """The mode's rewrite query (tags asked for, left out, required) as text that does not
    change between processes; None for a query or rewriter that text cannot name."""
    if isinstance(query, str):
        return query
    if not hasattr(query, "include") or query.subquery or query.extra_rewrites:
        return None
    return repr(
        (sorted(query.include), sorted(query.exclude), sorted(query.require), query.position_cutoff)
    )


def _config_values() -> str:
    """Every PyTensor config value (floatX, BLAS flags, rewrites left out...), as text."""
    c = pytensor.config
    parts = []
    for name in sorted(c._config_var_dict):
        try:
            parts.append(f"{name}={getattr(c, name)!r}")
        except Exception as err:  # a value PyTensor cannot work out here
            parts.append(f"{name}=<{type(err).__name__}>")
    return "\n".join(parts)


def _load(path: Path, fgraph: Any) -> tuple[list[Variable], dict[Any, list[Any]]] | None:
    """The kept rewritten outputs and node orderings at ``path`` on ``fgraph``'s inputs; None
    where there are none (or they do not fit)."""
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    try:
        outs, orderings = _GraphUnpickler(io.BytesIO(blob), list(fgraph.inputs)).load()
    except Exception:  # a torn or foreign file: rewrite instead
        return None
    if not isinstance(outs, list) or len(outs) != len(fgraph.outputs):
        return None
    if not all(old.type.is_super(new.type) for old, new in zip(fgraph.outputs, outs, strict=True)):
        return None  # checked before anything changes: a failed transplant would leave half
    return outs, dict(orderings)


def _save(path: Path, fgraph: Any) -> None:
    """Keep ``fgraph``'s rewritten outputs and its node orderings (in-place Ops after the other
    readers of what they overwrite), which decide the order its nodes run in."""
    buf = io.BytesIO()
    try:
        orderings = list(fgraph.orderings().items())
        _GraphPickler(buf, list(fgraph.inputs)).dump((list(fgraph.outputs), orderings))
        with atomic_write(path) as tmp:
            tmp.write_bytes(buf.getvalue())
    except Exception:  # an Op that does not pickle, a full disk: the next process rewrites
        return


class _KeptOrderings(Feature):
    """The node orderings of the process that rewrote the graph, for the linker's toposort: the
    nodes then run in that process's order (a DestroyHandler would work them out again, in an
    order that depends on how the graph was built)."""

    def __init__(self, orderings: dict[Any, list[Any]]) -> None:
        self._orderings = orderings

    def orderings(self, fgraph: Any) -> dict[Any, list[Any]]:
        return {node: list(before) for node, before in self._orderings.items()}


def _transplant(fgraph: Any, outs: list[Variable], orderings: dict[Any, list[Any]]) -> None:
    """Put the kept rewritten ``outs`` in place of ``fgraph``'s outputs (the unused nodes go),
    with the kept orderings."""
    for i, new in enumerate(outs):
        old = fgraph.outputs[i]
        node = next(n for n, _ in fgraph.clients[old] if isinstance(n.op, Output) and n.op.idx == i)
        fgraph.change_node_input(node, 0, new, reason="theanompi graph cache")
    fgraph.attach_feature(_KeptOrderings(orderings))


class CachedRewriteMaker(FunctionMaker):
    """PyTensor's FunctionMaker whose rewrite step reads and keeps rewritten graphs."""

    def prepare_fgraph(  # type: ignore[override]
        self,
        inputs: list[Any],
        outputs: list[Any],
        additional_outputs: list[Any],
        fgraph: Any,
        mode: Any,
        profile: Any,
    ) -> None:
        where, path = cache_dir(), None
        if where is not None:
            try:
                key = graph_key(fgraph, inputs, outputs + additional_outputs, mode)
            except Exception:  # an Op that does not pickle: rewrite as usual, keep nothing
                key = None
            path = where / f"{key}.pkl" if key else None
        if path is not None:
            kept = _load(path, fgraph)
            if kept is not None:
                _transplant(fgraph, *kept)
                stats["hit"] += 1
                return
        FunctionMaker.prepare_fgraph(inputs, outputs, additional_outputs, fgraph, mode, profile)
        if path is not None:
            stats["miss"] += 1
            _save(path, fgraph)


class CachedRewriteMode(Mode):
    """A Mode whose functions are made by :class:`CachedRewriteMaker`."""

    @property
    def function_maker(self) -> type[FunctionMaker]:
        return CachedRewriteMaker
