"""``tmpi prep``: --help everywhere, one-line errors, identical output for 1 and 2 ranks, resume."""

from __future__ import annotations

from pathlib import Path

import pytest

COMMANDS = ["scan", "shuffle", "batch", "mean", "labels", "verify", "all", "demo"]
SMALL = ["--batch-size", "4", "--size", "16"]


def _one_error_line(proc, match: str) -> None:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode != 0, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("tmpi: error: "), proc.stderr
    assert match in lines[0], lines[0]


def test_help_everywhere(cli) -> None:
    from typer.testing import CliRunner

    from prep.cli import app

    top = cli("prep", "--help")  # mounted as `tmpi prep`
    assert top.returncode == 0
    runner = CliRunner()
    for name in COMMANDS:
        assert name in top.stdout
        res = runner.invoke(app, [name, "--help"])
        assert res.exit_code == 0 and "--out" in res.output, (name, res.output)


def test_missing_folder(cli, tmp_path: Path) -> None:
    proc = cli("prep", "all", "--src", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o"))
    _one_error_line(proc, "no such folder")
    assert proc.returncode == 3


def test_empty_class_folder(fx, cli, tmp_path: Path) -> None:
    fx.make_tree(tmp_path / "src")
    (tmp_path / "src" / "train" / "n01000009").mkdir()
    proc = cli("prep", "scan", "--src", str(tmp_path / "src"), "--out", str(tmp_path / "o"))
    _one_error_line(proc, "empty class folder")


def test_ground_truth_count_mismatch(fx, cli, tmp_path: Path) -> None:
    fx.make_tree(tmp_path / "src")
    (tmp_path / "src" / "val_ground_truth.txt").write_text("1\n2\n")
    proc = cli("prep", "all", "--src", str(tmp_path / "src"), "--out", str(tmp_path / "o"))
    _one_error_line(proc, "has 2 labels but val/ has 6 images")


@pytest.mark.parametrize("value", ["0"])
def test_batch_size_not_positive(cli, tmp_path: Path, value: str) -> None:
    proc = cli(
        "prep",
        "all",
        "--src",
        str(tmp_path),
        "--out",
        str(tmp_path / "o"),
        "--batch-size",
        value,
        "-n",
        "2",
    )
    _one_error_line(proc, "--batch-size must be a positive integer")
    assert proc.returncode == 2


def _files(root: Path) -> dict[str, bytes]:
    """Every output file's bytes, but the per-rank resume journals (``digests-r<rank>.txt``)."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith("digests-r")
    }


@pytest.mark.mpi
def test_one_and_two_ranks_byte_identical_and_resume(fx, cli, mpirun, tmp_path: Path) -> None:
    fx.make_tree(tmp_path / "src")
    src = str(tmp_path / "src")
    one, two = tmp_path / "one", tmp_path / "two"
    p1 = cli("prep", "all", "--src", src, "--out", str(one), *SMALL, "--seed", "5")
    assert p1.returncode == 0, p1.stderr
    p2 = cli("prep", "all", "--src", src, "--out", str(two), *SMALL, "--seed", "5", "-n", "2")
    assert p2.returncode == 0, p2.stderr
    assert "on 2 rank(s)" in p2.stdout and "verify: 5 batches OK" in p2.stdout
    a, b = _files(one), _files(two)
    assert a.keys() == b.keys() and "train_hkl_b4/0002.hkl" in a
    assert a == b
    (two / "train_hkl_b4" / "0001.hkl").unlink()
    p3 = mpirun(2, ["-m", "theanompi.cli", "prep", "batch", "--out", str(two), *SMALL])
    assert "wrote 1, kept 4" in p3.stdout
    assert _files(two) == a


@pytest.mark.mpi
def test_error_under_mpirun_is_one_line(mpirun, tmp_path: Path) -> None:
    proc = mpirun(
        2,
        [
            "-m",
            "theanompi.cli",
            "prep",
            "scan",
            "--src",
            str(tmp_path / "none"),
            "--out",
            str(tmp_path / "o"),
        ],
        check=False,
    )
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("tmpi: error")]
    assert len(errors) == 1 and "no such folder" in errors[0], proc.stderr


@pytest.mark.mpi
def test_flag_error_under_mpirun_is_one_line(mpirun, tmp_path: Path) -> None:
    proc = mpirun(
        2,
        ["-m", "theanompi.cli", "prep", "batch", "--out", str(tmp_path), "--batch-size", "0"],
        check=False,
    )
    assert proc.returncode == 2
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("tmpi: error")]
    assert len(errors) == 1 and "--batch-size" in errors[0], proc.stderr


def test_bad_tree_runs_through_without_traceback(fx, cli, tmp_path: Path) -> None:
    """Symlink loop, non-UTF-8 and line-break names: `prep all` succeeds and lists them."""
    import json

    bad = fx.make_bad_tree(tmp_path / "src")
    out = tmp_path / "o"
    proc = cli("prep", "all", "--src", str(tmp_path / "src"), "--out", str(out), *SMALL)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "skipped 9" in proc.stdout and "verify: 5 batches OK" in proc.stdout, proc.stdout
    man = json.loads((out / "misc" / "manifest.json").read_text())
    assert set(bad) <= {s["path"] for s in man["skipped"]} and man["n_skipped"] == 9
    again = cli("prep", "shuffle", "--out", str(out))  # the list still matches the scan
    assert again.returncode == 0, again.stderr
    assert cli("prep", "batch", "--out", str(out), *SMALL).returncode == 0


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 160 KiB tmpfs mounted on a fresh folder (root only), always unmounted afterwards."""
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(disk)]
    proc = subprocess.run(mount, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield disk
    finally:
        if subprocess.run(["umount", str(disk)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2])
def test_disk_full_is_one_line_and_leaves_no_half_file(fx, cli, small_disk: Path, ranks: int):
    """Batches overflow the disk: one line naming the file, only complete batches, then resume."""
    import re
    import subprocess

    from prep import batch
    from theanompi.io import dataset as io

    fx.make_tree(small_disk.parent / "src")
    out = small_disk / "o"
    big = ["--batch-size", "4", "--size", "64", "-n", str(ranks)]
    proc = cli("prep", "all", "--src", str(small_disk.parent / "src"), "--out", str(out), *big)
    progress = re.compile(r"^prep \w+: \d+/\d+ images \(\d+%\), [\d,]+ img/s, ETA \S+\s*$")
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not progress.match(ln)]
    if ranks > 1:  # mpirun may add its own "exited with non-zero status" box: not ours
        assert "Traceback" not in proc.stderr, proc.stderr
        lines = [ln for ln in lines if ln.startswith("tmpi:")]
    assert proc.returncode == 4 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"tmpi: error: cannot write prep output '{out}/"), lines[0]
    assert "no space left" in lines[0] and "--out" in lines[0]
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]
    kept = sorted(out.glob("*_hkl_b4/*.hkl"))
    assert len(kept) < 5
    for p in kept:  # each one whole and recorded; the resume below keeps exactly these
        assert io.load_batch(p).shape == (3, 64, 64, 4)
        assert int(p.stem) in batch._recorded(p.parent)
    remount = ["mount", "-o", "remount,size=4m", str(small_disk)]
    assert subprocess.run(remount, check=False).returncode == 0
    proc = cli("prep", "all", "--src", str(small_disk.parent / "src"), "--out", str(out), *big)
    assert proc.returncode == 0 and "verify: 5 batches OK" in proc.stdout, proc.stderr
    assert f"kept {len(kept)}" in proc.stdout
