"""FusionBuffer, StreamingFusion, the compressors and the local kernels (numpy/numba, no MPI)."""

from __future__ import annotations

import numpy as np
import pytest

from theanompi.exchange._fusion import FusionBuffer, StreamingFusion, split_by_size
from theanompi.exchange._kernels import NumpyKernels, kernels
from theanompi.exchange.compression import COMPRESSORS, FP16Compression, NoCompression


def test_pack_unpack_round_trip_and_padding() -> None:
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in [(1,), (7,), (3, 4, 5, 2)]]
    arrays.append(np.asfortranarray(rng.standard_normal((5, 3)).astype(np.float32)))
    fb = FusionBuffer([a.size for a in arrays], multiple=8)
    assert fb.count == 1 + 7 + 120 + 15 and fb.padded_count == 144
    fb.pack(arrays)
    assert np.array_equal(fb.buffer[: fb.count], np.concatenate([a.ravel() for a in arrays]))
    assert not fb.buffer[fb.count :].any()
    out = [np.zeros_like(a) for a in arrays]
    fb.unpack(out)
    for a, b in zip(arrays, out, strict=True):
        assert np.array_equal(a, b)
    fb.unpack(out, NoCompression(size=4, op="mean"))
    assert np.array_equal(out[2], arrays[2] / np.float32(4))
    assert np.array_equal(out[3], arrays[3] / np.float32(4)) and out[3].flags.f_contiguous
    assert [c.size for c in (fb.chunk(j, 8) for j in range(8))] == [18] * 8


@pytest.mark.parametrize("segment", [1, 5, 7, 128, 10_000])
def test_streaming_fusion_covers_every_element_once(segment: int) -> None:
    """Segments are full but the last, each piece lies inside one, and together they tile every array."""
    rng = np.random.default_rng(segment)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in [(1,), (7,), (3, 4, 5, 2), (13,)]]
    arrays.append(np.asfortranarray(rng.standard_normal((5, 3)).astype(np.float32)))
    sf = StreamingFusion([a.size for a in arrays], segment)
    covered = [np.zeros(a.size, int) for a in arrays]
    for i, (used, pieces) in enumerate(sf.segments):
        assert used == sum(n for *_, n in pieces) and 0 < used <= segment
        assert used == segment or i == len(sf.segments) - 1
        ends = [s0 + n for _, _, s0, n in pieces]
        assert [s0 for _, _, s0, _ in pieces] == [0, *ends[:-1]]  # back to back
        for k, a0, _, n in pieces:
            covered[k][a0 : a0 + n] += 1
    assert all((c == 1).all() for c in covered)
    seen: list[np.ndarray] = []

    def times_three(buf: np.ndarray) -> None:  # stands in for the Allreduce of 3 equal ranks
        seen.append(buf.copy())
        np.multiply(buf, 3, out=buf)

    out = [a.copy(order="A") for a in arrays]
    sf.reduce(out, times_three, NoCompression(size=2, op="mean"))
    assert np.array_equal(np.concatenate(seen), np.concatenate([a.ravel() for a in arrays]))
    for a, b in zip(arrays, out, strict=True):
        assert np.array_equal(b, (a * np.float32(3)) / np.float32(2))
    assert out[-1].flags.f_contiguous  # written back into the caller's array
    sf.reduce(out, lambda buf: None, NoCompression(size=2, op="sum"))
    assert np.array_equal(out[2], (arrays[2] * np.float32(3)) / np.float32(2))


@pytest.mark.parametrize("segment", [1, 7, 10_000])
def test_streaming_fusion_with_fp16_wire(segment: int) -> None:
    """The scratch holds float16 bits; arrays come back as float16(x / N) * N-rank sums."""
    rng = np.random.default_rng(segment)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in [(1,), (7,), (3, 4, 5)]]
    arrays.append(np.asfortranarray(rng.standard_normal((5, 3)).astype(np.float32)))
    c = FP16Compression(size=4, op="sum")
    sf = StreamingFusion([a.size for a in arrays], segment, c.wire_dtype)
    assert sf.scratch.dtype == np.uint16
    out = [a.copy(order="A") for a in arrays]
    sf.reduce(out, lambda buf: None, c)  # one rank's value stands for the sum
    for a, b in zip(arrays, out, strict=True):
        want = (a / np.float32(4)).astype(np.float16).astype(np.float32) * np.float32(4)
        assert np.array_equal(b, want)


