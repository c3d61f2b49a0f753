"""The numpy backend against transformers on micro models of every supported architecture variant.

Each case writes a tiny GGUF (``micro_models.write_micro``: random weights, a real tokenizer) and
compares our numpy backend's logits with transformers' own GGUF loader on the same file: a 12-token
prompt in one ``eval`` (every position), then 3 more tokens in a second ``eval`` through the KV
cache, against one causal pass of all 15 tokens in transformers. Every row must agree to float32
rounding (MAX_COS_GAP, MAX_REL below) and have the same argmax.

Where transformers' GGUF loader does not read a key, the test hands the value to transformers as a
config override, and says so; the GGUF file is still the only thing our backend reads. Where a
feature only changes metadata (RoPE scaling, frequency factors, windows, soft-capping), the test also
checks that the feature is visible at this size: our backend on the same weights *without* it
misses the reference.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from gguf_runtime.backends.numpy.backend import NumpyBackend
from gguf_runtime.format.gguf_file import open_gguf
from gguf_runtime.format.model_config import config_from_gguf
from micro_models import Micro, hf_logits, hf_model, llama3_freq_factors, numpy_logits, prompt_ids, write_micro

IQ_TYPES = ("IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")

pytest.importorskip("torch")
pytest.importorskip("transformers")

N_PROMPT, N_MORE = 12, 3
# Both sides compute in float32 from the same dequantized weights, so they differ only by rounding
# and summation order: measured (2026-11-25, every case below) 1 - cos <= 9e-12 and max |diff| <=
# 3.9e-6 of the row's largest logit (the K-quant case; the others <= 1e-12 and 1.5e-6). The bars sit
# 5-10x above that and far below what a wrong formula gives (tests/mutations.py plants such bugs:
# eps outside the sqrt, another GELU, a window off by one, a scale).
MAX_COS_GAP = 1e-10  # 1 - cosine, every row
MAX_REL = 2e-5  # max |ours - ref| / max |ref|, every row: catches what cosine cannot (a scale)


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def _max_rel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return np.abs(a - b).max(-1) / np.abs(b).max(-1)


def assert_match(ours: np.ndarray, ref: np.ndarray, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} vs {ref.shape}"
    gap, rel = 1 - _cos(ours, ref), _max_rel(ours, ref)
    if os.environ.get("GGUF_TEST_REPORT_ERRORS"):
        print(f"\n{what}: 1-cos {gap.max():.3g}, max rel {rel.max():.3g}")
    assert gap.max() < MAX_COS_GAP, f"{what}: 1 - cosine {gap.max():.3g} at positions " \
                                     f"{np.flatnonzero(gap >= MAX_COS_GAP).tolist()} (bar {MAX_COS_GAP:g})"
    assert rel.max() < MAX_REL, f"{what}: max |diff| / max |ref| {rel.max():.3g} at positions " \
                                f"{np.flatnonzero(rel >= MAX_REL).tolist()} (bar {MAX_REL:g})"
    diff = np.flatnonzero(ours.argmax(-1) != ref.argmax(-1))
    assert diff.size == 0, f"{what}: argmax differs at positions {diff.tolist()}"


def hf_inv_freq(model, layer: int) -> np.ndarray:
    """The rotary frequencies transformers' model uses at ``layer`` (per layer type where it has types)."""
    rot = model.model.rotary_emb
    types = getattr(model.config, "layer_types", None)
    buf = getattr(rot, f"{types[layer]}_inv_freq", None) if types else None
    return (rot.inv_freq if buf is None else buf).double().numpy()


def assert_rope_matches(path: Path, model) -> None:
    """Our RoPE frequencies (base, scaling, factors, per layer) equal transformers' to float32 rounding.

    The logits alone cannot pin the base: over the prompt's 15 positions a base off by 1e-5 moves
    angles by ~1e-7 rad. Here it moves the frequencies by up to 9e-6 (relative), 17x the bar.
    """
    f = open_gguf(path)
    cfg = config_from_gguf(f)
    be = NumpyBackend(f, cfg, 8)
    for layer in range(cfg.n_layer):
        ours = be._inv_freq[cfg.rope_key(layer)]
        ref = hf_inv_freq(model, layer)
        np.testing.assert_allclose(ours, ref, rtol=5e-7, atol=0,  # transformers: float32 (measured 1.2e-7)
                                   err_msg=f"RoPE frequencies of layer {layer}")


