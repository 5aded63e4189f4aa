"""The PyTorch DDP twin of the digits CNN: same network, batch and threads, side by side.

``python -m theanompi.bench.ddp --out FILE`` is one rank of a ``torch.distributed`` (gloo) job:
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and ``GLOO_SOCKET_IFNAME`` come from
the environment (``tmpi bench cluster`` starts one per simulated node). The net mirrors
:class:`theanompi.models.small_cnn.SmallCNN` (``[conv3x3 -> relu -> maxpool2] x len(channels) ->
fc -> relu -> dropout -> fc``) on 3x28x28 inputs; SGD with momentum, like the digits config.
Batches are random tensors made once (the data pipeline is not what is measured). Rank 0
writes the medians: the DDP step, and the same step under ``no_sync()`` (compute alone, no
allreduce), whose difference is the exchange DDP could not hide. Needs torch (optional:
``tmpi bench cluster`` says so in one line and skips the twin without it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "torch_missing"]


def torch_missing() -> str | None:
    """Why the twin cannot run here (None: torch is importable)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return "the PyTorch DDP twin needs torch (the bench extra: theanompi[bench]); skipped"
    return None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m theanompi.bench.ddp", description=__doc__)
    p.add_argument("--out", type=Path, required=True, help="rank 0 writes its JSON row here")
    p.add_argument("--steps", type=int, default=30, help="timed steps [default: 30]")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first [default: 3]")
    p.add_argument("--batch-size", type=int, default=128, help="per rank [default: 128]")
    p.add_argument("--channels", default="32,64", help="filters per conv block [default: 32,64]")
    p.add_argument("--fc", type=int, default=1024, help="hidden units [default: 1024]")
    p.add_argument("--dropout", type=float, default=0.25, help="[default: 0.25]")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank [default: 1]")
    return p


def _net(torch: Any, channels: list[int], fc: int, dropout: float, size: int = 28) -> Any:
    nn = torch.nn
    layers: list[Any] = []
    c_in = 3
    for c in channels:
        layers += [nn.Conv2d(c_in, c, 3, padding=1), nn.ReLU()]
        if size >= 2:
            layers.append(nn.MaxPool2d(2))
            size //= 2
        c_in = c
    layers += [nn.Flatten(), nn.Linear(c_in * size * size, fc), nn.ReLU()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(fc, 10))
    return nn.Sequential(*layers)


def _timed(step: Any, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    """One DDP rank: warm up, time ``--steps`` DDP steps, then as many under ``no_sync``."""
    args = _parser().parse_args(argv)
    why = torch_missing()
    if why:
        print(f"bench ddp: {why}", file=sys.stderr)
        return 2
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    net = _net(torch, [int(c) for c in args.channels.split(",")], args.fc, args.dropout)
    model = DistributedDataParallel(net)  # broadcasts rank 0's parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9, weight_decay=5e-4)
    x = torch.randn(args.batch_size, 3, 28, 28)
    y = torch.randint(0, 10, (args.batch_size,))
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    _timed(step, args.warmup)
    dist.barrier()
    ddp = statistics.median(_timed(step, args.steps))
    dist.barrier()
    with model.no_sync():
        alone = statistics.median(_timed(step, args.steps))
    params = sum(p.numel() for p in net.parameters())
    both = [None] * world
    dist.all_gather_object(both, ddp)
    if rank == 0:
        step_s = max(both)  # type: ignore[type-var]
        row = {
            "world": world,
            "batch_size": args.batch_size,
            "images_per_s": world * args.batch_size / step_s,
            "step_s": step_s,
            "compute_s": alone,
            "exchange_s": max(0.0, step_s - alone),
            "params": params,
            "torch": torch.__version__,
        }
        args.out.write_text(json.dumps(row))
    dist.barrier()  # neither side closes its gloo sockets while the other still uses them
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
