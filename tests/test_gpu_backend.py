"""The CUDA backend against the numpy backend on shape twins (real headers, random weights).

Twins come from GGUF_TWIN_DIR (made on the GPU machine by bench/gpu_session.sh with
`gguf-run synth --fill`): smollm2.gguf and gemma3.gguf.
"""

import os

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from gguf_runtime.backend_cuda import CudaBackend  # noqa: E402
from gguf_runtime.backend_numpy import NumpyBackend  # noqa: E402
from gguf_runtime.backends import host_sample_loop  # noqa: E402
from gguf_runtime.gguf_file import open_gguf  # noqa: E402
from gguf_runtime.model_config import config_from_gguf  # noqa: E402
from gguf_runtime.sampling import SamplingParams  # noqa: E402

TWINS = ("smollm2", "gemma3")


def twin_path(name):
    d = os.environ.get("GGUF_TWIN_DIR")
    path = os.path.join(d, f"{name}.gguf") if d else None
    if not path or not os.path.isfile(path):
        pytest.skip(f"no {name} twin: set GGUF_TWIN_DIR (bench/gpu_session.sh makes them)")
    return path


@pytest.fixture(scope="module", params=TWINS)
def pair(request):
    f = open_gguf(twin_path(request.param))
    cfg = config_from_gguf(f)
    return f, cfg, NumpyBackend(f, cfg, 256), CudaBackend(f, cfg, 256)


def cosines(a, b):
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.mark.parametrize("n", [7, 40])  # 7: matvec kernels; 40: the cuBLAS prefill path
def test_logits_match_numpy(pair, n):
    f, cfg, npb, cub = pair
    rng = np.random.default_rng()
    ids = rng.integers(0, cfg.n_vocab, n).tolist()
    npb.truncate(0)
    cub.truncate(0)
    ref = npb.eval(ids, all_logits=True)
    got = cub.eval(ids, all_logits=True)
    c = cosines(got, ref)
    assert c.min() >= 0.999, c
    agree = (got.argmax(-1) == ref.argmax(-1)).mean()
    assert agree >= (1.0 if n <= 8 else 0.9), agree
    # one decode step on top of the prompt
    ref1 = npb.eval([5])
    got1 = cub.eval([5])
    assert cosines(got1, ref1).min() >= 0.999


def test_prefill_f16_weights_resident_or_scratch(pair, monkeypatch):
    """The cuBLAS prefill (Q/K/V and gate/up stacked): the twins keep resident f16 copies; with
    the budget at 0 every group is dequantized into the scratch buffer instead (the 8B's path).
    Both give the numpy backend's logits."""
    from gguf_runtime import cuda_f16

    f, cfg, npb, cub = pair
    assert cub.blocks.f16.resident
    monkeypatch.setattr(cuda_f16, "RESIDENT_MAX_BYTES", 0)
    scratch = CudaBackend(f, cfg, 256)
    assert not scratch.blocks.f16.resident
    ids = np.random.default_rng().integers(0, cfg.n_vocab, 60).tolist()
    npb.truncate(0)
    ref = npb.eval(ids, all_logits=True)
    for be in (cub, scratch):
        be.truncate(0)
        got = be.eval(ids, all_logits=True)
        assert cosines(got, ref).min() >= 0.999
        assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_greedy_tokens_match_numpy(pair):
    f, cfg, npb, cub = pair
    prompt = [1, 17, 300, 4000, 9, 52]
    params = SamplingParams(temperature=0.0)
    npb.truncate(0)
    npb.prefill(prompt)
    want = list(host_sample_loop(npb, 32, params, prompt, frozenset()))
    cub.truncate(0)
    cub.prefill(prompt)
    got = list(cub.sample_loop(32, params, prompt, frozenset()))
    assert got == want


def test_no_allocation_while_decoding(pair):
    f, cfg, npb, cub = pair
    pool = cp.get_default_memory_pool()
    params = SamplingParams(temperature=0.7, top_k=40, seed=3)
    cub.truncate(0)
    cub.prefill([1, 2, 3])
    list(cub.sample_loop(4, params, [1, 2, 3], frozenset()))  # warm up every kernel
    cub.stream.synchronize()
    before = (pool.used_bytes(), pool.total_bytes())
    cub.truncate(0)
    cub.prefill([1, 2, 3])
    out = list(cub.sample_loop(100, params, [1, 2, 3], frozenset()))
    cub.stream.synchronize()
    assert len(out) == 100
    assert (pool.used_bytes(), pool.total_bytes()) == before
