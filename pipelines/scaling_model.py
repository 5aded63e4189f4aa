"""The step-time model of docs/scaling.md: compute + exchange(N) per strategy, as a table.

    python pipelines/scaling_model.py [--compute 0.526] [--alpha-us 25] [--eff ar=0.9,...]

exchange(N) for S parameter bytes on links of bandwidth B (bytes/s) and latency alpha:
  ar, asa32        2(N-1) alpha + 2 (N-1)/N S / B / eff      (ring / reduce-scatter + allgather)
  asa16, ar+fp16   the same with S/2
  copper           2 log2(N) alpha + 2 (S + (log2(N) - 1) g) / B / eff   (pipelined tree, g = 4 MiB)
  copper+fp16      the same with S/2
eff: the fraction of the wire a strategy reaches, measured (busbw / ping-pong bandwidth on the
shaped link, `python pipelines/bench_cluster.py`); 1 when not given.
"""

from __future__ import annotations

import argparse
import math

ALEXNET_PARAMS = 60_965_224
SEGMENT = 4 << 20  # copper's pipeline segment
STRATEGIES = ("ar", "asa32", "asa16", "ar+fp16", "copper", "copper+fp16")


def exchange_seconds(
    strategy: str, n: int, nbytes: float, gbit: float, alpha: float, eff: float
) -> float:
    """Modelled seconds of one exchange of ``nbytes`` (float32) at N=n."""
    if n == 1:
        return 0.0
    b = gbit * 1e9 / 8 * eff
    s = nbytes / 2 if ("16" in strategy) else nbytes
    if strategy.startswith("copper"):
        levels = math.log2(n)
        return 2 * levels * alpha + 2 * (s + (levels - 1) * SEGMENT) / b
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * s / b


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compute", type=float, default=2.63 / 5, help="s of compute per step")
    p.add_argument("--batch", type=int, default=128, help="images per worker per step")
    p.add_argument("--alpha-us", type=float, default=25.0, help="one-way latency, us")
    p.add_argument("--eff", default="", help="strategy=fraction of the wire, comma separated")
    p.add_argument("--sizes", default="8,16,32,64,128,256")
    p.add_argument("--gbits", default="10,100")
    a = p.parse_args()
    eff = {k: float(v) for k, v in (kv.split("=") for kv in a.eff.split(",") if kv)}
    nbytes = 4 * ALEXNET_PARAMS
    sizes = [int(x) for x in a.sizes.split(",")]
    for gbit in (float(x) for x in a.gbits.split(",")):
        print(
            f"\nAlexNet, {a.compute:.3f} s compute per step of {a.batch}/worker, {gbit:g} Gbit/s, "
            f"alpha {a.alpha_us:g} us: exchange s per step (images/s)\n"
        )
        print("| strategy | " + " | ".join(f"N={n}" for n in sizes) + " |")
        print("|---|" + "---|" * len(sizes))
        for st in STRATEGIES:
            cells = []
            for n in sizes:
                x = exchange_seconds(st, n, nbytes, gbit, a.alpha_us * 1e-6, eff.get(st, 1.0))
                cells.append(f"{x:.3f} ({n * a.batch / (a.compute + x):,.0f})")
            print(f"| {st} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
