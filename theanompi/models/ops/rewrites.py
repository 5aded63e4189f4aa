"""Graph rewrites registered in PyTensor's own database, so every function compiled after
``import theanompi.models`` gets them: ours, and the user's models too.

``inline_softmax``: PyTensor 3 builds ``softmax`` and ``log_softmax`` as ``SymbolicOp`` s that
are not inlined, so each runs as a Python ``perform`` calling a compiled inner function: about
1-2 ms a call whatever the batch, 6 % of a small CNN's step at b=32 (``profile=True``). In the
``specialize`` phase (after ``stabilize`` has used them to recognise ``log(softmax(x))``) they
are replaced by their inner graphs, which the C ``Elemwise`` fusion then compiles.
"""

from __future__ import annotations

from typing import Any

from pytensor.graph import node_rewriter
from pytensor.tensor.rewriting.basic import register_specialize
from pytensor.tensor.rewriting.ofg import inline_ofg_node
from pytensor.tensor.special import LogSoftmax, Softmax

__all__ = ["inline_softmax"]


@register_specialize("theanompi")
@node_rewriter([Softmax, LogSoftmax])
def inline_softmax(fgraph: Any, node: Any) -> Any:
    """Replace a ``Softmax``/``LogSoftmax`` node by its inner graph."""
    return inline_ofg_node(node)
