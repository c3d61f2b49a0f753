"""The CUDA backend: weights, paged KV cache, workspace, fused blocks, prefill, graphs, tuning.

``backend`` and everything it imports need CuPy; ``tuning`` does not (the CPU tests read it).
"""


def __getattr__(name: str):
    if name == "CudaBackend":  # deferred: imports CuPy
        from .backend import CudaBackend

        return CudaBackend
    raise AttributeError(name)
