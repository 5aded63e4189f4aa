"""Benchmark a model's train step: ours (PyTensor C) vs the same net in PyTorch CPU, the GEMM
floor, our peak resident memory per case (``VmHWM``, and its ratio to the parameter bytes),
and compile time with a cold and a warm compile cache.

Run ``python -m theanompi.bench.model`` (``tmpi bench model``); ``--help`` lists the options.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from theanompi.bench._memory import MB, param_bytes, peak_rss_bytes, reset_peak_rss, rss_bytes
from theanompi.io.atomic import write_json

__all__ = ["main"]

CASES = {
    "alexnet": dict(name="alexnet", input_size=227, channels=3, n_classes=1000),
    "small_cnn": dict(name="small_cnn", input_size=28, channels=3, n_classes=10),
    # the digits CNN widened as the two-node bench trains it (3.3 M parameters, issue 26)
    "small_cnn_wide": dict(
        name="small_cnn",
        input_size=28,
        channels=3,
        n_classes=10,
        arch={"channels": [32, 64], "fc": 1024, "dropout": 0.25},
    ),
    "googlenet": dict(name="googlenet", input_size=224, channels=3, n_classes=1000),
    "vgg16": dict(name="vgg16", input_size=224, channels=3, n_classes=1000),
    "resnet50": dict(name="resnet50", input_size=224, channels=3, n_classes=1000),
    "mlp": dict(name="mlp", input_size=28, channels=3, n_classes=10),
}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tmpi bench model", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--case",
        action="append",
        metavar="MODEL:BATCH",
        help="model and batch to time (repeatable); default alexnet:32 alexnet:128 small_cnn:32",
    )
    ap.add_argument("--steps", type=int, default=5, help="timed steps per block (median reported)")
    ap.add_argument(
        "--rounds", type=int, default=3, help="blocks of steps, ours and PyTorch alternating"
    )
    ap.add_argument("--threads", type=int, default=None, help="BLAS/torch threads (default: cores)")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch side")
    ap.add_argument(
        "--backend",
        choices=["c", "jax"],
        default="c",
        help="jax: also time training.backend jax (XLA, its own threads) beside C and PyTorch",
    )
    ap.add_argument("--no-compile", action="store_true", help="skip the cold/warm compile timing")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--_compile_only", metavar="MODEL", help=argparse.SUPPRESS)
    ap.add_argument("--_torch_child", metavar="MODEL:BATCH", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _train_flops(model: Any) -> float:
    """FLOPs of one image's train step: forward + input grads + weight grads (~3x forward),
    minus the input grad of the first layer (the data needs none)."""
    from theanompi.models.layers import Sequential

    fwd = model.flops_per_image()
    first = 0
    net = model.net
    while isinstance(net, Sequential) and net.layers:
        net = net.layers[0]
    if net is not None:
        first = net.flops()
    return 3.0 * fwd - first


def _gemm_gflops(threads: int, n: int = 2048, reps: int = 5) -> float:
    """Median GFLOP/s of an n x n float32 ``Dot22`` through PyTensor's C BLAS."""
    import numpy as np
    import pytensor
    import pytensor.tensor as pt

    a, b = pt.matrix("a", dtype="float32"), pt.matrix("b", dtype="float32")
    f = pytensor.function([a, b], pt.dot(a, b))
    rng = np.random.default_rng(0)
    x, y = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    f(x, y)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f(x, y)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e9


def build_ours(sec: dict, batch: int, backend: str = "c") -> dict[str, Any]:
    """Our model built and compiled by ``backend``, with one random batch and a ``step()``."""
    import numpy as np

    from theanompi.models import create_model

    t0 = time.perf_counter()
    m = create_model({**sec, "batch_size": batch})
    t_build = time.perf_counter()
    m.build(batch, backend=backend)
    t_compile = time.perf_counter() - t_build
    rng = np.random.default_rng(0)
    x = rng.normal(0, 50, (batch, *m.input_shape)).astype(np.float32)
    y = rng.integers(0, m.n_classes, batch).astype(np.int32)
    return {
        "step": lambda: m.train_step(x, y),
        "construct_s": t_build - t0,
        "compile_s": t_compile,
        "train_flops": _train_flops(m),
        "model": m,
    }