def test_split_by_size() -> None:
    arrays = [np.zeros(10, np.float32), np.zeros(100, np.float32), np.zeros((10, 10), order="F")]
    assert split_by_size(arrays, 50) == ([0, 2], [1])
    assert split_by_size(arrays, 0) == ([2], [0, 1])


def test_kernels_match_numpy_bit_for_bit() -> None:
    k = kernels()
    x = np.random.default_rng(1).standard_normal(100_003).astype(np.float32)
    x[:8] = [0, -0.0, 1e-9, 3e-6, 65504, 65520, np.inf, np.nan]
    for scale in (1.0, 0.25):
        h, ref = np.empty(x.size, np.uint16), np.empty(x.size, np.uint16)
        with np.errstate(all="ignore"):
            k.to_half(x, scale, h)
            NumpyKernels.to_half(x, scale, ref)
        assert np.array_equal(h, ref)
    bits = np.arange(65536).astype(np.uint16)
    y, yref = np.empty(65536, np.float32), np.empty(65536, np.float32)
    with np.errstate(all="ignore"):
        k.from_half(bits, 8.0, y)
        NumpyKernels.from_half(bits, 8.0, yref)
    assert np.array_equal(y, yref, equal_nan=True)


@pytest.mark.parametrize("n", [1, 2, 8])
def test_sum_rows_is_the_sum(n: int) -> None:
    """Regression for Theano-MPI's GPU sum kernel (looped ``i < ranksize`` instead of ``j``)."""
    k = kernels()
    rows = np.random.default_rng(n).standard_normal((n, 9001)).astype(np.float32)
    out = np.empty(rows.shape[1], np.float32)
    k.sum_rows(rows, 1.0 / n, out)
    np.testing.assert_allclose(out, rows.astype(np.float64).mean(0), rtol=0, atol=1e-6)
    half = np.empty(rows.shape[1], np.uint16)
    k.sum_rows_half((rows / n).astype(np.float16).view(np.uint16), half)
    np.testing.assert_allclose(half.view(np.float16), rows.mean(0), rtol=2e-3, atol=1e-3)


def test_add_half_matches_numpy_and_saturates() -> None:
    """Every float16 plus another: numba == numpy; finite sums past 65504 stay finite."""
    k = kernels()
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    a = np.random.default_rng(3).permutation(bits)
    got, ref = bits.copy(), bits.copy()
    with np.errstate(all="ignore"):
        k.add_half(a, got)
        NumpyKernels.add_half(a, ref)
    assert np.array_equal(got.view(np.float16), ref.view(np.float16), equal_nan=True)
    x = np.array([65504, -65504, 65504, 1, np.inf, -np.inf, np.nan], np.float16).view(np.uint16)
    y = np.array([16, -16, 65504, 2, 1, 1, 1], np.float16).view(np.uint16)
    with np.errstate(all="ignore"):
        k.add_half(x, y)
    got = y.view(np.float16)
    assert got[:6].tolist() == [65504, -65504, 65504, 3, np.inf, -np.inf] and np.isnan(got[6])


@pytest.mark.parametrize("name", list(COMPRESSORS))
@pytest.mark.parametrize("n", [1, 3, 4])
@pytest.mark.parametrize("op", ["mean", "sum"])
def test_compress_sum_decompress_is_the_op(name: str, n: int, op: str) -> None:
    """N simulated ranks: compress each, add the wire buffers (pairwise and by rows), decompress."""
    rng = np.random.default_rng(n)
    xs = rng.standard_normal((n, 1001)).astype(np.float32)
    xs[:, 0] = 65504  # the largest float16 on every rank: must not become inf
    c = COMPRESSORS.get(name)(n, op)
    wires = np.stack([c.empty(xs.shape[1]) for _ in range(n)])
    for x, w in zip(xs, wires, strict=True):
        c.compress(x, w)
    rows = c.empty(xs.shape[1])
    c.sum_rows(wires, rows)
    for w in wires[1:]:
        c.add(wires[0], w)
    exact = xs.astype(np.float64).sum(0) / (n if op == "mean" else 1)
    rtol, atol = c.error_bound(n)  # n roundings: the most of any order of sums
    bound = (rtol * np.abs(xs).astype(np.float64).sum(0) + atol * n) / (n if op == "mean" else 1)
    for summed in (wires[0], rows):
        out = np.empty(xs.shape[1], np.float32)
        c.decompress(summed, out)
        assert np.all(np.abs(out - exact) <= bound), np.max(np.abs(out - exact) / bound)
        assert out[0] == exact[0]
