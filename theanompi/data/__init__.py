"""Data path of training: prep batch files -> mean-subtracted, cropped (b, C, H, W) float32 per rank."""

from theanompi.data.loader import DataSet, Prefetcher, TrainLoader, ValLoader, prepare_batch

__all__ = ["DataSet", "Prefetcher", "TrainLoader", "ValLoader", "prepare_batch"]
