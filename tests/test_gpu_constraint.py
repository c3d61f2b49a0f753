"""Structured output on the CUDA backend: a constrained generation samples on the host (masks from
llguidance) and gives schema-valid JSON; the batch adapter refuses a grammar with one line."""

import json

import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from gguf_runtime.engine.constraint import compile_grammar  # noqa: E402
from gguf_runtime.engine.engine import Engine  # noqa: E402
from gguf_runtime.errors import BackendError  # noqa: E402
from gguf_runtime.sampling import SamplingParams  # noqa: E402
from gguf_runtime.server.adapters import CudaAdapter  # noqa: E402

from micro_models import Micro, write_micro  # noqa: E402
from test_constraint import SCHEMAS, check  # noqa: E402


# head size 64: the CUDA attention kernels take 64, 128 and 256
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_micro(Micro(vocab="gpt-2", n_vocab=None, seed=3, n_embd=256, n_ff=512, n_head=4, n_head_kv=2), tmp_path_factory.mktemp("m") / "micro.gguf")
    return Engine(path, backend="cuda", n_ctx=512)


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_cuda_generation_under_a_schema(engine, i):
    for seed in range(2):
        con = engine.constraint("json_schema", SCHEMAS[i])
        gen = engine.generate(engine.encode_raw("data:"), n_predict=300,
                              params=SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed),
                              constraint=con)
        text = gen.text()
        assert gen.stats.stop_reason == "stop", text
        check(json.loads(text), SCHEMAS[i])
    free = engine.generate(engine.encode_raw("data:"), n_predict=8, params=SamplingParams(temperature=0))
    assert len(free.text()) > 0  # the graph path still serves free text after host-sampled runs


def test_cuda_adapter_refuses_a_grammar(engine):
    ad = CudaAdapter(engine, capture=False)
    with pytest.raises(BackendError, match="numpy"):
        ad.add(0, engine.encode_raw("x"), SamplingParams(), 8, grammar=compile_grammar("json", None))
