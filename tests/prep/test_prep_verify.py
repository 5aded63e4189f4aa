"""verify: passes on good output, names a batch whose content changed."""

from __future__ import annotations

import shutil
from pathlib import Path

import hickle
import pytest

from prep import verify
from theanompi.errors import DataError
from theanompi.io import dataset as io


def test_verify_ok_and_detects_change(prepped: Path, tmp_path: Path) -> None:
    assert io.read_manifest(prepped)["verified"] == io.read_manifest(prepped)["checksum"]
    out = tmp_path / "d"
    shutil.copytree(prepped, out)
    f = io.batch_files(out, "val")[0]
    arr = io.load_batch(f)
    arr[0, 0, 0, 0] ^= 1
    hickle.dump(arr, str(f), mode="w")
    with pytest.raises(DataError, match="1 of 5 batches bad"):
        verify.run(out)
    f.unlink()
    with pytest.raises(DataError, match="missing"):
        verify.run(out)
