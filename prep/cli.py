"""``tmpi prep``: ImageNet tree -> shuffled uint8 hickle batches, mean image, labels (MPI-parallel).

Mounted by ``theanompi.cli`` as ``tmpi prep``; also runnable as ``python -m prep.cli``.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from theanompi.errors import EXIT_FAILURE, ConfigError, UserError
from theanompi.launch.hosts import PLACEMENT_FLAGS

__all__ = ["app"]

F = TypeVar("F", bound=Callable[..., Any])

app = typer.Typer(
    help="Prepare an ImageNet-layout image tree: scan, shuffle, batch, mean, labels, verify.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# help panels: what is read, what is written, and how many ranks run where
INPUT, OUTPUT, LAUNCH = "Input", "Output", "Launch"

Src = Annotated[
    Path,
    typer.Option("--src", help="Image tree with train/<wnid>/ and val/.", rich_help_panel=INPUT),
]
Out = Annotated[
    Path,
    typer.Option("--out", help="Data folder to write (the prep output).", rich_help_panel=OUTPUT),
]
BatchSize = Annotated[
    int,
    typer.Option("--batch-size", "-b", help="Images per batch file (B).", rich_help_panel=OUTPUT),
]
Size = Annotated[
    int, typer.Option("--size", help="Side S of the square images.", rich_help_panel=OUTPUT)
]
Layout = Annotated[
    str,
    typer.Option(
        "--layout",
        help="Batch array layout: c01b (3,S,S,B) or bc01 (B,3,S,S).",
        rich_help_panel=OUTPUT,
    ),
]
Last = Annotated[
    str,
    typer.Option(
        "--last",
        help="Train's last partial batch: drop or pad (label -1).",
        rich_help_panel=OUTPUT,
    ),
]
ValLast = Annotated[
    str,
    typer.Option(
        "--val-last",
        help="Val's last partial batch: pad (label -1) or drop.",
        rich_help_panel=OUTPUT,
    ),
]
Seed = Annotated[
    int, typer.Option("--seed", help="Seed of the train shuffle.", rich_help_panel=OUTPUT)
]
Gt = Annotated[
    Path | None,
    typer.Option(
        "--gt",
        help="Val ground-truth file (default: val_ground_truth.txt etc. in SRC).",
        rich_help_panel=INPUT,
    ),
]
GtBase = Annotated[
    str,
    typer.Option(
        "--gt-base",
        help="Integer ground-truth labels are auto, 0- or 1-based.",
        rich_help_panel=INPUT,
    ),
]
NProcs = Annotated[
    int | None,
    typer.Option(
        "-n",
        "--np",
        help="Launch this many MPI ranks with mpirun (omit under mpirun); across machines "
        "add --hostfile or -H.",
        rich_help_panel=LAUNCH,
    ),
]


Hostfile = Annotated[str | None, PLACEMENT_FLAGS["hostfile"].option(LAUNCH)]
Hosts = Annotated[str | None, PLACEMENT_FLAGS["hosts"].option(LAUNCH)]
MpiArgs = Annotated[str | None, PLACEMENT_FLAGS["mpi_args"].option(LAUNCH)]


def _size() -> tuple[int, int]:
    """(rank, size); before MPI starts, the rank mpirun put in the environment and size 1.

    Errors raised before MPI starts come from flag checks that every rank makes alike, so
    reporting size 1 there lets rank 0 alone print them.
    """
    if "mpi4py.MPI" not in sys.modules:
        from theanompi.comm import rank_from_env

        return rank_from_env(), 1
    from theanompi.comm import world

    w = world()
    return w.Get_rank(), w.Get_size()


def _guard(fn: F) -> F:
    """Run a command: a ``UserError`` becomes one line ``tmpi: error: ...`` and its exit code.

    An error every rank raised together (``collective``) is printed by rank 0 only; one raised
    by a single rank of several aborts the job so that no rank waits forever.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except UserError as err:
            rank, size = _size()
            if size == 1 or getattr(err, "collective", False):
                if rank == 0:
                    print(f"tmpi: error: {err}", file=sys.stderr, flush=True)
                if size > 1:
                    # Every rank raised it. Only rank 0 exits non-zero, after the others have
                    # returned, so mpirun cannot kill it before its line is out; the job's
                    # exit code is still rank 0's.
                    from theanompi.comm import world

                    world().Barrier()
                    raise typer.Exit(err.exit_code if rank == 0 else 0) from None
                from theanompi.comm import let_rank0_report

                let_rank0_report()  # before MPI starts (a flag error): rank 0 prints first
                raise typer.Exit(err.exit_code) from None
            print(f"tmpi: error on rank {rank}/{size}: {err}", file=sys.stderr, flush=True)
            from theanompi.comm import world

            world().Abort(err.exit_code)
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
        except Exception:
            rank, size = _size()
            if size == 1:
                raise
            traceback.print_exc()
            from theanompi.comm import world

            world().Abort(EXIT_FAILURE)

    return wrapper  # type: ignore[return-value]


