"""Where one SGD train step's time goes, per layer kind: ours vs the same net in PyTorch CPU.

Ours comes from PyTensor's per-Apply profile (``profile=True``), torch's from
``torch.profiler`` (self CPU time of its aten ops), both in ms per step over the same steps
and shapes. Run ``python -m theanompi.bench.layers`` (``tmpi bench layers``); ``--help``
lists the options. "framework overhead" is a step's wall time outside the ops (Python, the
VM loop, autograd's engine). A second table per case gives our step's memory at its peak,
by the kind of node that made each live buffer (:func:`memory_at_peak`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

from theanompi.bench.model import CASES, build_ours, parse_cases, torch_step
from theanompi.io.atomic import write_json

__all__ = ["KINDS", "main", "profile_ours", "profile_torch"]

#: the rows of the table, in order; our conv backward is split into its two Ops below it.
#: Our batch norm rows include the ReLU fused into ``BatchNorm(relu=True)`` (ResNet-50's
#: conv -> bn -> relu sites, one Op each way); torch's ReLU there counts as elementwise.
KINDS = (
    "conv forward",
    "conv backward",
    "pool forward",
    "pool backward",
    "batch norm forward",
    "batch norm backward",
    "dense forward",
    "dense backward",
    "elementwise forward",
    "elementwise backward",
    "softmax + loss",
    "random numbers",
    "optimizer update",
    "other ops",
)
#: our conv backward is two Ops; torch's ``convolution_backward`` does both in one
CONV_SPLIT = ("conv grad weights", "conv grad inputs")
WARMUP = 3  # untimed steps before profiling: caches, OpenBLAS/OpenMP pools, mkldnn primitives

_OUR_ANCHORS = {
    "Conv2d": "conv forward",
    "Conv2dGradWeights": "conv grad weights",
    "Conv2dGradInputs": "conv grad inputs",
    "Pool2d": "pool forward",
    "Pool2dGrad": "pool backward",
    "BatchNormTrain": "batch norm forward",
    "BatchNormInfer": "batch norm forward",
    "BatchNormTrainGrad": "batch norm backward",
}
_OUR_DENSE = {"Dot22", "Dot22Scalar", "Gemm", "Gemv", "CGemv", "Ger", "CGer", "Dot", "BatchedDot"}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tmpi bench layers", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--case",
        action="append",
        metavar="MODEL:BATCH",
        help="model and batch to profile (repeatable); default small_cnn:32 small_cnn_wide:128",
    )
    ap.add_argument("--threads", type=int, default=1, help="BLAS/OpenMP/torch threads")
    ap.add_argument("--steps", type=int, default=20, help="profiled steps per side")
    ap.add_argument("--markdown", action="store_true", help="markdown tables (for docs)")
    ap.add_argument("--json", metavar="PATH", help="also write the per-kind figures as JSON")
    ap.add_argument("--_torch_child", metavar="MODEL:BATCH", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# -- ours ----------------------------------------------------------------------------------


def _zero_kinds() -> dict[str, float]:
    """Our per-kind totals, all 0: :data:`KINDS` with the conv backward split in two."""
    zero = dict.fromkeys((*KINDS, *CONV_SPLIT), 0.0)
    zero.pop("conv backward")
    return zero


def _our_kinds(fn: Any) -> dict[Any, str]:
    """Each Apply of compiled ``fn`` -> its kind (a :data:`KINDS` entry or a :data:`CONV_SPLIT`).

    Forward nodes are the ancestors of the returned outputs (loss, top-1); the rest compute
    gradients and updates. An Elemwise writing a shared variable's new value is the update
    (PyTensor fuses momentum and decay into one Composite per parameter). The softmax and
    loss are the forward nodes that feed no layer Op (after the logits) and the gradient
    nodes that follow them before any gradient layer Op does.
    """
    from pytensor.graph.traversal import apply_ancestors
    from pytensor.tensor.elemwise import Elemwise
    from pytensor.tensor.random.op import RandomVariable

    fg = fn.maker.fgraph
    nodes = fg.toposort()
    n_out = fn._n_returned_outputs
    forward = set(apply_ancestors(fg.outputs[:n_out]))
    update_vars = set(fg.outputs[n_out:])

    def anchor(node: Any) -> str | None:
        name = type(node.op).__name__
        if name in _OUR_ANCHORS:
            return _OUR_ANCHORS[name]
        if name in _OUR_DENSE:
            return "dense forward" if node in forward else "dense backward"
        return None

    anchors = {n for n in nodes if anchor(n) is not None}
    feeds_layer = set(apply_ancestors([i for n in anchors & forward for i in n.inputs]))
    after_grad_layer: set[Any] = set()  # backward nodes downstream of a gradient layer Op
    loss: set[Any] = set()  # forward after the last layer Op, backward before the first one
    kinds = {}
    for n in nodes:  # topological: parents first
        owners = {i.owner for i in n.inputs}
        if owners & ((anchors - forward) | after_grad_layer):
            after_grad_layer.add(n)
        kind = anchor(n)
        if kind is None:
            if isinstance(n.op, RandomVariable):
                kind = "random numbers"
            elif isinstance(n.op, Elemwise) and update_vars.intersection(n.outputs):
                kind = "optimizer update"
            elif n in forward and n not in feeds_layer:
                kind = "softmax + loss"
            elif n not in forward and n not in after_grad_layer and owners & loss:
                kind = "softmax + loss"
            elif isinstance(n.op, Elemwise):
                kind = "elementwise forward" if n in forward else "elementwise backward"
            else:
                kind = "other ops"
        if kind == "softmax + loss":
            loss.add(n)
        kinds[n] = kind
    return kinds


def profile_ours(name: str, batch: int, steps: int) -> dict[str, Any]:
    """Profile ``steps`` train steps of case ``name`` at ``batch`` (after :data:`WARMUP`).

    Returns ``kinds`` (ms/step per kind, :data:`CONV_SPLIT` separate), ``thunks_ms`` (all
    Apply time per step, as PyTensor's profile sums it) and ``step_ms`` (wall per step).
    The model is built with PyTensor's ``profile`` flag on (scoped, so nothing prints at
    exit), so its own train function is profiled and the steps run through
    ``Model.train_step`` as in training.
    """
    import pytensor

    with pytensor.config.change_flags(profile=True):
        r = build_ours(CASES[name], batch)
    fn = r["model"]._fn("train")
    for _ in range(WARMUP):
        r["step"]()
    fn.profile.reset()
    t0 = time.perf_counter()
    for _ in range(steps):
        r["step"]()
    wall = time.perf_counter() - t0
    times = fn.profile.apply_time
    fg = fn.maker.fgraph
    per_kind = _zero_kinds()
    for node, kind in _our_kinds(fn).items():
        per_kind[kind] += times.get((fg, node), 0.0)
    ms = 1e3 / steps
    return {
        "kinds": {k: v * ms for k, v in per_kind.items()},
        "thunks_ms": sum(times.values()) * ms,
        "step_ms": wall * ms,
    }


def _buffer_of(var: Any) -> Any:
    """The variable whose memory ``var`` lives in: through views and in-place outputs."""
    while var.owner is not None:
        op, k = var.owner.op, var.owner.outputs.index(var)
        into = getattr(op, "view_map", {}).get(k) or getattr(op, "destroy_map", {}).get(k)
        if not into:
            break
        var = var.owner.inputs[into[0]]
    return var


def memory_at_peak(fn: Any) -> dict[str, Any]:
    """Where the memory of one call of compiled ``fn`` goes at its peak, by kind.

    ``fn`` must have run once with ``allow_gc`` off, so that every intermediate array is still
    in its storage. Walking the VM's node order, each output buffer lives from its node to its
    last reader (a view or in-place output shares its input's buffer; the function's outputs
    live to the end). Returns ``peak_mb`` (the intermediates alive at the worst node),
    ``kinds`` (those MB by the kind of the node that made them, as :func:`_our_kinds`) and
    ``state_mb`` (the inputs: shared parameters, optimizer state, the batch). Our Ops'
    persistent scratch (patch matrices) and the Python process are not in these figures.
    """
    import numpy as np

    storage, nodes, fg = fn.vm.storage_map, fn.vm.nodes, fn.maker.fgraph
    kinds = _our_kinds(fn)

    def nbytes(v: Any) -> int:
        value = storage.get(v, [None])[0]
        return int(value.nbytes) if isinstance(value, np.ndarray) else 0

    end: dict[Any, int] = {}  # buffer -> position of its last reader
    for t, n in enumerate(nodes):
        for v in n.inputs:
            end[_buffer_of(v)] = t
    for v in fg.outputs:
        end[_buffer_of(v)] = len(nodes)
    made = [  # (made at, last read at, buffer) for each output that owns its memory
        (t, end.get(out, t), out)
        for t, n in enumerate(nodes)
        for out in n.outputs
        if _buffer_of(out) is out
    ]
    alive = np.zeros(len(nodes) + 1)
    for t0, t1, b in made:
        alive[t0 : t1 + 1] += nbytes(b)
    worst = int(alive.argmax())
    per_kind = _zero_kinds()
    for t0, t1, b in made:
        if t0 <= worst <= t1:
            per_kind[kinds[b.owner]] += nbytes(b) / 2**20
    state = sum(nbytes(v) for v in fg.inputs)
    return {"peak_mb": alive[worst] / 2**20, "kinds": per_kind, "state_mb": state / 2**20}


def memory_ours(name: str, batch: int) -> dict[str, Any]:
    """:func:`memory_at_peak` of case ``name``'s train step at ``batch`` (its own build, with
    ``allow_gc`` off for one step), plus the parameters' MB."""
    import pytensor

    with pytensor.config.change_flags(allow_gc=False):
        r = build_ours(CASES[name], batch)
    r["step"]()
    out = memory_at_peak(r["model"]._fn("train"))
    out["params_mb"] = 4 * r["model"].n_params() / 2**20
    return out


