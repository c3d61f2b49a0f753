"""Choosing a backend, and the host-side sampling loop shared by backends that return logits."""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from .errors import BackendError, GGUFError
from .gguf_file import GGUFFile
from .model_config import ModelConfig
from .sampling import Sampler, SamplingParams

BACKENDS = ("auto", "cuda", "numpy")
NOT_FINITE = "the model's logits are not finite (NaN or infinity): the file's weights are damaged; re-download it"


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


def select_backend(name: str, f: GGUFFile, cfg: ModelConfig, n_ctx: int,
                   progress: Callable[[str, int, int], None] | None = None,
                   note: Callable[[str], None] | None = None, use_graph: bool = True, max_batch: int = 1,
                   kv_tokens: int | None = None):
    if name not in BACKENDS:
        raise BackendError(f"unknown backend '{name}'; choose one of {', '.join(BACKENDS)}")
    if name in ("auto", "cuda"):
        ok, why = cuda_available()
        if ok:
            from .backend_cuda import CudaBackend  # deferred: imports cupy
            return CudaBackend(f, cfg, n_ctx, progress=progress, note=note, use_graph=use_graph,
                               max_batch=max_batch, kv_tokens=kv_tokens)
        if name == "cuda":
            raise BackendError(f"the cuda backend cannot run here: {why}; use --backend numpy")
        if note:
            note(f"note: running on the CPU with the numpy backend ({why})")
    from .backend_numpy import NumpyBackend

    be = NumpyBackend(f, cfg, n_ctx)
    be.preload(progress=(lambda i, n: progress("loading weights", i, n)) if progress else None)
    return be


def host_sample_loop(backend, n: int, params: SamplingParams, history: list[int],
                     stop: frozenset[int], logits=None) -> Iterator[int]:
    """Sample from the logits the backend returned (``logits``, or its host ``last_logits``),
    yield, evaluate the token (``backend.eval`` returns host logits), repeat.

    The last token yielded is not evaluated (the caller decides whether it is kept).
    """
    sampler = Sampler(params)
    hist = list(history)
    logits = backend.last_logits if logits is None else logits
    for i in range(n):
        if not np.isfinite(logits).all():  # (no stage makes a logit infinite: the weights did)
            raise GGUFError(NOT_FINITE)
        tok = sampler.sample(logits, hist)
        yield tok
        if tok in stop or i == n - 1:
            return
        hist.append(tok)
        logits = backend.eval([tok])[-1]
