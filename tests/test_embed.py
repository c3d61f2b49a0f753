"""Embeddings, engine side (CPU): the numpy backend's final hidden states against a hand-written
numpy forward and against transformers, pooling as the file's pooling_type says, normalization,
dimensions, truncation, and the sequence cache left alone. The server and the CLI:
test_server_embed.py; the CUDA backend: test_gpu_embed.py."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from gguf_runtime.backends.numpy.backend import NumpyBackend
from gguf_runtime.engine import embed as E
from gguf_runtime.engine.engine import Engine
from gguf_runtime.errors import ContextOverflowError, GGUFError, GGUFRunError, UnsupportedModelError
from gguf_runtime.format.gguf_file import open_gguf
from gguf_runtime.format.model_config import config_from_gguf
from gguf_runtime.sampling import SamplingParams

from micro_models import Micro, hf_model, prompt_ids, write_micro

CTX = 256  # the micro models' context_length
SPM = dict(vocab="llama-spm", n_vocab=None)  # a BOS (id 1) the tokenizer adds: truncation keeps it


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def backend(path, n_ctx: int = 64) -> NumpyBackend:
    f = open_gguf(path)
    return NumpyBackend(f, config_from_gguf(f), n_ctx)


# ---- the hidden states ----------------------------------------------------------------------------
def reference_hidden(path, ids) -> np.ndarray:
    """A llama file's final hidden states written out by hand in float64 from gguf-py's reader (not
    ours): RMSNorm, RoPE on (2i, 2i+1) pairs as complex numbers (Meta's llama code), grouped-query
    causal attention, SwiGLU, the output norm."""
    r = GGUFReader(str(path))
    w = {t.name: np.asarray(t.data, np.float64).reshape([int(x) for x in reversed(t.shape)]) for t in r.tensors}

    def field(key):
        f = r.fields[key]
        return f.parts[f.data[0]][0]

    n_layer, n_head = int(field("llama.block_count")), int(field("llama.attention.head_count"))
    n_kv = int(field("llama.attention.head_count_kv"))
    eps, base = float(field("llama.attention.layer_norm_rms_epsilon")), float(field("llama.rope.freq_base"))

    def norm(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g

    x = w["token_embd.weight"][ids]
    t, d = x.shape
    hd = d // n_head
    turn = np.exp(1j * np.arange(t)[:, None] * base ** (-np.arange(0, hd, 2) / hd)[None, :])[:, None, :]

    def rope(v):
        c = (v[..., 0::2] + 1j * v[..., 1::2]) * turn
        return np.stack([c.real, c.imag], -1).reshape(v.shape)

    future = np.triu(np.full((t, t), -np.inf), 1)
    for i in range(n_layer):
        p = f"blk.{i}."
        h = norm(x, w[p + "attn_norm.weight"])
        q = rope((h @ w[p + "attn_q.weight"].T).reshape(t, n_head, hd))
        k = np.repeat(rope((h @ w[p + "attn_k.weight"].T).reshape(t, n_kv, hd)), n_head // n_kv, 1)
        v = np.repeat((h @ w[p + "attn_v.weight"].T).reshape(t, n_kv, hd), n_head // n_kv, 1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + future
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", a, v).reshape(t, d) @ w[p + "attn_output.weight"].T
        h = norm(x, w[p + "ffn_norm.weight"])
        g, u = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "ffn_down.weight"].T
    return norm(x, w["output_norm.weight"])


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_micro(Micro(n_layer=3, seed=4), tmp_path_factory.mktemp("llama") / "llama.gguf")


def test_hidden_states_match_a_hand_written_forward(llama):
    ids = prompt_ids(4096, 20)
    ours, ref = backend(llama).hidden(ids), reference_hidden(llama, ids)
    assert ours.shape == (20, 64) and ours.dtype == np.float32
    # float32 against float64, from the same weights: measured 1.1e-6 of the largest value
    assert np.abs(ours - ref).max() <= 2e-5 * np.abs(ref).max()
    # the output norm is in: without it (the residual stream) the rows are far off
    be = backend(llama)
    from gguf_runtime.model import layers
    raw = layers(be.blocks, be.cfg, ids, np.arange(len(ids)))
    assert np.abs(raw - ref).max() > 0.1 * np.abs(ref).max()


def test_hidden_chunks_and_the_sequence_cache_left_alone(llama):
    ids, more = prompt_ids(4096, 30, seed=2), prompt_ids(4096, 5, seed=3)
    be = backend(llama)
    whole = be.hidden(ids)
    np.testing.assert_allclose(be.hidden(ids, chunk=7), whole, rtol=0, atol=1e-5)
    # a sequence in the cache, then an embedding, then more of the sequence: as if never interrupted
    fresh = backend(llama)
    want = fresh.eval(ids[:10] + more, all_logits=True)
    be.eval(ids[:10])
    be.hidden(ids)
    assert be.n_past == 10
    got = be.eval(more, all_logits=True)
    np.testing.assert_allclose(got, want[10:], rtol=0, atol=1e-5)
    with pytest.raises(ContextOverflowError):
        be.hidden(prompt_ids(4096, 65))


def test_hidden_states_match_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    path = write_micro(Micro(arch="qwen3", vocab="qwen2", qk_norm=True, head_dim=32, rope_base=1e6, tied=False,
                             seed=2), tmp_path / "qwen3.gguf")
    ids = prompt_ids(4096, 16)
    with torch.no_grad():
        ref = hf_model(path, head_dim=32).model(torch.tensor([ids])).last_hidden_state[0].numpy()
    ours = backend(path).hidden(ids)
    assert np.abs(ours - ref).max() <= 2e-5 * np.abs(ref).max()


# ---- pooling, normalization, dimensions, truncation --------------------------------------------
@pytest.fixture(scope="module")
def pooled(tmp_path_factory):
    """One set of weights, the pooling_type key absent, 0..4, and 7."""
    d = tmp_path_factory.mktemp("pool")
    return {p: write_micro(Micro(**SPM, seed=7, pooling_type=p), d / f"p{p}.gguf") for p in (None, 0, 1, 2, 3, 4)}


TEXTS = ["The sky is blue because of Rayleigh scattering.", "Grass is green."]


def test_pooling_as_the_file_says(pooled):
    hidden = {}
    eng = Engine(pooled[None], backend="numpy")
    for t in TEXTS:
        hidden[t] = eng.backend.hidden(eng.tokenizer.encode(t, add_special=True, parse_special=True))
    expect = {None: "last", 0: "last", 1: "mean", 2: "cls", 3: "last"}
    got = {}
    for p, name in expect.items():
        out = Engine(pooled[p], backend="numpy").embed(TEXTS)
        assert out.pooling == name
        assert out.vectors.shape == (2, 64) and out.vectors.dtype == np.float32
        np.testing.assert_allclose(np.linalg.norm(out.vectors, axis=1), 1.0, rtol=0, atol=1e-6)
        for i, t in enumerate(TEXTS):
            h = hidden[t].astype(np.float64)
            raw = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[name]
            np.testing.assert_allclose(out.vectors[i], raw / np.linalg.norm(raw), rtol=0, atol=1e-6)
        got[p] = out.vectors
    assert _cos(got[1], got[3]) < 0.99 and _cos(got[2], got[3]) < 0.99  # the pooling shows
    # CLS is the BOS row, which sees only itself in a causal model: every text's CLS vector is the same
    np.testing.assert_allclose(got[2][0], got[2][1], rtol=0, atol=1e-6)
    with pytest.raises(UnsupportedModelError, match="reranker"):
        Engine(pooled[4], backend="numpy").embed(TEXTS)


def test_a_pooling_type_out_of_range_is_a_damaged_file(tmp_path):
    path = write_micro(Micro(pooling_type=7), tmp_path / "p7.gguf")
    with pytest.raises(GGUFError, match="pooling_type"):
        config_from_gguf(open_gguf(path))


def test_dimensions_and_normalization(pooled):
    eng = Engine(pooled[1], backend="numpy")
    full = eng.embed(TEXTS).vectors
    for dims in (1, 8, 63, 64):
        cut = eng.embed(TEXTS, dimensions=dims).vectors
        assert cut.shape == (2, dims)
        want = full[:, :dims] / np.linalg.norm(full[:, :dims], axis=1, keepdims=True)
        np.testing.assert_allclose(cut, want, rtol=0, atol=1e-6)
    for bad in (0, -1, 65, True, 2.5):
        with pytest.raises(GGUFRunError, match="dimensions"):
            eng.embed(TEXTS, dimensions=bad)
    v = np.array([3.0, 4.0, 0.0], np.float32)
    np.testing.assert_allclose(E.finish(v), [0.6, 0.8, 0.0], rtol=1e-6)
    np.testing.assert_allclose(E.finish(v, 1), [1.0], rtol=1e-6)
    assert np.array_equal(E.normalize(np.zeros(3, np.float32)), np.zeros(3))  # Ollama: |v| at least 1e-12
    with pytest.raises(GGUFError, match="NaN"):
        E.finish(np.array([1.0, np.nan], np.float32))


def test_fit_keeps_bos_and_eos():
    bos, eos = 1, 2
    assert E.fit([1, 10, 11, 12, 13, 2], 4, True, bos, eos) == [1, 10, 11, 2]
    assert E.fit([1, 10, 11, 12, 13], 4, True, bos, eos) == [1, 10, 11, 12]
    assert E.fit([10, 11, 12, 13, 2], 3, True, bos, eos) == [10, 11, 2]
    assert E.fit([10, 11, 12], 3, False, bos, eos) == [10, 11, 12]
    with pytest.raises(ContextOverflowError, match="5 tokens but the context holds 4"):
        E.fit([1, 10, 11, 12, 2], 4, False, bos, eos)
    with pytest.raises(ContextOverflowError, match="no room"):
        E.fit([1, 10, 11, 2], 2, True, bos, eos)


def test_truncate(pooled):
    eng = Engine(pooled[3], backend="numpy", n_ctx=32)
    long = " ".join(f"word{i}" for i in range(200))
    ids = eng.tokenizer.encode(long, add_special=True, parse_special=True)
    assert len(ids) > 32 and ids[0] == eng.tokenizer.bos_id
    out = eng.embed([long, "short"])
    assert out.tokens[0] == 32 and out.tokens[1] < 32
    h = eng.backend.hidden(ids[:32])[-1]
    np.testing.assert_allclose(out.vectors[0], h / np.linalg.norm(h), rtol=0, atol=1e-6)
    with pytest.raises(ContextOverflowError, match="text 1 is .* tokens but the context holds 32"):
        eng.embed([long], truncate=False)
    with pytest.raises(ContextOverflowError, match="characters"):  # refused before tokenizing
        eng.embed(["x" * 10_000_000], truncate=False)
    huge = eng.embed(["word " * 2_000_000])  # cut before tokenizing, then to the context
    assert huge.tokens == [32]
    with pytest.raises(GGUFRunError, match="text 2 is empty"):
        eng.embed(["a", ""])


def test_engine_embed_keeps_the_cached_prefix(pooled):
    eng = Engine(pooled[None], backend="numpy")
    ids = eng.encode_raw("Once upon a time")
    a = eng.generate(ids, n_predict=6, params=SamplingParams(temperature=0)).ids
    cached = list(eng.cached)
    eng.embed(TEXTS)
    assert eng.cached == cached and eng.backend.n_past == len(cached)
    fresh = Engine(pooled[None], backend="numpy")
    b = fresh.generate(ids + a, n_predict=6, params=SamplingParams(temperature=0)).ids
    assert eng.generate(ids + a, n_predict=6, params=SamplingParams(temperature=0)).ids == b