# -- torch ---------------------------------------------------------------------------------

_TORCH_OPS = {
    "conv forward": (
        "conv2d",
        "convolution",
        "_convolution",
        "mkldnn_convolution",
        "_slow_conv2d_forward",
        "thnn_conv2d",
    ),
    "conv backward": ("convolution_backward", "_slow_conv2d_backward"),
    "pool forward": ("max_pool2d", "max_pool2d_with_indices", "avg_pool2d"),
    "pool backward": ("max_pool2d_with_indices_backward", "avg_pool2d_backward"),
    "batch norm forward": (
        "batch_norm",
        "_batch_norm_impl_index",
        "native_batch_norm",
        "_native_batch_norm_legit",
        "_batch_norm_with_update",
    ),
    "batch norm backward": ("native_batch_norm_backward", "batch_norm_backward"),
    "dense": ("linear", "addmm", "mm", "matmul", "bmm"),
    "softmax + loss": (
        "cross_entropy_loss",
        "log_softmax",
        "_log_softmax",
        "_log_softmax_backward_data",
        "nll_loss_nd",
        "nll_loss",
        "nll_loss_forward",
        "nll_loss_backward",
    ),
    "random numbers": ("bernoulli_", "uniform_", "normal_"),
    "elementwise": (
        "relu",
        "relu_",
        "clamp_min",
        "clamp_min_",
        "threshold_backward",
        "dropout",
        "native_dropout",
        "native_dropout_backward",
        "mul",
        "mul_",
        "div",
        "div_",
        "add",
        "add_",
    ),
}
_TORCH_KIND = {f"aten::{op}": kind for kind, ops in _TORCH_OPS.items() for op in ops}
_STEP_MARK = "tmpi.step"


