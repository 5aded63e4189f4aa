"""C Ops for the layers PyTensor 3 no longer ships: convolution, pooling and LRN (and a
static-shape channel concatenation).

Each forward Op has a gradient Op, a C++ implementation (BLAS GEMM for the convolutions) and
a numpy ``perform`` used by PyTensor's Python linker.
"""

from theanompi.pytensor_env import configure

configure()  # before PyTensor's first import: float32, the per-rank cache and the BLAS flags

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

__all__ = [
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
]