def run_case(tmp_path, m: Micro, **hf_overrides) -> tuple[Path, list[int], np.ndarray]:
    """Write ``m``, compare numpy (prompt, then KV-cached tokens) with transformers, and the RoPE
    frequencies; returns (file, ids, reference)."""
    path = write_micro(m, tmp_path / f"micro-{m.arch}.gguf")
    ids = prompt_ids(config_from_gguf(open_gguf(path)).n_vocab, N_PROMPT + N_MORE)
    first, second = numpy_logits(path, ids[:N_PROMPT], ids[N_PROMPT:])
    model = hf_model(path, **hf_overrides)
    ref = hf_logits(model, ids)
    assert_match(first, ref[:N_PROMPT], f"{m.arch} prompt")
    assert_match(second, ref[N_PROMPT:], f"{m.arch} after the KV cache")
    assert_rope_matches(path, model)
    return path, ids, ref


def assert_visible(tmp_path, without: Micro, ids: list[int], ref: np.ndarray) -> None:
    """The same weights without the feature miss the reference: the case above really tested it."""
    path = write_micro(without, tmp_path / "without.gguf")
    first, second = numpy_logits(path, ids[:N_PROMPT], ids[N_PROMPT:])
    both = np.concatenate([first, second])
    assert _max_rel(both, ref).max() > 100 * MAX_REL, "the feature makes no difference here"


# ---- qwen2, qwen3 ------------------------------------------------------------------------------

QWEN2 = dict(arch="qwen2", vocab="qwen2", bias=True, rope_base=1e6, n_layer=3)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_qwen2(tmp_path, tied):
    """q/k/v biases, NEOX RoPE (base 1e6), GQA 4:2, tied and untied lm_head."""
    run_case(tmp_path, Micro(**QWEN2, tied=tied))


@pytest.mark.slow
def test_qwen2_full_vocab(tmp_path):
    """The whole Qwen2 vocabulary (151,936 tokens, 151,387 merges): ~25 s, nearly all of it in gguf.GGUFReader
    parsing the strings, twice, inside transformers' loader."""
    run_case(tmp_path, Micro(**QWEN2, n_vocab=None))


def test_qwen3(tmp_path):
    """QK-norm and head_dim 32 from ``qwen3.attention.key_length`` (n_embd / n_head = 16).

    transformers' GGUF config mapping has no ``attention.key_length`` for qwen3 (only qwen3_moe), so
    its Qwen3Config would keep its default head_dim of 128: head_dim is passed as an override.
    """
    run_case(tmp_path, Micro(arch="qwen3", vocab="qwen2", qk_norm=True, head_dim=32, rope_base=1e6, tied=False),
             head_dim=32)


QWEN3MOE = dict(arch="qwen3moe", vocab="qwen2", qk_norm=True, head_dim=32, rope_base=1e6, tied=False,
                n_expert=8, n_expert_used=2, n_ff_exp=64, n_ff=96)


@pytest.mark.parametrize("quant", [None, "Q8_0"])
def test_qwen3moe(tmp_path, quant):
    """Qwen3-MoE: softmax router, the top 2 of 8 experts a token renormalized, stacked expert
    matrices (float32, and Q8_0 router and experts), QK-norm, head_dim 32.

    transformers' GGUF config mapping reads no ``expert_feed_forward_length`` (its Qwen3MoeConfig
    keeps moe_intermediate_size 768), so the expert size is passed as an override."""
    q = {"_exps.weight": QT.Q8_0, "ffn_gate_inp.weight": QT.Q8_0} if quant else {}
    path, ids, ref = run_case(tmp_path, Micro(**QWEN3MOE, quant=q), head_dim=32, moe_intermediate_size=64)
    if quant is None:  # every expert serves some token, so each one's weights were checked
        f = open_gguf(path)
        be = NumpyBackend(f, config_from_gguf(f), 32)
        h = be.rms_norm(be.embed(ids), "blk.0.ffn_norm.weight")
        top = np.argsort(-(h @ be.weight("blk.0.ffn_gate_inp.weight").T), -1)[:, :2]
        assert len(np.unique(top)) == 8
        # ... and routing matters: the same weights with one expert a token miss the reference
        assert_visible(tmp_path, Micro(**{**QWEN3MOE, "n_expert_used": 1}), ids, ref)