def _timed(step: Any, n: int) -> list[float]:
    """Seconds of each of ``n`` calls of ``step`` after one untimed call (warm caches)."""
    step()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        out.append(time.perf_counter() - t)
    return out


def _torch_net(model: Any) -> Any:
    """The same architecture in torch.nn, translated layer by layer."""
    import torch.nn as nn

    from theanompi.models import layers as L

    def tr(layer: Any) -> Any:
        if isinstance(layer, L.Sequential):
            return nn.Sequential(*[tr(c) for c in layer.layers])
        if isinstance(layer, L.Conv2D):
            return nn.Conv2d(
                layer.in_shape[0],
                layer.n_filters,
                layer.k,
                stride=layer.s,
                padding=layer.p,
                groups=layer.groups,
                bias=layer.b is not None,
            )
        if isinstance(layer, L.MaxPool2D):
            return nn.MaxPool2d(layer.k, layer.s, layer.p, ceil_mode=layer.ceil_mode)
        if isinstance(layer, L.AvgPool2D):
            return nn.AvgPool2d(
                layer.k, layer.s, layer.p, ceil_mode=layer.ceil_mode, count_include_pad=False
            )
        if isinstance(layer, L.GlobalAvgPool):
            return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        if isinstance(layer, L.LRN):
            return nn.LocalResponseNorm(layer.n, layer.alpha_op, layer.beta, layer.k)
        if isinstance(layer, L.ReLU):
            return nn.ReLU(inplace=True)
        if isinstance(layer, L.Dropout):
            return nn.Dropout(layer.p)
        if isinstance(layer, L.Flatten):
            return nn.Flatten()
        if isinstance(layer, L.Dense):
            lin = nn.Linear(layer.n_in, layer.out_shape[0], bias=layer.b is not None)
            return nn.Sequential(nn.Flatten(), lin) if len(layer.in_shape) > 1 else lin
        if isinstance(layer, L.Concat):
            return _TorchConcat([tr(b) for b in layer.branches])
        if isinstance(layer, L.Residual):
            return _TorchResidual(tr(layer.main), tr(layer.shortcut) if layer.shortcut else None)
        if isinstance(layer, L.BatchNorm):
            bn = (
                nn.BatchNorm2d(layer.in_shape[0])
                if len(layer.in_shape) == 3
                else nn.BatchNorm1d(layer.in_shape[0])
            )
            return nn.Sequential(bn, nn.ReLU(inplace=True)) if layer.relu else bn
        raise TypeError(f"no torch translation for {layer!r}")

    return tr(model.net)


class _TorchConcat:  # built lazily as an nn.Module subclass (torch is the bench extra)
    def __new__(cls, branches: list[Any]) -> Any:
        import torch
        import torch.nn as nn

        class Concat(nn.Module):
            def __init__(self, bs: list[Any]) -> None:
                super().__init__()
                self.bs = nn.ModuleList(bs)

            def forward(self, x: Any) -> Any:
                return torch.cat([b(x) for b in self.bs], dim=1)

        return Concat(branches)


class _TorchResidual:  # main(x) + shortcut(x), the identity when there is no shortcut
    def __new__(cls, main: Any, shortcut: Any) -> Any:
        import torch.nn as nn

        class Residual(nn.Module):
            def __init__(self, m: Any, s: Any) -> None:
                super().__init__()
                self.main, self.shortcut = m, s

            def forward(self, x: Any) -> Any:
                return self.main(x) + (x if self.shortcut is None else self.shortcut(x))

        return Residual(main, shortcut)


