"""resize: the C and numba filters vs a plain float64 reference and vs Pillow; the c01b transpose vs numpy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from prep import resize

# (width, height) -> S: downscales (the common case, and big ones with many taps), upscales of
# tiny images, a square at its own size, extreme aspect ratios, an output of 1 pixel
CASES = [
    ((500, 375), 256),
    ((375, 500), 224),
    ((640, 480), 64),
    ((2000, 1500), 64),
    ((120, 90), 32),
    ((20, 20), 16),
    ((31, 17), 16),
    ((3, 2), 16),
    ((5, 7), 16),
    ((2, 9), 5),
    ((1, 1), 4),
    ((300, 200), 300),
    ((64, 64), 64),
    ((1000, 30), 7),
    ((40, 30), 1),
]


@pytest.fixture(autouse=True, params=["c", "numba"])
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> object:
    """Every test below runs on both kernel sets: the C build and the numba fallback."""
    if request.param == "c":
        from prep import _c_kernels

        found = _c_kernels.load()
        if found is None:
            pytest.skip("no C compiler: the numba kernels are the ones in use")
    else:
        from prep import _numba_kernels as found
    monkeypatch.setattr(resize, "kernels", lambda: found)
    return found


def _images(fx, w: int, h: int) -> list[np.ndarray]:
    """A photo-like image and pure noise (the worst case for rounding)."""
    noise = np.random.default_rng(w * 1000 + h).integers(0, 256, (h, w, 3), dtype=np.uint8)
    return [np.asarray(fx.photo(w, h, w + h)), noise]


def _ours(img: np.ndarray, size: int) -> np.ndarray:
    return resize.resize_into(img, np.empty((3, size, size), np.uint8)).transpose(1, 2, 0)


def test_cases_reach_every_kernel_branch() -> None:
    """The kernels unroll 2, 3 and 4 vertical taps and 3 and 4 horizontal ones: CASES reach all."""
    kx, counts = set(), set()
    for (w, h), size in CASES:
        x0, y0, x1, y1 = resize.centre_box(w, h)
        kx.add(resize.taps(w, x0, x1, size).weight.shape[1])
        counts.update(resize.taps(h, y0, y1, size).count.tolist())
    assert {2, 3, 4} <= kx and max(kx) > 4
    assert {1, 2, 3, 4} <= counts and max(counts) > 4


@pytest.mark.parametrize(("wh", "size"), CASES)
def test_taps_are_pillows_coefficients(fx, wh: tuple[int, int], size: int) -> None:
    for n in wh:
        m = min(wh)
        got = resize.taps(n, (n - m) / 2, (n + m) / 2, size)
        ref = fx.bilinear_taps(n, (n - m) / 2, (n + m) / 2, size)
        assert got.weight.shape[1] == max(len(ws) for _, ws in ref)
        for i, (lo, ws) in enumerate(ref):
            assert got.first[i] == lo and got.count[i] == len(ws)
            np.testing.assert_array_equal(got.weight[i, : len(ws)], ws)
            assert not got.weight[i, len(ws) :].any()
            assert abs(sum(ws) - 1.0) < 1e-12


@pytest.mark.parametrize(("wh", "size"), CASES)
def test_resize_equals_float64_reference(fx, wh: tuple[int, int], size: int) -> None:
    """Same filter, same order of additions, both float64: equal to the last bit, so exactly."""
    for img in _images(fx, *wh):
        np.testing.assert_array_equal(_ours(img, size), fx.reference_resize(img, size))


@pytest.mark.parametrize(("wh", "size"), CASES)
def test_resize_within_one_of_pillow(fx, wh: tuple[int, int], size: int) -> None:
    """Pillow rounds to uint8 between its passes (fixed point): at most 1 apart, mostly equal.

    The bound holds for the tiny upscaled images too (the filter has no negative lobes, so
    Pillow's intermediate rounding moves a value by at most 1/2).
    """
    for img in _images(fx, *wh):
        pil = Image.fromarray(img).resize(
            (size, size), Image.Resampling.BILINEAR, box=resize.centre_box(*wh)
        )
        diff = np.abs(_ours(img, size).astype(int) - np.asarray(pil))
        assert diff.max() <= 1
        assert (diff == 0).mean() > 0.7


def test_fourth_channel_is_ignored(fx) -> None:
    img = np.asarray(fx.photo(50, 37, 5))
    junk = np.random.default_rng(0).integers(0, 256, (37, 50, 1), dtype=np.uint8)
    four = np.concatenate([img, junk], axis=2)
    np.testing.assert_array_equal(_ours(four, 24), _ours(img, 24))


def test_writes_into_a_batch_slot_only(fx) -> None:
    img = np.asarray(fx.photo(30, 20, 1))
    stage = np.full((3, 3, 8, 8), 7, np.uint8)
    resize.resize_into(img, stage[1])
    np.testing.assert_array_equal(stage[1], fx.reference_resize(img, 8).transpose(2, 0, 1))
    assert (stage[0] == 7).all() and (stage[2] == 7).all()


def test_resize_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="3, S, S"):
        resize.resize_into(np.zeros((4, 4, 2), np.uint8), np.zeros((3, 2, 2), np.uint8))
    with pytest.raises(ValueError, match="3, S, S"):
        resize.resize_into(np.zeros((4, 4, 3), np.uint8), np.zeros((3, 2, 3), np.uint8))
    with pytest.raises(ValueError, match="3, S, S"):
        resize.resize_into(np.zeros((4, 4, 3), np.float32), np.zeros((3, 2, 2), np.uint8))


@pytest.mark.parametrize(
    "shape",
    [(64, 3, 32, 32), (8, 3, 2, 4), (16, 1, 1, 8), (128, 3, 8, 8), (4, 3, 16, 16), (3, 3, 5, 5)],
)
def test_transpose_equals_numpy(shape: tuple[int, ...]) -> None:
    """8x8 word blocks (B and the image size multiples of 8) and the byte path (the rest)."""
    stage = np.random.default_rng(sum(shape)).integers(0, 256, shape, dtype=np.uint8)
    out = np.empty(shape[1:] + shape[:1], np.uint8)
    assert resize.transpose_into(stage, out) is out
    np.testing.assert_array_equal(out, stage.transpose(1, 2, 3, 0))


def test_transpose_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="cannot transpose"):
        resize.transpose_into(np.zeros((8, 3, 2, 2), np.uint8), np.zeros((3, 2, 2, 4), np.uint8))
    with pytest.raises(ValueError, match="cannot transpose"):
        out = np.zeros((8, 3, 2, 2), np.uint8).transpose(1, 2, 3, 0)  # right shape, not contiguous
        resize.transpose_into(np.zeros((8, 3, 2, 2), np.uint8), out)


def test_c_kernels_build_once_into_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: object
) -> None:
    """Built on first use under $THEANOMPI_CACHE/prep, loaded from there next time; no
    compiler (or ``THEANOMPI_PREP_KERNELS=numba``) gives None: the numba kernels are used."""
    from prep import _c_kernels

    monkeypatch.setenv("THEANOMPI_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # no compiler
    assert _c_kernels.load() is None and not list(tmp_path.rglob("*.so"))
    (marker,) = tmp_path.rglob("*.failed-false")  # the next process does not try again
    monkeypatch.setenv("CC", str(tmp_path / "false"))  # marked by compiler name, any path
    assert _c_kernels.load() is None
    marker.unlink()
    if not isinstance(kernels, _c_kernels.CKernels):
        return
    monkeypatch.delenv("CC")
    assert _c_kernels.load() is not None
    (lib,) = tmp_path.rglob("*.so")
    assert lib == _c_kernels.library_path() and lib.parent == tmp_path / "prep"
    assert [p.name for p in lib.parent.iterdir()] == [lib.name]  # no temp files or marker left
    stamp = lib.stat().st_mtime_ns
    monkeypatch.setenv("CC", "false")  # a second process: loads, does not build
    assert _c_kernels.load() is not None and lib.stat().st_mtime_ns == stamp
    monkeypatch.setenv(_c_kernels.DISABLE_ENV, "numba")
    assert _c_kernels.load() is None