@pytest.mark.parametrize("name", ("MXFP4", "IQ4_NL", "IQ4_XS") + IQ_TYPES)
def test_table_and_iq_types_against_transformers(tmp_path, name):
    """Experts in each i-quant type and MXFP4 (the table types and the 1- to 3-bit
    i-quants): transformers' GGUF
    loader dequantizes them with the gguf package, ours with reference_iq, and the logits agree."""
    m = Micro(**{**QWEN3MOE, "n_embd": 256, "n_ff_exp": 256}, quant={"_exps.weight": QT[name]})
    path, _, _ = run_case(tmp_path, m, head_dim=32, moe_intermediate_size=256)
    assert open_gguf(path).tensors["blk.0.ffn_up_exps.weight"].type_name == name


def test_qwen2moe(tmp_path):
    """Qwen2-MoE: q/k/v biases, the top 2 of 8 experts with their softmax weights as they are (not
    renormalized), and a shared expert of its own size scaled by a sigmoid gate. transformers
    reads neither expert size from the GGUF, so both are passed as overrides."""
    m = Micro(arch="qwen2moe", vocab="qwen2", bias=True, rope_base=1e6, tied=False, n_expert=8, n_expert_used=2,
              n_ff_exp=64, n_ff_shexp=96, n_ff=96)
    path, ids, ref = run_case(tmp_path, m, moe_intermediate_size=64, shared_expert_intermediate_size=96)
    f = open_gguf(path)
    cfg = config_from_gguf(f)
    assert not cfg.expert_norm and cfg.n_ff_shexp == 96
    for without in ({"n_ff_shexp": 0}, {"expert_norm": True}):  # each part shows in the logits
        be = NumpyBackend(f, dataclasses.replace(cfg, **without), 32)
        assert _max_rel(be.eval(ids, all_logits=True), ref).max() > 100 * MAX_REL, without


# ---- gpt-oss -------------------------------------------------------------------------------------

GPTOSS = dict(arch="gpt-oss", vocab="qwen2", n_embd=64, n_head=4, n_head_kv=2, head_dim=16, bias=True,
              rope_base=150000.0, tied=False, n_expert=8, n_expert_used=2, n_ff_exp=64, n_ff=64, sliding_window=4,
              yarn=(32.0, 4096))