def _torch_event_kind(ev: Any) -> str | None:
    """Kind of one aten event: its own, else its nearest classified caller's (``aten::empty``
    under a convolution is the convolution's), else "other ops"; None for non-aten events
    (Python, autograd's engine, optimizer wrappers: framework overhead)."""
    if not ev.name.startswith("aten::"):
        return None
    chain = []
    node, phase = ev, "forward"
    while node is not None:
        chain.append(node.name)
        if node.name.startswith("Optimizer.step"):
            return "optimizer update"
        if node.name.startswith("autograd::engine::evaluate_function"):
            phase = "backward"
        node = node.cpu_parent
    for name in chain:
        kind = _TORCH_KIND.get(name)
        if kind in ("dense", "elementwise"):
            return f"{kind} {phase}"
        if kind is not None:
            return kind
    return "other ops"


def profile_torch(name: str, batch: int, steps: int, threads: int) -> dict[str, Any]:
    """Profile ``steps`` SGD steps of the torch twin of case ``name`` (``torch.profiler``,
    CPU): ``kinds`` (self CPU ms/step), ``ops_ms`` (their sum), ``step_ms`` (wall per step,
    as the profiler times the step), all over the steps marked ``tmpi.step``."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from theanompi.models import create_model

    model = create_model({**CASES[name], "batch_size": batch})
    step = torch_step(model, batch, threads)
    for _ in range(WARMUP):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()  # unmarked: the profiler's own first-step costs stay out of the figures
        for _ in range(steps):
            with record_function(_STEP_MARK):
                step()
    per_kind = dict.fromkeys(KINDS, 0.0)
    step_us = 0.0
    for ev in prof.events():
        top = ev
        while top.cpu_parent is not None:
            top = top.cpu_parent
        if top.name != _STEP_MARK:
            continue
        if ev is top:
            step_us += ev.cpu_time_total
        kind = _torch_event_kind(ev)
        if kind is not None:
            per_kind[kind] += ev.self_cpu_time_total
    ms = 1e-3 / steps
    return {
        "kinds": {k: v * ms for k, v in per_kind.items()},
        "ops_ms": sum(per_kind.values()) * ms,
        "step_ms": step_us * ms,
    }


def _torch_child(spec: str, steps: int, threads: int) -> int:
    """Child process: profile the torch side of MODEL:BATCH and print it as JSON (a process
    of its own keeps torch's OpenMP and our thread settings apart, as ``bench model`` does)."""
    import torch  # noqa: F401 - first: its OpenMP reads the environment before ours is set

    name, _, b = spec.partition(":")
    print(json.dumps(profile_torch(name, int(b), steps, threads)), flush=True)
    return 0


def _run_torch(name: str, batch: int, steps: int, threads: int) -> dict[str, Any] | None:
    """The torch side in a child process; None (after a message) if torch cannot run."""
    from theanompi.pytensor_env import unconfigured_env

    cmd = [sys.executable, "-m", "theanompi.bench.layers", "--_torch_child", f"{name}:{batch}"]
    proc = subprocess.run(
        [*cmd, "--steps", str(steps), "--threads", str(threads)],
        capture_output=True,
        text=True,
        env=unconfigured_env(),
        check=False,
    )
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"tmpi bench layers: the PyTorch side failed ({last}); skipping its column")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- table ---------------------------------------------------------------------------------


