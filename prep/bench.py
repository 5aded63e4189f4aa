"""``tmpi bench prep``: images/s of a naive PIL baseline and a decode-only bound vs our ``batch`` stage at 1 and 2 ranks.

The images are real-size JPEGs (500 x 375 by default, the ImageNet median) cut from the two
photos that ship inside scikit-learn (``china.jpg``, ``flower.jpg``): random crops, flips and
a little noise, so that every file differs. Both contenders turn the same files into the same
hickle batches: the baseline decodes every image in full, resizes the shorter side to S,
crops the centre and writes the batch, in one process; ours is ``prep.batch.run`` (simplejpeg
decode at Pillow's DCT scale into reused buffers, C (or numba) box resize straight to S x S,
blocked c01b transpose) under ``mpirun -n 1`` and ``-n 2`` with one thread per rank (one core
per rank: the per-rank ratios), and once more at 1 rank with its second thread (resize, write
and SHA-256 beside the decode, as a rank does when the machine has a spare core), timed with
``MPI.Wtime`` between barriers, on its second run in the process (its kernels are loaded
before the first barrier). With 1 rank in ``--ranks`` it also times what a user runs: a fresh
``tmpi prep batch -n 1`` process, one thread, wall time from its start to its exit
(interpreter, imports, kernels and all; the ``fresh process`` row and ratio). Each contender
that writes first writes and deletes its output's worth of scratch (:func:`warm_page_cache`).
The decode-only bound is
``simplejpeg.decode_jpeg`` alone over the same files (bytes read first, full size into one
reused buffer, one process): what a rank could reach if resizing and writing were free.
Medians of repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

__all__ = ["make_images", "warm_page_cache", "naive_batches", "decode_only", "main"]


def make_images(root: Path, n: int, width: int = 500, height: int = 375, seed: int = 0) -> None:
    """Write ``n`` distinct JPEGs (``width`` x ``height``) as an ImageNet-layout tree under ``root``.

    Nine in ten go to ``train/<wnid>/`` (two classes: china, flower), the rest to ``val/``
    with a ground-truth file.
    """
    from PIL import Image
    from sklearn.datasets import load_sample_images

    photos = [Image.fromarray(a) for a in load_sample_images().images]
    rng = np.random.default_rng(seed)
    n_val = max(1, n // 10)
    gt = []
    for i in range(n):
        c = i % len(photos)
        src = photos[c]
        scale = rng.uniform(0.6, 1.0)
        cw = int(min(src.width, src.height * width / height) * scale)
        ch = int(cw * height / width)
        x0 = int(rng.integers(0, src.width - cw + 1))
        y0 = int(rng.integers(0, src.height - ch + 1))
        im = src.crop((x0, y0, x0 + cw, y0 + ch)).resize((width, height), Image.Resampling.LANCZOS)
        if rng.random() < 0.5:
            im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        arr = np.asarray(im).astype(np.int16) + rng.integers(-6, 7, (height, width, 3))
        im = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))
        if i < n_val:
            path = root / "val" / f"ILSVRC2012_val_{i + 1:08d}.JPEG"
            gt.append(c + 1)
        else:
            path = root / "train" / f"n{c:08d}" / f"n{c:08d}_{i}.JPEG"
        path.parent.mkdir(parents=True, exist_ok=True)
        im.save(path, format="JPEG", quality=90)
    (root / "val_ground_truth.txt").write_text("".join(f"{g}\n" for g in gt))


def _naive_image(path: Path, size: int) -> np.ndarray:
    """Full decode, shorter side to ``size`` (bilinear), integer centre crop, channel-first copy."""
    from PIL import Image

    im = Image.open(path).convert("RGB")
    w, h = im.size
    s = size / min(w, h)
    im = im.resize((max(size, round(w * s)), max(size, round(h * s))), Image.Resampling.BILINEAR)
    w, h = im.size
    left, top = (w - size) // 2, (h - size) // 2
    im = im.crop((left, top, left + size, top + size))
    return np.asarray(im).transpose(2, 0, 1).copy()


def warm_page_cache(folder: Path, nbytes: int) -> None:
    """Write and delete ``nbytes`` (plus a margin) of zeros under ``folder``: untimed, before a run.

    A VM that hands freed memory back to its host (this one: DAMON reclaim and a virtio
    balloon) makes every write into fresh page cache fault its pages in from the host: a
    12.6 MB batch took 60-130 ms instead of 3.5 ms, erratically, for the baseline and ours
    alike, while the decode-only bound writes nothing. Pages freed a moment ago are reused
    at full speed, so each contender writes its own output's worth first.
    """
    chunk = bytes(1 << 24)
    tmp = folder / f".warm-page-cache-{os.getpid()}"
    with open(tmp, "wb") as fh:
        for _ in range(-(-(nbytes * 5 // 4 + len(chunk)) // len(chunk))):
            fh.write(chunk)
    tmp.unlink()


def _output_bytes(plans: dict, batch_size: int, size: int) -> int:
    """Bytes of pixels every batch of ``plans`` holds (the output's page-cache footprint)."""
    return sum(p.n_batches for p in plans.values()) * batch_size * 3 * size * size


def naive_batches(out: Path, batch_size: int, size: int) -> tuple[int, float, float]:
    """The baseline: the same plan as ``prep batch``, one process; (images, seconds, cpu s)."""
    import hickle

    from prep.batch import make_plans

    plans, scan, _ = make_plans(out, batch_size, "drop", "pad")
    root = Path(scan["src"])
    folder = out / "naive"
    folder.mkdir(exist_ok=True)
    warm_page_cache(folder, _output_bytes(plans, batch_size, size))
    n = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for split, plan in plans.items():
        for k, items in enumerate(plan.items):
            batch = np.zeros((batch_size, 3, size, size), dtype=np.uint8)
            for j, it in enumerate(items):
                if it is not None:
                    batch[j] = _naive_image(root / it[0], size)
                    n += 1
            hickle.dump(
                batch.transpose(1, 2, 3, 0).copy(), str(folder / f"{split}{k}.hkl"), mode="w"
            )
    return n, time.perf_counter() - t0, time.process_time() - c0


def decode_only(out: Path) -> tuple[int, float, float]:
    """The bound: simplejpeg decodes of the same files, bytes in memory; (images, s, cpu s)."""
    import simplejpeg

    scan = json.loads((out / "misc" / "scan.json").read_text())
    root = Path(scan["src"])
    blobs = [(root / rel).read_bytes() for s in ("train", "val") for rel, _ in scan[s]]
    h, w, _, _ = simplejpeg.decode_jpeg_header(blobs[0])
    buf = np.empty(max(h * w * 3, 1), dtype=np.uint8)
    t0, c0 = time.perf_counter(), time.process_time()
    for data in blobs:
        h, w, _, _ = simplejpeg.decode_jpeg_header(data)
        if buf.size < h * w * 3:
            buf = np.empty(h * w * 3, dtype=np.uint8)
        simplejpeg.decode_jpeg(data, "RGB", buffer=buf)
    return len(blobs), time.perf_counter() - t0, time.process_time() - c0


def _ours(
    out: Path, ranks: int, batch_size: int, size: int, threads: int = 1
) -> tuple[int, float, float]:
    """Our batch stage on ``ranks`` ranks of ``threads`` threads each (one core per rank for
    the per-rank ratios; 2 shows what a rank's second thread gives when a core is spare)."""
    from prep.batch import THREADS_ENV
    from theanompi.launch.mpirun import mpirun_command, mpirun_env
    from theanompi.launch.restart import run_started

    _clear_batches(out)
    cmd = mpirun_command(
        ranks,
        [sys.executable, "-m", "prep.bench", "--worker", str(out), str(batch_size), str(size)],
    )
    repo = str(Path(__file__).resolve().parents[1])
    env = mpirun_env(
        os.environ
        | {"PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
        | {THREADS_ENV: str(threads)}
    )
    proc = run_started(cmd, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"bench worker failed ({proc.returncode}): {proc.stderr[-2000:]}")
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    return int(stats["images"]), float(stats["seconds"]), float(stats["cpu_seconds"])


def _fresh(out: Path, batch_size: int, size: int) -> tuple[int, float, float]:
    """A user's ``tmpi prep batch -n 1`` in a fresh process, one thread: (images, wall s, cpu s).

    Timed from before the process starts to its exit (``perf_counter`` here, CPU from
    ``RUSAGE_CHILDREN``), so its fixed costs count: interpreter start, imports, loading the
    kernels, the writer's template, the first touch of its buffers. Its output's page cache
    is warmed first, as for every contender (:func:`warm_page_cache`).
    """
    import resource

    from prep.batch import THREADS_ENV, make_plans

    _clear_batches(out)
    plans, _, _ = make_plans(out, batch_size, "drop", "pad")
    warm_page_cache(out, _output_bytes(plans, batch_size, size))
    cmd = [sys.executable, "-m", "theanompi.cli", "prep", "batch", "--out", str(out)]
    cmd += ["--batch-size", str(batch_size), "--size", str(size), "-n", "1"]
    repo = str(Path(__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    env |= {"PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env |= {THREADS_ENV: "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"tmpi prep batch failed ({proc.returncode}): {proc.stderr[-2000:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    n = sum(p.n_images for p in plans.values())
    return n, seconds, cpu


def _warm_imports() -> None:
    """Import the decoder and writer stacks before any timing (h5py alone takes ~0.3 s)."""
    import hickle  # noqa: F401
    import simplejpeg  # noqa: F401
    from PIL import Image, JpegImagePlugin, PngImagePlugin  # noqa: F401


def _clear_batches(out: Path) -> None:
    """Delete the batch folders under ``out`` (the next run writes every batch again)."""
    for d in out.glob("*_hkl_b*"):
        shutil.rmtree(d)


def _worker(out: str, batch_size: str, size: str) -> int:
    """Run the stage once untimed, then timed: as warm as the in-process baseline and bound.

    A fresh process first touches its buffers and heap during its first run, which on this
    VM costs ~10 ms per MB (its pages come back from the host): a cold run here took 1.6-2.2 s
    of CPU, the next one 0.9-1.1 s. The baseline and the bound run in the long-lived bench
    process, so only ours would pay it at every repeat.
    """
    _warm_imports()
    from mpi4py import MPI

    from prep.batch import make_plans, run

    comm = MPI.COMM_WORLD
    b, s = int(batch_size), int(size)
    run(out, b, s, progress=False)
    comm.Barrier()
    if comm.Get_rank() == 0:
        _clear_batches(Path(out))
    comm.Barrier()
    plans, _, _ = make_plans(Path(out), b, "drop", "pad")
    warm_page_cache(Path(out), _output_bytes(plans, b, s) // comm.Get_size())
    stats = run(out, b, s, progress=False)
    from theanompi.comm import log

    log(json.dumps(stats))
    return 0


def make_link_tree(root: Path, n_train: int, n_classes: int, val_per_class: int = 50) -> int:
    """An ImageNet-shaped tree of hard links: ``n_train`` train files over ``n_classes`` folders.

    Each class folder links one tiny JPEG of its own (ext4 allows 65,000 links per file), and
    ``val/<wnid>/`` gets ``val_per_class`` links. Returns the number of entries made.
    """
    from PIL import Image

    made = 0
    base = n_train // n_classes
    for c in range(n_classes):
        wnid = f"n{c:08d}"
        seed = root / "seeds" / f"{wnid}.JPEG"
        seed.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (16, 12), (c % 256, (7 * c) % 256, 99)).save(seed, quality=90)
        for split, n in (("train", base + (c < n_train % n_classes)), ("val", val_per_class)):
            folder = root / split / wnid
            folder.mkdir(parents=True)
            for i in range(n):
                os.link(seed, folder / f"{wnid}_{i}.JPEG")
            made += n
    return made


def _scan_worker(src: str, out: str) -> int:
    """Time ``scan`` + ``shuffle`` on every rank; rank 0 prints seconds and peak RSS as JSON."""
    from mpi4py import MPI

    from prep import scan, shuffle
    from theanompi.bench._memory import peak_rss_bytes

    _warm_imports()
    comm = MPI.COMM_WORLD
    comm.Barrier()
    t0, c0 = MPI.Wtime(), time.process_time()
    tree = scan.run(src, out, comm=comm)
    files = len(tree["train"]) + len(tree["val"]) + len(tree["skipped"])
    del tree  # as in `tmpi prep all`: shuffle does not run beside scan's result
    comm.Barrier()
    t1, c1 = MPI.Wtime(), time.process_time()
    shuffle.run(out, seed=0, comm=comm)
    comm.Barrier()
    t2 = MPI.Wtime()
    rss = comm.gather(peak_rss_bytes(), root=0)
    cpu = comm.gather(c1 - c0, root=0)
    if comm.Get_rank() == 0:
        res = {"files": files, "scan_s": t1 - t0, "shuffle_s": t2 - t1, "peak_rss": rss}
        res["scan_cpu_s"] = cpu
        print(json.dumps(res), flush=True)
    return 0


def scan_scale(n_train: int, n_classes: int, ranks: int, work: Path | None = None) -> dict:
    """Build a hard-link tree, run scan + shuffle under ``mpirun -n ranks``, delete the tree."""
    from theanompi.launch.mpirun import mpirun_command, mpirun_env
    from theanompi.launch.restart import run_started

    tmp = tempfile.TemporaryDirectory(prefix="tmpi-bench-scan-", dir=work)
    try:
        root = Path(tmp.name)
        t0 = time.perf_counter()
        made = make_link_tree(root / "src", n_train, n_classes)
        build = time.perf_counter() - t0
        cmd = mpirun_command(
            ranks,
            [
                sys.executable,
                "-m",
                "prep.bench",
                "--scan-worker",
                str(root / "src"),
                str(root / "out"),
            ],
        )
        repo = str(Path(__file__).resolve().parents[1])
        env = mpirun_env(
            os.environ | {"PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
        )
        proc = run_started(cmd, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"scan worker failed ({proc.returncode}): {proc.stderr[-2000:]}")
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        res |= {"made": made, "build_s": build, "ranks": ranks}
        return res
    finally:
        tmp.cleanup()


def _print_scale(res: dict) -> None:
    rate = res["files"] / res["scan_s"]
    peak = max(res["peak_rss"]) / 2**20
    print(
        f"scan scale: {res['files']:,} files ({res['made']:,} hard links, built in "
        f"{res['build_s']:.0f} s) on {res['ranks']} rank(s): scan {res['scan_s']:.1f} s = "
        f"{rate:,.0f} files/s (goal >= 50,000; CPU s per rank "
        f"{', '.join(f'{c:.1f}' for c in res['scan_cpu_s'])}), shuffle {res['shuffle_s']:.1f} s; "
        "peak RSS per "
        f"rank {', '.join(f'{r / 2**20:.0f}' for r in res['peak_rss'])} MiB (max {peak:.0f}, "
        "goal < 1024)"
    )


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line of ``tmpi bench prep`` (and of its hidden worker modes)."""
    p = argparse.ArgumentParser(prog="tmpi bench prep", description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=640, help="number of JPEGs (default 640)")
    p.add_argument("--width", type=int, default=500)
    p.add_argument("--height", type=int, default=375)
    p.add_argument("--size", type=int, default=256, help="output side S (default 256)")
    p.add_argument("--batch-size", type=int, default=64, help="B (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="median over this many runs (default 3)")
    p.add_argument("--ranks", default="1,2", help="rank counts for ours (default 1,2)")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp dir)")
    p.add_argument(
        "--scan-tree",
        type=int,
        default=0,
        help="instead: time scan + shuffle on a hard-link tree of this many train files",
    )
    p.add_argument("--classes", type=int, default=1000, help="class folders of --scan-tree")
    p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--scan-worker", nargs=2, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _prepare(src: Path, out: Path, images: int, width: int, height: int) -> float:
    """Make the JPEGs (unless already there), scan and shuffle them; returns scan's img/s."""
    from prep import scan, shuffle

    if not (src / "val_ground_truth.txt").exists():
        make_images(src, images, width, height)
    _warm_imports()
    t0 = time.perf_counter()
    tree = scan.run(src, out)
    scan_rate = (len(tree["train"]) + len(tree["val"])) / (time.perf_counter() - t0)
    shuffle.run(out, seed=0)
    return scan_rate


def _contenders(ranks: list[int]) -> list[str]:
    """Keys of what is timed, in timing and table order: naive, bound, ours per rank count."""
    keys = ["naive", "bound", *(f"ours{r}" for r in ranks)]
    if 1 in ranks and (os.cpu_count() or 1) >= 2:
        keys.append("ours1t2")  # one rank, its second thread on the spare core
    if 1 in ranks:
        keys.append("fresh1")  # a user's `tmpi prep batch -n 1`: a new process, timed whole
    return list(dict.fromkeys(keys))


def _time_one(key: str, out: Path, batch_size: int, size: int) -> tuple[int, float, float]:
    """One run of the contender ``key``: (images, seconds, cpu seconds)."""
    if key == "naive":
        return naive_batches(out, batch_size, size)
    if key == "bound":
        return decode_only(out)
    if key == "ours1t2":
        return _ours(out, 1, batch_size, size, threads=2)
    if key == "fresh1":
        return _fresh(out, batch_size, size)
    return _ours(out, int(key[4:]), batch_size, size)


def _time_all(
    keys: list[str], out: Path, batch_size: int, size: int, repeats: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Img/s and img/cpu-s of every contender, all of them in turn at each repeat."""
    rates: dict[str, list[float]] = {k: [] for k in keys}
    cpu_rates: dict[str, list[float]] = {k: [] for k in keys}
    for _ in range(repeats):
        for key in rates:
            n, sec, cpu = _time_one(key, out, batch_size, size)
            rates[key].append(n / sec)
            cpu_rates[key].append(n / cpu)
    return rates, cpu_rates


def _print_table(med: dict[str, float], cmed: dict[str, float], ranks: list[int]) -> None:
    """The table of medians: img/s, per rank, against naive, 1 rank and the bound, per CPU s."""
    print(
        f"{'method':<26}{'ranks':>6}{'img/s':>8}{'x naive':>9}{'per rank':>10}"
        f"{'x 1 rank':>10}{'x bound':>9}{'img/cpu-s':>11}{'x naive':>9}"
    )
    base1 = med.get(f"ours{ranks[0]}")
    names = {
        "naive": "naive PIL (full)",
        "bound": "decode only (simplejpeg)",
        "ours1t2": "ours, 2 threads (2 cores)",
        "fresh1": "ours, fresh process",
    }
    for key in med:
        r = int(key[4:]) if key.startswith("ours") and key[4:].isdigit() else 1
        v = med[key]
        own = key.startswith("ours") and key[4:].isdigit()
        scale = f"{v / base1:.2f}" if own and r != ranks[0] and base1 else ""
        print(
            f"{names.get(key, 'ours (prep batch)'):<26}{r:>6}{v:>8.0f}{v / med['naive']:>9.2f}"
            f"{v / r / med['naive']:>10.2f}{scale:>10}{v / r / med['bound']:>9.2f}"
            f"{cmed[key]:>11.0f}{cmed[key] / cmed['naive']:>9.2f}"
        )


def _print_ratios(med: dict[str, float]) -> None:
    """The goal ratios of one rank (needs ``ours1``): vs naive, 1 -> 2 ranks, vs the bound."""
    one = med["ours1"]
    two = f"{med['ours2'] / one:.2f}x (goal >= 1.85)" if "ours2" in med else "not run"
    print(
        f"ratios: ours per rank / naive {one / med['naive']:.2f}x (goal >= 2.2); "
        f"1 -> 2 ranks {two}; ours per rank / decode-only bound "
        f"{one / med['bound']:.2f}x (goal >= 0.6)"
        + (
            f"; with a second thread on a spare core {med['ours1t2'] / med['bound']:.2f}x"
            if "ours1t2" in med
            else ""
        )
        + (
            f"; fresh process (tmpi prep batch -n 1, wall) / naive "
            f"{med['fresh1'] / med['naive']:.2f}x (goal >= 2.2)"
            if "fresh1" in med
            else ""
        )
    )


def main(argv: list[str] | None = None) -> int:
    """Build the images, time naive / ours x1 / ours x2, print a table of medians; returns 0."""
    args = _parse(argv)
    if args.worker:
        return _worker(*args.worker)
    if args.scan_worker:
        return _scan_worker(*args.scan_worker)
    if args.scan_tree:
        for r in (int(x) for x in args.ranks.split(",")):
            _print_scale(scan_scale(args.scan_tree, args.classes, r, args.work))
        return 0
    ranks = [int(r) for r in args.ranks.split(",")]
    tmp = None
    if args.work is None:
        tmp = tempfile.TemporaryDirectory(prefix="tmpi-bench-prep-")
        work = Path(tmp.name)
    else:
        work = args.work
    try:
        src, out = work / "src", work / "out"
        scan_rate = _prepare(src, out, args.images, args.width, args.height)
        keys = _contenders(ranks)
        rates, cpu_rates = _time_all(keys, out, args.batch_size, args.size, args.repeats)
        med = {k: statistics.median(v) for k, v in rates.items()}
        cmed = {k: statistics.median(v) for k, v in cpu_rates.items()}
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        print(
            f"prep bench: {args.images} JPEGs {args.width}x{args.height} -> S={args.size}, "
            f"B={args.batch_size}, c01b hickle, median of {args.repeats} "
            f"(cpus: {os.cpu_count()}, load average {load:.1f})"
        )
        _print_table(med, cmed, ranks)
        if 1 in ranks:
            _print_ratios(med)
        print(f"not in the table: scan's decode check, 1 process, {scan_rate:.0f} img/s")
        print(
            "runs (img/s): "
            + "; ".join(f"{k} " + ", ".join(f"{x:.0f}" for x in v) for k, v in rates.items())
        )
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