def gpt_oss_hf(path: Path):
    """transformers' GptOssForCausalLM holding the micro file's weights: its GGUF loader does not read
    gpt-oss, so the model is built from the file's config (YaRN with truncate off, as the released
    checkpoints) and the tensors are renamed, gate and up interleaved in gate_up_proj as it stores them."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    f = open_gguf(path)
    cfg = config_from_gguf(f)
    be = NumpyBackend(f, cfg, 8)

    def w(name: str) -> torch.Tensor:
        return torch.tensor(np.asarray(be.weight(name), np.float32))

    r = cfg.rope
    hc = GptOssConfig(vocab_size=cfg.n_vocab, hidden_size=cfg.n_embd, intermediate_size=cfg.n_ff_exp,
                      num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head_kv,
                      head_dim=cfg.head_dim, num_local_experts=cfg.n_expert, num_experts_per_tok=cfg.n_expert_used,
                      sliding_window=max(cfg.layer_window), rms_norm_eps=cfg.rms_eps, tie_word_embeddings=False,
                      max_position_embeddings=int(r.orig_ctx * r.yarn_factor),
                      rope_parameters={"rope_type": "yarn", "factor": r.yarn_factor, "beta_fast": r.yarn_beta_fast,
                                       "beta_slow": r.yarn_beta_slow, "truncate": False,
                                       "original_max_position_embeddings": r.orig_ctx, "rope_theta": r.base})
    hc._attn_implementation = "eager"
    model = GptOssForCausalLM(hc).float().eval()
    sd = {"model.embed_tokens.weight": w("token_embd.weight"), "model.norm.weight": w("output_norm.weight"),
          "lm_head.weight": w("output.weight")}
    for i in range(cfg.n_layer):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        for ours, theirs in (("attn_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm")):
            sd[h + theirs + ".weight"] = w(p + ours + ".weight")
        for x in "qkv":
            sd[h + f"self_attn.{x}_proj.weight"] = w(p + f"attn_{x}.weight")
            sd[h + f"self_attn.{x}_proj.bias"] = w(p + f"attn_{x}.bias")
        sd[h + "self_attn.o_proj.weight"] = w(p + "attn_output.weight")
        sd[h + "self_attn.o_proj.bias"] = w(p + "attn_output.bias")
        sd[h + "self_attn.sinks"] = w(p + "attn_sinks.weight")
        sd[h + "mlp.router.weight"] = w(p + "ffn_gate_inp.weight")
        sd[h + "mlp.router.bias"] = w(p + "ffn_gate_inp.bias")
        gate, up = w(p + "ffn_gate_exps.weight"), w(p + "ffn_up_exps.weight")  # [E, f, d]
        gu = torch.empty(cfg.n_expert, cfg.n_embd, 2 * cfg.n_ff_exp)
        gu[:, :, 0::2], gu[:, :, 1::2] = gate.transpose(1, 2), up.transpose(1, 2)
        gub = torch.empty(cfg.n_expert, 2 * cfg.n_ff_exp)
        gub[:, 0::2], gub[:, 1::2] = w(p + "ffn_gate_exps.bias"), w(p + "ffn_up_exps.bias")
        sd[h + "mlp.experts.gate_up_proj"], sd[h + "mlp.experts.gate_up_proj_bias"] = gu, gub
        sd[h + "mlp.experts.down_proj"] = w(p + "ffn_down_exps.weight").transpose(1, 2).contiguous()
        sd[h + "mlp.experts.down_proj_bias"] = w(p + "ffn_down_exps.bias")
    model.load_state_dict(sd, strict=True)
    return model


@pytest.mark.parametrize("quant", [None, "Q8_0"])
def test_gpt_oss(tmp_path, quant):
    """gpt-oss: q/k/v/o biases, a sink logit a head, the even layers sliding (window 4 here), YaRN
    (factor 32 over 4,096 tokens, its attention factor on cos and sin), a router with a bias whose
    top 2 logits are softmaxed (the renormalized top 2 of its softmax), the clamped SwiGLU (gate <= 7, |up| <= 7, (up + 1) gate sigmoid(1.702
    gate)) with expert biases; float32, and Q8_0 matrices and experts (the released files' other
    matrices; their MXFP4 experts are not read yet). Each part shows in the logits."""
    q = {".weight": QT.Q8_0} if quant else {}
    m = Micro(**GPTOSS, quant=q)
    path = write_micro(m, tmp_path / "micro-gpt-oss.gguf")
    f = open_gguf(path)
    cfg = config_from_gguf(f)
    assert cfg.layer_window == (4, 0) and cfg.ffn_norm == "post_attention_norm" and not cfg.post_norms
    ids = prompt_ids(cfg.n_vocab, N_PROMPT + N_MORE)
    first, second = numpy_logits(path, ids[:N_PROMPT], ids[N_PROMPT:])
    model = gpt_oss_hf(path)
    ref = hf_logits(model, ids)
    assert_match(first, ref[:N_PROMPT], "gpt-oss prompt")
    assert_match(second, ref[N_PROMPT:], "gpt-oss after the KV cache")
    assert_rope_matches(path, model)
    rope_off = dataclasses.replace(cfg.rope, yarn_factor=0.0, attn_factor=1.0)
    for without in ({"attn_sinks": False}, {"expert_norm": False}, {"glu_limit": 1e9}, {"rope": rope_off},
                    {"layer_window": (0, 0)}):
        be = NumpyBackend(f, dataclasses.replace(cfg, **without), 32)
        assert _max_rel(be.eval(ids, all_logits=True), ref).max() > 100 * MAX_REL, without


def test_qwen3moe_nonsense_expert_counts_are_one_line(tmp_path):
    """More experts a token than experts, or none, is a damaged file: one line naming the key."""
    from gguf_runtime.errors import GGUFError
    for used, n in ((9, 8), (0, 8)):
        path = write_micro(Micro(**{**QWEN3MOE, "n_expert_used": used, "n_expert": n}), tmp_path / f"bad{used}.gguf")
        with pytest.raises(GGUFError, match=r"'qwen3moe.expert_used_count' = \d+ is not an integer from 1 to 8"):
            config_from_gguf(open_gguf(path))


@pytest.mark.parametrize("quant", [None, "Q4_K"])
def test_phi3(tmp_path, quant):
    """Phi-3 (mini-4k layout): Q, K and V rows in one attn_qkv matrix, gate and up rows in one
    ffn_up matrix (gate first), NEOX RoPE, untied head; float32 and K-quant matrices."""
    q = {"attn_qkv.weight": QT.Q4_K, "ffn_up.weight": QT.Q4_K, "ffn_down.weight": QT.Q4_K} if quant else {}
    m = Micro(arch="phi3", vocab="phi-3", n_embd=256, n_ff=256, n_head=4, n_head_kv=4, tied=False,
              rope_base=10000.0, eps=1e-5, quant=q)
    path, ids, ref = run_case(tmp_path, m, pad_token_id=0)  # Phi3Config's default 32000 is past the cut vocabulary
    f = open_gguf(path)
    cfg = config_from_gguf(f)
    assert cfg.fused_qkv and cfg.fused_gate_up and "blk.0.ffn_gate.weight" not in f.tensors


def test_phi3_longrope(tmp_path):
    """Phi-3.5 / Phi-4-mini's LongRoPE: rope_factors_short divide the frequencies while the context
    is within original_context_length (rope_factors_long past it, as llama.cpp chooses by the
    context size), and cos and sin are scaled by rope.scaling.attn_factor. transformers' GGUF
    loader reads neither, so the same values go to it as rope_parameters."""
    rng = np.random.default_rng(7)
    half = 8  # head 16 (n_embd 64 / 4 heads)
    long, short = tuple(map(float, 1 + 20 * rng.random(half))), tuple(map(float, 1 + 2 * rng.random(half)))
    orig, attn = 64, 1.1902380714238083  # numpy_logits runs a context of 64: the short factors, as transformers at 15 tokens
    m = Micro(arch="phi3", vocab="phi-3", n_embd=64, n_ff=128, n_head=4, n_head_kv=4, tied=False, eps=1e-5,
              longrope=(long, short, orig, attn))
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "long_factor": list(long), "short_factor": list(short),
            "original_max_position_embeddings": orig, "attention_factor": attn}
    path, ids, ref = run_case(tmp_path, m, pad_token_id=0, rope_parameters=rope, original_max_position_embeddings=orig)
    f = open_gguf(path)
    cfg = config_from_gguf(f)
    assert (cfg.rope.orig_ctx, cfg.rope.attn_factor) == (orig, np.float32(attn))
    base = 10000.0 ** (-np.arange(0, 16, 2) / 16)
    assert np.allclose(NumpyBackend(f, cfg, orig)._inv_freq[cfg.rope_key(0)], base / np.float32(short), rtol=1e-6)
    assert np.allclose(NumpyBackend(f, cfg, orig + 1)._inv_freq[cfg.rope_key(0)], base / np.float32(long), rtol=1e-6)
    # the attention factor shows: without it the logits miss transformers'
    be = NumpyBackend(f, dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, attn_factor=1.0)), 32)
    assert _max_rel(be.eval(ids, all_logits=True), ref).max() > 100 * MAX_REL


def test_phi3_one_longrope_table_is_a_damaged_file(tmp_path):
    from gguf_runtime.errors import GGUFError
    m = Micro(arch="phi3", vocab="phi-3", n_embd=64, n_ff=128, n_head=4, n_head_kv=4, tied=False,
              extra=(("rope_factors_long.weight", 8),))
    with pytest.raises(GGUFError, match="only one of rope_factors_long / rope_factors_short"):
        config_from_gguf(open_gguf(write_micro(m, tmp_path / "half.gguf")))


# ---- llama -------------------------------------------------------------------------------------

def test_llama3(tmp_path):
    """Llama-3 vocabulary, GQA 4:2, Q/K in the file's permuted layout (transformers un-permutes them), base 5e5."""
    run_case(tmp_path, Micro(rope_base=500000.0, eps=1e-5, n_layer=3))