def torch_step(model: Any, batch: int, threads: int) -> Any:
    """A ``step()`` running one SGD step of the torch translation of ``model``."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    net = _torch_net(model)
    c = model.config
    opt = torch.optim.SGD(
        net.parameters(), lr=0.001, momentum=c["momentum"], weight_decay=c["weight_decay"]
    )
    x = torch.randn(batch, *model.input_shape) * 50 / 255
    y = torch.randint(0, model.n_classes, (batch,))
    loss_fn = torch.nn.CrossEntropyLoss()
    net.train()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(net(x), y).backward()
        opt.step()

    return step


def _torch_child(spec: str, threads: int) -> int:
    """Peer process: build the torch twin of MODEL:BATCH, then per stdin line ``n`` time ``n``
    steps and print their seconds as JSON; at the end of stdin, its peak RSS in bytes (the
    whole process, as ``/usr/bin/time`` counts it). Runs outside our thread settings."""
    import torch  # noqa: F401 - first: its OpenMP reads the environment before configure() runs

    from theanompi.models import create_model

    name, _, b = spec.partition(":")
    model = create_model({**CASES[name], "batch_size": int(b)})
    step = torch_step(model, int(b), threads)
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(_timed(step, int(line))), flush=True)
    print(json.dumps(peak_rss_bytes()), flush=True)
    return 0


class _TorchPeer:
    """The torch side of a case, in a child process that times steps on request.

    Timing ours and torch in alternating blocks spreads the machine's drifts over both,
    and a separate process keeps the two OpenMP runtimes and our thread settings apart.
    """

    def __init__(self, name: str, batch: int, threads: int) -> None:
        from theanompi.pytensor_env import unconfigured_env

        env = unconfigured_env()
        cmd = [sys.executable, "-m", "theanompi.bench.model", "--_torch_child", f"{name}:{batch}"]
        self.proc = subprocess.Popen(
            [*cmd, "--threads", str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        if self.proc.stdout.readline().strip() != "ready":
            raise ImportError(
                "torch peer did not start (is torch installed? it is the bench extra)"
            )

    def timed(self, n: int) -> list[float]:
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> int:
        """End the peer; returns its peak RSS in bytes."""
        self.proc.stdin.close()
        peak = json.loads(self.proc.stdout.readline())
        self.proc.wait(timeout=60)
        return int(peak)


def _compile_only(name: str) -> int:
    """Child process: build the model and print construction/compile seconds as JSON."""
    from theanompi.pytensor_env import configure

    configure()
    from theanompi.models import create_model

    t0 = time.perf_counter()
    m = create_model(CASES[name])
    m.build(32)
    print(json.dumps({"total_s": time.perf_counter() - t0, **m.compile_seconds}))
    return 0


def _compile_times(name: str) -> dict[str, float]:
    """Cold (fresh THEANOMPI_CACHE) then warm (same cache) compile, each in a new process:
    wall seconds (``cold``, ``warm``), CPU seconds of the process and its compilers
    (``cold_cpu``, ``warm_cpu``: user + sys) and the C modules the cold one compiled."""
    import resource

    from theanompi.pytensor_env import unconfigured_env

    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="tmpi-cache-") as cache:
        env = {**unconfigured_env(), "THEANOMPI_CACHE": cache}
        for label in ("cold", "warm"):
            r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            proc = subprocess.run(
                [sys.executable, "-m", "theanompi.bench.model", "--_compile_only", name],
                capture_output=True,
                text=True,
                env=env,
                check=False,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"compile child failed: {proc.stderr[-2000:]}")
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            out[label] = json.loads(proc.stdout.strip().splitlines()[-1])["total_s"]
            out[f"{label}_cpu"] = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
            if label == "cold":
                out["modules"] = len(list(Path(cache).glob("pytensor/*/*/tmp*/key.pkl")))
    return out


def parse_cases(
    specs: list[str] | None, prog: str = "tmpi bench model"
) -> list[tuple[str, int]] | None:
    """The ``--case`` MODEL:BATCH specs as (model, batch); None (after a message naming
    ``prog``) if one is bad."""
    cases = []
    for spec in specs or ["alexnet:32", "alexnet:128", "small_cnn:32"]:
        name, _, b = spec.partition(":")
        if name not in CASES or not b.isdigit():
            print(f"{prog}: bad --case {spec!r}; use MODEL:BATCH with MODEL in {', '.join(CASES)}")
            return None
        cases.append((name, int(b)))
    return cases


def _start_peer(name: str, batch: int, threads: int) -> _TorchPeer | None:
    """The case's torch peer, or None (after a message) when torch cannot start."""
    try:
        return _TorchPeer(name, batch, threads)
    except ImportError as err:
        print(f"{err}: skipping the PyTorch column")
        return None