def _launch(
    n: int | None,
    hostfile: str | None = None,
    hosts: str | None = None,
    mpi_args: str | None = None,
) -> None:
    """With ``-n N`` outside mpirun, rerun this command under ``mpirun -n N`` (on the hosts of
    ``--hostfile`` / ``-H``, with ``--mpi-args``) and exit with its code."""
    from theanompi.comm import under_mpirun

    if n is None:
        return
    if n < 1:
        raise ConfigError(f"-n must be >= 1, got {n}")
    if under_mpirun() or os.environ.get("THEANOMPI_LAUNCHED"):
        from theanompi.launch.launcher_watch import watch_launcher

        watch_launcher()  # started by `tmpi prep ... -n N`: stop when the launcher is gone
        if not os.environ.get("THEANOMPI_LAUNCHED"):
            from theanompi.comm import world

            if world().Get_size() != n:
                raise ConfigError(
                    f"-n {n} given but mpirun started {world().Get_size()} ranks; drop -n under mpirun"
                )
        return
    if n == 1:
        return
    from theanompi.launch.hosts import Placement
    from theanompi.launch.mpirun import relaunch

    argv = sys.argv[1:]
    if argv[:1] != ["prep"]:  # started as `python -m prep.cli ...`
        argv = ["prep", *argv]
    placement = Placement.from_flags(hostfile, hosts, mpi_args)
    raise typer.Exit(relaunch(n, argv, placement=placement))


def _log(*args: Any) -> None:
    from theanompi.comm import log

    log(*args)


def _do_scan(src: Path, out: Path, gt: Path | None, gt_base: str) -> None:
    from prep import scan as stage

    tree = stage.run(src, out, gt, gt_base)
    skipped = tree.get("skipped", [])
    _log(
        f"scan: {len(tree['train'])} train + {len(tree['val'])} val images, "
        f"{len(tree['classes'])} classes; val labels from {tree['val_labels_from']}; "
        f"skipped {len(skipped)}"
        + (f" (e.g. {skipped[0]['path']}: {skipped[0]['reason']})" if skipped else "")
    )


def _do_shuffle(out: Path, seed: int) -> None:
    from prep import shuffle as stage

    n = stage.run(out, seed)
    _log(f"shuffle: {n} train files, seed {seed} -> {out / 'misc' / stage.FILENAME}")


def _do_batch(out: Path, batch_size: int, size: int, layout: str, last: str, val_last: str) -> None:
    from prep import batch as stage
    from theanompi.io.dataset import read_manifest

    stats = stage.run(out, batch_size, size, layout, last, val_last)
    if _size()[0] != 0:
        return
    man = read_manifest(out)
    t, v = man["train"], man["val"]
    _log(
        f"batch: train {t['n_batches']} x {batch_size} ({t['n_images']} images, "
        f"{t['n_dropped']} dropped, {t['n_padded']} padded), val {v['n_batches']} x {batch_size} "
        f"({v['n_images']} images, {v['n_dropped']} dropped, {v['n_padded']} padded); "
        f"wrote {stats['written']}, kept {stats['reused']}; {stats['images']} images in "
        f"{stats['seconds']:.2f} s = {stats['images_per_s']:,.0f} img/s on {_size()[1]} rank(s)"
    )


def _do_mean(out: Path) -> None:
    from prep import mean as stage

    m = stage.run(out)
    _log(
        f"mean: {out / 'misc' / 'img_mean.npy'} {tuple(m.shape)}, per-channel mean {', '.join(f'{v:.2f}' for v in m.mean(axis=(1, 2)))}"
    )