def test_llama_head_dim(tmp_path):
    """Mistral-Nemo style: head size 32 stated by key_length and rope.dimension_count, while n_embd / n_head = 16."""
    run_case(tmp_path, Micro(head_dim=32, tied=False))


def test_llama_rope_linear(tmp_path):
    """``llama.rope.scaling.type = linear``, factor 4: positions divided by 4.

    transformers' GGUF loader ignores ``rope.scaling.*`` for llama, so the linear rope is passed as
    ``rope_parameters``.
    """
    m = Micro(rope_linear=4.0)
    linear = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    _, ids, ref = run_case(tmp_path, m, rope_parameters=linear)
    assert_visible(tmp_path, Micro(), ids, ref)


def test_llama31_rope_freqs(tmp_path):
    """Llama-3.1 frequency factors in a ``rope_freqs.weight`` tensor, as llama.cpp's converter writes them.

    transformers' GGUF loader does not honour ``rope_freqs.weight`` (no parameter maps to it: the
    rotary ``inv_freq`` is a non-persistent buffer), nor any ``rope.scaling`` key. The reference is
    therefore transformers' own Llama-3 rope (``rope_type="llama3"``) configured with the scaling
    parameters the factors were computed from; original_max_position_embeddings=32 so that all three
    regimes (unscaled, smoothed, divided by the factor) occur in 8 frequencies.
    """
    params = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)
    factors = llama3_freq_factors(16, 10000.0, params["factor"], params["low_freq_factor"],
                                  params["high_freq_factor"], params["original_max_position_embeddings"])
    assert factors[0] == 1.0 and 1.0 < factors[1] < 8.0 and set(factors[2:]) == {8.0}
    _, ids, ref = run_case(tmp_path, Micro(rope_freqs=factors),
                           rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, **params})
    assert_visible(tmp_path, Micro(), ids, ref)


