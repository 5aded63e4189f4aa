"""C Ops for the layers PyTensor 3 no longer ships: convolution, pooling and LRN (and a
static-shape channel concatenation).

Each forward Op has a gradient Op, a C++ implementation (BLAS GEMM for the convolutions) and
a numpy ``perform`` used by PyTensor's Python linker. :func:`compile_mode` picks the compiler
for a backend name in :data:`theanompi.models.BACKENDS` (``jax`` loads ``jax_ops``' registrations lazily).
"""

from typing import Any

from theanompi.pytensor_env import configure

configure()  # before PyTensor's first import: float32, the per-rank cache and the BLAS flags

from theanompi.models.ops import _headers  # noqa: E402

_headers.install()  # every module compiled from here on reads the common headers precompiled

from theanompi.models.ops.concat import ChannelConcat, concat_channels  # noqa: E402
from theanompi.models.ops.conv import (  # noqa: E402
    CHUNK,
    Conv2d,
    Conv2dGradInputs,
    Conv2dGradWeights,
    conv2d,
    conv_output_size,
)
from theanompi.models.ops.lrn import LRNGrad, LRNOp, lrn  # noqa: E402
from theanompi.models.ops.pool import Pool2d, Pool2dGrad, pool2d, pool_output_size  # noqa: E402
from theanompi.models.ops.recompute import recompute_batch_norm  # noqa: E402
from theanompi.models.ops.rewrites import (  # noqa: E402
    fuse_conv_relu,
    inline_softmax,
    mask_before_unpool,
)

__all__ = [
    "c_mode",
    "compile_mode",
    "jax_mode",
    "ChannelConcat",
    "concat_channels",
    "CHUNK",
    "Conv2d",
    "Conv2dGradInputs",
    "Conv2dGradWeights",
    "conv2d",
    "conv_output_size",
    "LRNOp",
    "LRNGrad",
    "lrn",
    "Pool2d",
    "Pool2dGrad",
    "pool2d",
    "pool_output_size",
    "fuse_conv_relu",
    "inline_softmax",
    "mask_before_unpool",
    "recompute_batch_norm",
]


def compile_mode(backend: str) -> Any:
    """The ``pytensor.function`` mode of ``backend``, a name in
    :data:`theanompi.models.BACKENDS` (``None``: the configured default, C). ``ConfigError``
    for an unknown name, or for ``jax`` without JAX."""
    from theanompi.models import BACKENDS

    return BACKENDS.get(backend)()


def jax_mode() -> Any:
    """PyTensor's JAX linker (jax.jit through XLA): CPU, or GPU with a CUDA jaxlib."""
    from theanompi.errors import ConfigError

    try:
        import theanompi.models.ops.jax_ops  # noqa: F401  (registers our Ops with JAX)
    except ImportError as err:
        raise ConfigError(
            f"backend 'jax' needs JAX ({err}); install it with: pip install 'theanompi[jax]'"
        ) from None
    import warnings

    from pytensor.compile.mode import get_mode

    # benign: JAX runs without x64 (int64 shapes and the float64 metric casts become 32-bit),
    # and drops PyTensor's broadcast shape Asserts (our shapes are static)
    warnings.filterwarnings("ignore", "Explicitly requested dtype (float|int)64", UserWarning)
    warnings.filterwarnings("ignore", "Skipping Assert", UserWarning)
    return get_mode("JAX")


def c_mode() -> Any:
    """PyTensor's C linker (FAST_RUN), our C++ kernels with BLAS, on CPU: the configured mode,
    its ``cvm`` linker replaced by one that compiles a cold graph's C modules in parallel
    (:mod:`theanompi.models.ops._parallel`), its rewritten graphs kept in the compile dir for
    the next process (:mod:`theanompi.models.ops._graph_cache`); ``None`` (the configured
    default) when the user chose another linker."""
    import pytensor
    from pytensor.compile.mode import get_default_mode

    from theanompi.models.ops._graph_cache import CachedRewriteMode
    from theanompi.models.ops._parallel import ParallelCVMLinker

    if pytensor.config.linker != "cvm":
        return None
    default = get_default_mode()
    return CachedRewriteMode(linker=ParallelCVMLinker(), optimizer=default.provided_optimizer)