def _do_labels(out: Path) -> None:
    from prep import labels as stage

    res = stage.run(out)
    _log("labels: " + ", ".join(f"{s} {len(v)}" for s, v in res.items()) + f" -> {out / 'labels'}")


def _do_verify(out: Path) -> None:
    from prep import verify as stage

    res = stage.run(out)
    _log(f"verify: {res['batches']} batches OK, checksum {res['checksum'][:16]}")


@app.command()
@_guard
def scan(
    src: Src,
    out: Out,
    gt: Gt = None,
    gt_base: GtBase = "auto",
    n: NProcs = None,
    hostfile: Hostfile = None,
    hosts: Hosts = None,
    mpi_args: MpiArgs = None,
) -> None:
    """List classes and files, read the val ground truth, decode-check every image (skip bad)."""
    _launch(n, hostfile, hosts, mpi_args)
    _do_scan(src, out, gt, gt_base)


@app.command()
@_guard
def shuffle(out: Out, seed: Seed = 1234) -> None:
    """Write the seeded, reproducible train order (misc/shuffled_train_filenames.txt)."""
    _do_shuffle(out, seed)


@app.command()
@_guard
def batch(
    out: Out,
    batch_size: BatchSize = 128,
    size: Size = 256,
    layout: Layout = "c01b",
    last: Last = "drop",
    val_last: ValLast = "pad",
    n: NProcs = None,
    hostfile: Hostfile = None,
    hosts: Hosts = None,
    mpi_args: MpiArgs = None,
) -> None:
    """Decode, resize, centre-crop and write the hickle batches, dealt round-robin over the ranks."""
    from prep.batch import validate_options

    validate_options(batch_size, size, layout, last, val_last)
    _launch(n, hostfile, hosts, mpi_args)
    _do_batch(out, batch_size, size, layout, last, val_last)


@app.command()
@_guard
def mean(
    out: Out,
    n: NProcs = None,
    hostfile: Hostfile = None,
    hosts: Hosts = None,
    mpi_args: MpiArgs = None,
) -> None:
    """Exact float32 mean image over the train batches (misc/img_mean.npy)."""
    _launch(n, hostfile, hosts, mpi_args)
    _do_mean(out)


@app.command()
@_guard
def labels(out: Out) -> None:
    """Write labels/train_labels.npy and labels/val_labels.npy aligned with the batches."""
    _do_labels(out)


@app.command()
@_guard
def verify(
    out: Out,
    n: NProcs = None,
    hostfile: Hostfile = None,
    hosts: Hosts = None,
    mpi_args: MpiArgs = None,
) -> None:
    """Re-read every batch: shapes, dtype, labels and checksums against the manifest."""
    _launch(n, hostfile, hosts, mpi_args)
    _do_verify(out)


@app.command("all")
@_guard
def all_(
    src: Src,
    out: Out,
    batch_size: BatchSize = 128,
    size: Size = 256,
    layout: Layout = "c01b",
    last: Last = "drop",
    val_last: ValLast = "pad",
    seed: Seed = 1234,
    gt: Gt = None,
    gt_base: GtBase = "auto",
    n: NProcs = None,
    hostfile: Hostfile = None,
    hosts: Hosts = None,
    mpi_args: MpiArgs = None,
) -> None:
    """Run every stage: scan, shuffle, batch, mean, labels, verify (resumable)."""
    from prep.batch import validate_options

    validate_options(batch_size, size, layout, last, val_last)
    _launch(n, hostfile, hosts, mpi_args)
    _do_scan(src, out, gt, gt_base)
    _do_shuffle(out, seed)
    _do_batch(out, batch_size, size, layout, last, val_last)
    _do_mean(out)
    _do_labels(out)
    _do_verify(out)


@app.command()
@_guard
def demo(
    out: Out,
    n_val: Annotated[int, typer.Option("--n-val", help="Images held out for val.")] = 256,
    image_size: Annotated[int, typer.Option("--image-size", help="Side of the saved JPEGs.")] = 64,
) -> None:
    """Write scikit-learn's digits (1,797 real scans, 10 classes) as an ImageNet-layout JPEG tree."""
    from prep.demo import write_demo

    res = write_demo(out, n_val=n_val, image_size=image_size)
    _log(f"demo: {res['train']} train + {res['val']} val JPEGs, {res['classes']} classes -> {out}")


if __name__ == "__main__":
    app()