def test_llama2_spm_mha(tmp_path):
    """Llama-2: the whole SPM vocabulary (32,000 tokens, scores, types), MHA (n_head_kv == n_head), eps 1e-5."""
    run_case(tmp_path, Micro(vocab="llama-spm", n_vocab=None, n_head=4, n_head_kv=4, eps=1e-5, n_layer=3))


@pytest.mark.parametrize("tied", [True, False], ids=["tied-q8_0", "untied-kquants"])
def test_llama_quantized(tmp_path, tied):
    """Quantized matrices, dequantized by transformers through gguf-py: Q8_0 (quantized from the random
    weights) and Q4_K/Q5_K/Q6_K (random well-formed blocks), incl. the token embedding (row lookup)."""
    if tied:
        quant = {"token_embd.weight": QT.Q8_0, ".weight": QT.Q8_0}
    else:
        quant = {"token_embd.weight": QT.Q4_K, "output.weight": QT.Q6_K, "attn_q.weight": QT.Q5_K,
                 "attn_k.weight": QT.Q5_K, "attn_v.weight": QT.Q6_K, "attn_output.weight": QT.Q4_K,
                 "ffn_gate.weight": QT.Q4_K, "ffn_up.weight": QT.Q4_K, "ffn_down.weight": QT.Q6_K}
    path, _, _ = run_case(tmp_path, Micro(n_embd=256, n_ff=256, n_head=4, n_head_kv=2, tied=tied, quant=quant))
    types = {t.type_name for t in open_gguf(path).tensors.values()}
    assert types == ({"F32", "Q8_0"} if tied else {"F32", "Q4_K", "Q5_K", "Q6_K"})


# ---- gemma3 ------------------------------------------------------------------------------------

# 6 layers, window 4: layers 0-4 slide (base 10000), layer 5 is global (base 1e6); head size 32 from
# key_length (n_embd / n_head = 16); norms stored as 1 + w (transformers subtracts 1 on loading).
GEMMA = dict(arch="gemma3", vocab="llama-spm", n_layer=6, n_head=4, n_head_kv=1, head_dim=32, qk_norm=True,
             post_norms=True, sliding_window=4, rope_base=1e6)
