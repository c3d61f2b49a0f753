"""Graph replay of the decode step: same tokens as eager, one launch per token, no allocation."""

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from gguf_runtime.backend_cuda import CudaBackend  # noqa: E402
from gguf_runtime.gguf_file import open_gguf  # noqa: E402
from gguf_runtime.model_config import config_from_gguf  # noqa: E402
from gguf_runtime.sampling import SamplingParams  # noqa: E402

from test_gpu_backend import TWINS, twin_path  # noqa: E402


@pytest.fixture(scope="module", params=TWINS)
def backend(request):
    f = open_gguf(twin_path(request.param))
    return CudaBackend(f, config_from_gguf(f), 512)


def generate(be, prompt, n, params, graph):
    be.use_graph = graph
    be.truncate(0)
    be.prefill(prompt)
    return list(be.sample_loop(n, params, prompt, frozenset()))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0),
                                    SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=11,
                                                   repeat_penalty=1.1)])
def test_replay_equals_eager(backend, params):
    prompt = [1, 5, 77, 900, 12]
    eager = generate(backend, prompt, 64, params, graph=False)
    graph = generate(backend, prompt, 64, params, graph=True)
    assert graph == eager
    assert len(backend.graphs.graphs) >= 1


def test_crosses_kv_pages(backend):
    """A 40-token prompt plus 64 tokens spans 7 pages of 16: replay still matches eager."""
    prompt = list(range(3, 43))
    p = SamplingParams(temperature=0.0)
    assert generate(backend, prompt, 64, p, graph=True) == generate(backend, prompt, 64, p, graph=False)


def test_one_graph_launch_per_token_and_no_allocation(backend):
    p = SamplingParams(temperature=0.0)
    generate(backend, [1, 2, 3], 8, p, graph=True)  # capture happens here
    pool = cp.get_default_memory_pool()
    backend.use_graph = True
    backend.truncate(0)
    backend.prefill([1, 2, 3])
    backend.stream.synchronize()
    kernels0, graphs0 = backend.kernels.launches, backend.graphs.launches
    mem0 = (pool.used_bytes(), pool.total_bytes())
    toks = list(backend.sample_loop(201, p, [1, 2, 3], frozenset()))
    assert len(toks) == 201
    # the first token is sampled from the prompt's logits (one eager kernel); then 1 graph per token
    assert backend.kernels.launches - kernels0 == 1
    assert backend.graphs.launches - graphs0 == 200
    assert (pool.used_bytes(), pool.total_bytes()) == mem0
