"""``tmpi bench``: each command hands its arguments to a benchmark's own ``main(argv)``."""

from __future__ import annotations

import typer

__all__ = ["app"]

app = typer.Typer(help="Benchmarks that print side-by-side ratios (medians).", no_args_is_help=True)


def _bench(module: str, args: list[str] | None) -> None:
    import importlib

    main_fn = importlib.import_module(module).main
    raise typer.Exit(main_fn(list(args or [])))


# --help goes to the bench's own argparse parser, which lists its options
_BENCH_CTX = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


@app.command("prep", context_settings=_BENCH_CTX)
def bench_prep(ctx: typer.Context) -> None:
    """Images/s of prep: naive PIL baseline vs ours at 1 and 2 ranks."""
    _bench("prep.bench", ctx.args)


@app.command("exchange", context_settings=_BENCH_CTX)
def bench_exchange(ctx: typer.Context) -> None:
    """Seconds and bus bandwidth per exchange: ar, asa32, asa16, copper, per-array ar, gloo."""
    _bench("theanompi.bench.exchange", ctx.args)


@app.command("model", context_settings=_BENCH_CTX)
def bench_model(ctx: typer.Context) -> None:
    """Train-step images/s of our models vs PyTorch CPU, GEMM floor, compile times."""
    _bench("theanompi.bench.model", ctx.args)


@app.command("layers", context_settings=_BENCH_CTX)
def bench_layers(ctx: typer.Context) -> None:
    """Per layer kind ms of one train step (forward, backward, update): ours vs PyTorch CPU."""
    _bench("theanompi.bench.layers", ctx.args)


@app.command("train", context_settings=_BENCH_CTX)
def bench_train(ctx: typer.Context) -> None:
    """Training images/s at N=1 and N=2 with the compute/exchange/wait split."""
    _bench("theanompi.bench.train", ctx.args)


@app.command("startup", context_settings=_BENCH_CTX)
def bench_startup(ctx: typer.Context) -> None:
    """Seconds from tmpi train -n 2 to rank 0's first step, split by phase (warm cache)."""
    _bench("theanompi.bench.startup", ctx.args)


@app.command("cluster", context_settings=_BENCH_CTX)
def bench_cluster(ctx: typer.Context) -> None:
    """Two simulated nodes on a 1 Gbit link (root): overlap, hierarchical, PyTorch DDP twin."""
    _bench("theanompi.bench.cluster", ctx.args)