# Nothing in a Gemma-3 GGUF states query_pre_attn_scalar (transformers' default is 256); llama.cpp,
# like our runtime, scales by 1/sqrt(head_dim) below 27B.
GEMMA_HF = dict(query_pre_attn_scalar=32)


def test_gemma3(tmp_path):
    """Post norms, QK-norm, sliding window on 5 of 6 layers with a local RoPE base, sqrt(n_embd) embedding scale."""
    path, ids, ref = run_case(tmp_path, Micro(**GEMMA), **GEMMA_HF)
    assert config_from_gguf(open_gguf(path)).layer_window == (4, 4, 4, 4, 4, 0)
    assert_visible(tmp_path, Micro(**{**GEMMA, "sliding_window": 0}), ids, ref)


def test_gemma3_final_softcap(tmp_path):
    """``gemma3.final_logit_softcapping``: transformers' GGUF loader does not read the key, but its Gemma-3
    model applies ``config.final_logit_softcapping``, passed as an override. Also checked against the
    formula: capped logits == cap * tanh(uncapped / cap) on the same weights."""
    path, ids, ref = run_case(tmp_path, Micro(**GEMMA, final_softcap=5.0), final_logit_softcapping=5.0, **GEMMA_HF)
    plain = write_micro(Micro(**GEMMA), tmp_path / "plain.gguf")
    uncapped = np.concatenate(numpy_logits(plain, ids[:N_PROMPT], ids[N_PROMPT:]))
    ours = np.concatenate(numpy_logits(path, ids[:N_PROMPT], ids[N_PROMPT:]))
    np.testing.assert_allclose(ours, 5.0 * np.tanh(uncapped / 5.0), rtol=1e-5, atol=1e-5)
    assert _max_rel(uncapped, ref).max() > 100 * MAX_REL


def test_gemma3_attn_softcap(tmp_path, monkeypatch):
    """``gemma3.attn_logit_softcapping`` (a Gemma-2 feature; no real Gemma-3 file has it).

    transformers' GGUF loader does not read the key, and its Gemma-3 attention stores
    ``config.attn_logit_softcapping`` but never passes it on. The reference is transformers' Gemma-3
    eager attention function with its own ``softcap`` argument supplied (the Gemma-2 formula: scores
    scaled, then cap * tanh(s / cap), then masked). Note: llama.cpp applies it for Gemma-2 only.
    """
    from transformers.models.gemma3 import modeling_gemma3

    eager = modeling_gemma3.eager_attention_forward

    def capped(module, *args, **kwargs):
        return eager(module, *args, **{**kwargs, "softcap": module.config.attn_logit_softcapping})

    monkeypatch.setattr(modeling_gemma3, "eager_attention_forward", capped)
    _, ids, ref = run_case(tmp_path, Micro(**GEMMA, attn_softcap=1.0), attn_logit_softcapping=1.0, **GEMMA_HF)
    assert_visible(tmp_path, Micro(**GEMMA), ids, ref)


def test_gemma3_rope_linear_global_only(tmp_path):
    """Gemma-3 4B+ scale positions by 1/8 on the global layers only (llama.cpp: rope_freq_scale_train_swa = 1;
    transformers: per layer-type rope parameters), not on the sliding-window layers."""
    full = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    run_case(tmp_path, Micro(**GEMMA, rope_linear=8.0),
             rope_parameters={"full_attention": full, "sliding_attention": {"rope_type": "default",
                                                                             "rope_theta": 10000.0}}, **GEMMA_HF)


def test_gemma3_27b_attention_scale(tmp_path):
    """llama.cpp recognises Gemma-3 27B by its 62 layers and scales attention by 1/sqrt(n_embd / n_head)
    (its query_pre_attn_scalar, 168 = 5376 / 32, not the head size 128); no GGUF key states it."""
    path = write_micro(Micro(**{**GEMMA, "n_layer": 62}), tmp_path / "g27.gguf")
    cfg = config_from_gguf(open_gguf(path))
    assert (cfg.head_dim, cfg.n_embd // cfg.n_head) == (32, 16)
    assert cfg.attn_scale == pytest.approx(1 / math.sqrt(16))