def _alternate(
    ours: dict[str, Any],
    jax: dict[str, Any] | None,
    peer: _TorchPeer | None,
    rounds: int,
    steps: int,
) -> tuple[list[float], list[float], list[float]]:
    """Step seconds of ours, JAX and torch, timed in alternating blocks: (ours, torch, jax)."""
    ours_t: list[float] = []
    torch_t: list[float] = []
    jax_t: list[float] = []
    for _ in range(rounds):
        ours_t += _timed(ours["step"], steps)
        if jax is not None:
            jax_t += _timed(jax["step"], steps)
        if peer is not None:
            torch_t += peer.timed(steps)
    return ours_t, torch_t, jax_t


def _case_row(
    name: str,
    batch: int,
    ours: dict[str, Any],
    ours_t: list[float],
    torch_t: list[float],
    gflops: float,
    peak: int,
    per_case: bool,
    start: int,
    torch_peak: int,
) -> dict[str, Any]:
    """One case's results: speeds, their ratios, the GEMM floor and the memory figures
    (``torch_peak``: the PyTorch twin's peak RSS in bytes, 0 without it)."""
    pbytes = param_bytes(ours["model"].params)
    ours_ips = batch / statistics.median(ours_t)
    torch_ips = batch / statistics.median(torch_t) if torch_t else float("nan")
    return {
        "model": name,
        "batch": batch,
        "ours_img_s": ours_ips,
        "torch_img_s": torch_ips,
        "ratio": ours_ips / torch_ips if torch_ips == torch_ips else float("nan"),
        "gemm_floor_img_s": gflops * 1e9 / ours["train_flops"],
        "train_gflop_per_img": ours["train_flops"] / 1e9,
        "compile_s_in_process": ours["compile_s"],
        "param_mb": pbytes / MB,
        "peak_rss_mb": peak / MB,
        "peak_rss_x_params": peak / pbytes if pbytes else float("nan"),
        "peak_rss_scope": "case" if per_case else "process",
        "rss_start_mb": start / MB,
        "torch_peak_rss_mb": torch_peak / MB if torch_peak else float("nan"),
        "rss_ratio": peak / torch_peak if torch_peak else float("nan"),
    }


def _bench_case(
    name: str,
    batch: int,
    threads: int,
    gflops: float,
    backend: str,
    use_torch: bool,
    rounds: int,
    steps: int,
) -> tuple[dict[str, Any], bool]:
    """Time and measure one case; returns its row and whether torch can still be used."""
    gc.collect()  # the previous case's model, before the peak restarts from here
    per_case = reset_peak_rss()  # else the peak counts from the process start
    start = rss_bytes()
    r = build_ours(CASES[name], batch)
    rj = build_ours(CASES[name], batch, "jax") if backend == "jax" else None
    peer = None
    if use_torch:
        peer = _start_peer(name, batch, threads)
        use_torch = peer is not None
    ours_t, torch_t, jax_t = _alternate(r, rj, peer, rounds, steps)
    torch_peak = peer.close() if peer is not None else 0
    peak = peak_rss_bytes()
    row = _case_row(name, batch, r, ours_t, torch_t, gflops, peak, per_case, start, torch_peak)
    if rj is not None:
        row["jax_img_s"] = batch / statistics.median(jax_t)
        row["jax_compile_s"] = rj["compile_s"]  # + the jit on the first (untimed) step
    return row, use_torch