def _rows(ours: dict[str, Any], torch: dict[str, Any] | None) -> list[tuple[str, float, float]]:
    """(kind, ours ms, torch ms) rows: the kinds, our conv split, the totals (nan: none)."""
    nan = float("nan")
    k = dict(ours["kinds"])
    k["conv backward"] = sum(k[c] for c in CONV_SPLIT)
    t = torch["kinds"] if torch else {}
    rows = []
    for kind in KINDS:
        rows.append((kind, k[kind], t.get(kind, nan)))
        if kind == "conv backward":
            rows += [(f"  of which {c[5:]} (ours)", k[c], nan) for c in CONV_SPLIT]
    ours_ops = sum(k[c] for c in KINDS)
    torch_ops = torch["ops_ms"] if torch else nan
    rows.append(("ops total", ours_ops, torch_ops))
    rows.append(
        (
            "framework overhead",
            ours["step_ms"] - ours_ops,
            torch["step_ms"] - torch_ops if torch else nan,
        )
    )
    rows.append(("step total", ours["step_ms"], torch["step_ms"] if torch else nan))
    return rows


def _fmt(v: float, digits: int = 2) -> str:
    return "—" if v != v else f"{v:.{digits}f}"


def table(
    name: str,
    batch: int,
    threads: int,
    ours: dict[str, Any],
    torch: dict[str, Any] | None,
    markdown: bool,
) -> str:
    """One case's table: kind | ours ms/step | torch ms/step | ours/torch."""
    rows = _rows(ours, torch)
    title = f"{name} batch {batch}, {threads} thread(s): ms per train step"
    cells = [
        (kind, _fmt(o), _fmt(t), _fmt(o / t if t > 0 else float("nan"))) for kind, o, t in rows
    ]
    head = ("kind", "ours ms/step", "torch ms/step", "ours/torch")
    bold = {"step total"}
    if markdown:
        lines = [f"**{title}**", "", "| " + " | ".join(head) + " |", "|---|---:|---:|---:|"]
        for c in cells:
            c = tuple(f"**{x}**" for x in c) if c[0] in bold else c
            lines.append("| " + " | ".join(c) + " |")
        return "\n".join(lines)
    w = max(len(c[0]) for c in cells)
    lines = [title, f"{head[0]:<{w}}  {head[1]:>12}  {head[2]:>13}  {head[3]:>10}"]
    lines += [f"{a:<{w}}  {b:>12}  {c:>13}  {d:>10}" for a, b, c, d in cells]
    return "\n".join(lines)


