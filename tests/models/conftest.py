"""Fixtures for model tests: the digits demo data (sklearn digits upscaled to 32x32 RGB,
loaded directly, no prep package) and a minimal run config."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


def _digits_32(n_train: int = 1400, seed: int = 0):
    """(x_train, y_train, x_val, y_val): float32 (n, 3, 32, 32) mean-subtracted, 0..255 units."""
    from sklearn.datasets import load_digits

    d = load_digits()
    img = d.images.astype(np.float32) * np.float32(255 / 16)  # (n, 8, 8)
    img = np.kron(img, np.ones((4, 4), np.float32))  # nearest upscale to 32x32
    x = np.repeat(img[:, None], 3, axis=1)
    y = d.target.astype(np.int32)
    idx = np.random.default_rng(seed).permutation(len(y))
    x, y = x[idx], y[idx]
    mean = x[:n_train].mean(axis=0)
    return x[:n_train] - mean, y[:n_train], x[n_train:] - mean, y[n_train:]


def random_crops(x: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """One random ``size`` crop (same offset for the whole batch) of (b, C, S, S)."""
    oy, ox = rng.integers(0, x.shape[-1] - size + 1, 2)
    return np.ascontiguousarray(x[:, :, oy : oy + size, ox : ox + size])


@pytest.fixture(scope="session")
def digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_val, y_val) of the digits demo data, 1400 train / 397 val."""
    return _digits_32()


@pytest.fixture(scope="session")
def crops():
    """``crops(x, size, rng)``: one random crop per batch."""
    return random_crops


@pytest.fixture(scope="session")
def run_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run config with the digits data settings (32x32 stored, 128 per file)."""
    path = tmp_path_factory.mktemp("cfg") / "config.yaml"
    path.write_text("data:\n  image_size: 32\n  file_batch_size: 128\n")
    return path


def _photos(size: int, n: int, n_classes: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` photo-like images (x float32 (n, 3, size, size) mean-subtracted, 0..255 units;
    y int32): smooth colour gradients, texture and noise, each a real JPEG round trip
    (Pillow, quality 90). The class sets the texture's orientation and frequency, so a
    convnet can learn it; the rest varies per image."""
    import io

    from PIL import Image

    rng = np.random.default_rng(seed)
    y = rng.integers(0, n_classes, n).astype(np.int32)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64) / size
    out = np.empty((n, 3, size, size), np.float32)
    for i, c in enumerate(y):
        ang = np.pi * c / n_classes
        freq = 3 + 2 * (c % 3)
        phase = rng.uniform(0, 2 * np.pi)
        tex = np.sin(2 * np.pi * freq * (xx * np.cos(ang) + yy * np.sin(ang)) + phase)
        tint = rng.uniform(60, 200, 3)
        grad = rng.uniform(-60, 60, 3)
        img = tint[:, None, None] + grad[:, None, None] * (xx + yy) / 2 + 50 * tex
        img = img + rng.normal(0, 10, img.shape)
        arr = np.clip(img, 0, 255).astype(np.uint8).transpose(1, 2, 0)
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="JPEG", quality=90)
        buf.seek(0)
        out[i] = np.asarray(Image.open(buf).convert("RGB"), np.float32).transpose(2, 0, 1)
    return out - out.mean(axis=0), y


@pytest.fixture(scope="session")
def photos():
    """``photos(size, n, n_classes, seed=0) -> (x, y)``: photo-like JPEG images (see
    :func:`_photos`), raw 0..255 minus the mean image, as prep writes them."""
    return _photos