def _print_case(row: dict[str, Any]) -> None:
    """Print a case's lines as soon as it is timed: speeds, memory and (with JAX) the fastest."""
    name, batch = row["model"], row["batch"]
    ours_ips, torch_ips = row["ours_img_s"], row["torch_img_s"]
    print(
        f"{name:>10} b={batch:<4} ours {ours_ips:8.1f} img/s | torch {torch_ips:8.1f} img/s | "
        f"ours/torch {row['ratio']:.2f} | GEMM floor {row['gemm_floor_img_s']:8.1f} img/s "
        f"({row['train_gflop_per_img']:.2f} GFLOP/img)",
        flush=True,
    )
    print(
        f"{'':>10} b={batch:<4} peak RSS {row['peak_rss_mb']:8.0f} MB = "
        f"{row['peak_rss_x_params']:.1f} x params ({row['param_mb']:.0f} MB); "
        + (
            f"{row['rss_start_mb']:.0f} MB at the case's start"
            if row["peak_rss_scope"] == "case"
            else "since the process start"
        )
        + f" | torch {row['torch_peak_rss_mb']:.0f} MB (its process) | ours/torch "
        f"{row['rss_ratio']:.2f}",
        flush=True,
    )
    if "jax_img_s" in row:
        speeds = {"C": ours_ips, "JAX": row["jax_img_s"], "PyTorch": torch_ips}
        best = max((v, k) for k, v in speeds.items() if v == v)[1]
        print(
            f"{'':>10} b={batch:<4} jax  {row['jax_img_s']:8.1f} img/s | jax/C "
            f"{row['jax_img_s'] / ours_ips:.2f} | fastest: {best}",
            flush=True,
        )


def _compile_report(names: list[str]) -> dict[str, dict[str, float]]:
    """Cold and warm compile times of each model (once per model), printed as they come."""
    compile_rows = {}
    for name in names:
        compile_rows[name] = _compile_times(name)
        c = compile_rows[name]
        print(
            f"{name:>10} compile+build: cold cache {c['cold']:.1f} s "
            f"({c['cold_cpu']:.1f} s CPU, {c['modules']:.0f} C modules), "
            f"warm cache {c['warm']:.1f} s ({c['warm_cpu']:.1f} s CPU)"
        )
    return compile_rows


def _print_table(rows: list[dict[str, Any]], jx: bool) -> None:
    """The closing markdown table of every case (a JAX column with ``--backend jax``)."""
    print(
        "| model | batch | ours img/s | PyTorch img/s | ours/PyTorch | GEMM floor img/s |"
        " peak RSS MB (x params) | PyTorch peak RSS MB | RSS ours/PyTorch |"
        + (" JAX img/s |" if jx else "")
    )
    print("|---|---|---|---|---|---|---|---|---|" + ("---|" if jx else ""))
    for r in rows:
        print(
            f"| {r['model']} | {r['batch']} | {r['ours_img_s']:.1f} | {r['torch_img_s']:.1f} | "
            f"{r['ratio']:.2f} | {r['gemm_floor_img_s']:.1f} | "
            f"{r['peak_rss_mb']:.0f} ({r['peak_rss_x_params']:.1f}x) | "
            f"{r['torch_peak_rss_mb']:.0f} | {r['rss_ratio']:.2f} |"
            + (f" {r['jax_img_s']:.1f} |" if jx else "")
        )


def main(argv: list[str] | None = None) -> int:
    """Print the benchmark table (medians of every timed step); return 0."""
    args = _parse(argv)
    threads = args.threads or os.cpu_count() or 1
    if args._compile_only:
        return _compile_only(args._compile_only)
    if args._torch_child:
        return _torch_child(args._torch_child, threads)
    from theanompi.pytensor_env import configure

    configure(blas_threads=threads)
    cases = parse_cases(args.case)
    if cases is None:
        return 2

    from theanompi.bench._machine import describe, machine_line

    gflops = _gemm_gflops(threads)
    machine = describe()  # after the GEMM: PyTensor's BLAS and the kernel it picked are loaded
    print(machine_line(machine))
    print(f"BLAS: 2048^2 float32 Dot22 = {gflops:.1f} GFLOP/s on {threads} thread(s)")
    rows = []
    use_torch = not args.no_torch
    for name, batch in cases:
        row, use_torch = _bench_case(
            name, batch, threads, gflops, args.backend, use_torch, args.rounds, args.steps
        )
        rows.append(row)
        _print_case(row)
    compile_rows = {}
    if not args.no_compile:
        compile_rows = _compile_report(list(dict.fromkeys(n for n, _ in cases)))
    print()
    _print_table(rows, args.backend == "jax")
    if args.json:
        write_json(
            args.json,
            {
                "machine": machine,
                "gemm_gflops": gflops,
                "threads": threads,
                "rows": rows,
                "compile": compile_rows,
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