def memory_table(name: str, batch: int, mem: dict[str, Any], markdown: bool) -> str:
    """One case's memory at the step's peak: kind | MB, then the totals and x parameters."""
    rows = [(k, v) for k, v in mem["kinds"].items() if v >= 0.05]
    rows.sort(key=lambda r: -r[1])
    rows += [
        ("intermediates at the peak", mem["peak_mb"]),
        ("inputs (parameters, optimizer state, batch)", mem["state_mb"]),
        ("graph total", mem["peak_mb"] + mem["state_mb"]),
    ]
    ratio = (mem["peak_mb"] + mem["state_mb"]) / mem["params_mb"]
    title = (
        f"{name} batch {batch}: MB alive at the train step's peak, by the kind that made them "
        f"(graph total {ratio:.1f} x the {mem['params_mb']:.1f} MB of parameters)"
    )
    if markdown:
        lines = [f"**{title}**", "", "| made by | MB |", "|---|---:|"]
        return "\n".join(lines + [f"| {k} | {v:.1f} |" for k, v in rows])
    w = max(len(k) for k, _ in rows)
    return "\n".join([title] + [f"{k:<{w}}  {v:>9.1f}" for k, v in rows])


def main(argv: list[str] | None = None) -> int:
    """Print one per-kind table per case; return 0 (2 on a bad ``--case``)."""
    args = _parse(argv)
    if args.threads < 1 or args.steps < 1:
        print(
            f"tmpi bench layers: --threads and --steps must be >= 1, got {args.threads}, {args.steps}"
        )
        return 2
    if args._torch_child:
        return _torch_child(args._torch_child, args.steps, args.threads)
    from theanompi.pytensor_env import configure

    configure(blas_threads=args.threads)
    cases = parse_cases(args.case or ["small_cnn:32", "small_cnn_wide:128"], "tmpi bench layers")
    if cases is None:
        return 2
    from theanompi.bench._machine import describe, machine_line

    results: list[dict[str, Any]] = []
    for name, batch in cases:
        ours = profile_ours(name, batch, args.steps)
        if not results:  # PyTensor's BLAS is loaded now: the kernel it picked can be named
            machine = describe()
            print(machine_line(machine), end="\n\n", flush=True)
        torch = _run_torch(name, batch, args.steps, args.threads)
        mem = memory_ours(name, batch)
        results.append(
            {
                "model": name,
                "batch": batch,
                "threads": args.threads,
                "machine": machine,
                "ours": ours,
                "torch": torch,
                "memory": mem,
            }
        )
        print(table(name, batch, args.threads, ours, torch, args.markdown), end="\n\n")
        print(memory_table(name, batch, mem, args.markdown), end="\n\n", flush=True)
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
