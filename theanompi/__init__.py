"""theanompi: data-parallel training of PyTensor models over MPI (BSP and EASGD)."""

__all__ = ["__version__"]

__version__ = "0.1.0"
