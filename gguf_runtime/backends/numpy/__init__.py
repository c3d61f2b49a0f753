"""The numpy backend: float32 reference of ``model.forward`` (the oracle of the CUDA kernels)."""

from .backend import NumpyBackend

__all__ = ["NumpyBackend"]
