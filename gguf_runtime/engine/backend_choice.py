"""Choosing a backend: CUDA where CuPy finds a GPU (``auto``), else numpy, or the one asked for."""

from __future__ import annotations

from typing import Callable

from ..errors import BackendError
from ..format.gguf_file import GGUFFile
from ..format.model_config import ModelConfig

BACKENDS = ("auto", "cuda", "numpy")
def cuda_available() -> tuple[bool, str]:
    """(usable, reason if not)."""
    try:
        import cupy  # noqa: F401
    except Exception:  # ImportError, or a CuPy that finds no CUDA libraries
        return False, "CuPy is not installed (pip install 'gguf-run[cuda]')"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, no device
        return False, f"no usable NVIDIA GPU ({str(e).splitlines()[0][:120]})"
    if n < 1:
        return False, "no NVIDIA GPU found"
    return True, ""


def cuda_kv_type(k: str, v: str) -> str:
    """The cuda backend's one type for keys and values ("auto", "f16", "f32", "q8_0", "q4_0") from
    -ctk / -ctv (one of them "auto": the other's)."""
    if "auto" not in (k, v) and k != v:
        raise BackendError(f"the cuda backend keeps keys and values in one type (-ctk {k} -ctv {v} differ): give "
                           "-ctk and -ctv the same type, or use --backend numpy, which keeps them apart")
    return v if k == "auto" else k


def select_backend(name: str, f: GGUFFile, cfg: ModelConfig, n_ctx: int,
                   progress: Callable[[str, int, int], None] | None = None,
                   note: Callable[[str], None] | None = None, use_graph: bool = True, max_batch: int = 1,
                   kv_tokens: int | None = None, kv_types: tuple[str, str] = ("auto", "auto"),
                   tensor_parallel: int = 1):
    if name not in BACKENDS:
        raise BackendError(f"unknown backend '{name}'; choose one of {', '.join(BACKENDS)}")
    if tensor_parallel != 1:  # a model split over GPUs: the cuda backend's ranks
        if name == "numpy" or tensor_parallel < 1:
            raise BackendError(f"--tensor-parallel {tensor_parallel}: splits a model over 2 or more GPUs with "
                               "the cuda backend; leave it at 1 otherwise")
        ok, why = cuda_available()
        if not ok:
            raise BackendError(f"--tensor-parallel {tensor_parallel} needs the cuda backend: {why}")
        from ..backends.cuda.tensor_parallel import TensorParallelBackend  # deferred: imports cupy

        return TensorParallelBackend(f, cfg, n_ctx, tensor_parallel, progress=progress, note=note,
                                     use_graph=use_graph, max_batch=max_batch, kv_tokens=kv_tokens,
                                     kv_type=cuda_kv_type(*kv_types))
    if name in ("auto", "cuda"):
        ok, why = cuda_available()
        if ok:
            from ..backends.cuda import CudaBackend  # deferred: imports cupy
            return CudaBackend(f, cfg, n_ctx, progress=progress, note=note, use_graph=use_graph,
                               max_batch=max_batch, kv_tokens=kv_tokens, kv_type=cuda_kv_type(*kv_types))
        if name == "cuda":
            raise BackendError(f"the cuda backend cannot run here: {why}; use --backend numpy")
        if note:
            note(f"note: running on the CPU with the numpy backend ({why})")
    from ..backends.numpy import NumpyBackend

    be = NumpyBackend(f, cfg, n_ctx, kv_types=tuple("f32" if t == "auto" else t for t in kv_types))
    be.preload(progress=(lambda i, n: progress("loading weights", i, n)) if progress else None)
    return be
