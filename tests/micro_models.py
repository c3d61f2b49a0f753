"""Micro models: tiny GGUF files of every supported architecture variant, and the references they are checked against.

``Micro`` describes one variant (sizes, biases, QK-norm, post norms, RoPE scaling, frequency
factors, sliding windows, soft-capping, quantized matrices); ``write_micro`` writes it with
``gguf.GGUFWriter`` in llama.cpp's conventions (tensor names, ``{arch}.*`` keys, Q/K rows in the
file's layout, Gemma norm weights stored as 1 + w) with random weights and a real tokenizer taken
from ``tests/data/tokenizer``: the first ``n_vocab`` tokens of that vocabulary with their types and
scores, the merges among them, and the special-token ids that fall inside (``n_vocab=None`` keeps all
of it). The vocabulary is cut because transformers' GGUF reader (``gguf.GGUFReader``) spends about
10 s per read on Qwen2's 151,936 tokens and 151,387 merges, and it reads a file twice per load.

``hf_logits`` runs transformers' own GGUF loader on the file (the independent reference);
``numpy_logits`` runs our numpy backend (prompt in one ``eval``, then more tokens through the KV
cache); ``llama3_freq_factors`` is llama.cpp's converter's ``rope_freqs`` for Llama-3.1 scaling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT
from gguf import GGUFWriter
from gguf.quants import quantize

from gguf_runtime.backends.numpy.backend import NumpyBackend
from gguf_runtime.format.gguf_file import open_gguf
from gguf_runtime.format.model_config import config_from_gguf
from gguf_runtime.quant_kernels.reference import random_blocks
from gguf_runtime.quant_kernels.reference_iq import KERNELS as IQ_KERNELS
from gguf_runtime.quant_kernels.reference_iq import random_iq_blocks

VOCAB_DIR = Path(__file__).resolve().parent / "data" / "tokenizer"
# Token embeddings at a real checkpoint's scale (SmolLM2-135M: RMS 0.136; initialisers use 0.02), so the
# residual stream entering the first RMSNorm has a mean square (~2.5e-3) a few hundred times eps, as in
# real models: where eps is added, and how, shows in the logits. Matrices keep unit gain (1/sqrt(cols)).
EMBED_STD = 0.05
_ARRAY_ITEM = {"int32": VT.INT32, "uint32": VT.UINT32, "float32": VT.FLOAT32}


@dataclass(frozen=True)
class Micro:
    arch: str = "llama"
    vocab: str = "llama-bpe"  # tests/data/tokenizer/ggml-vocab-{vocab}.gguf
    n_vocab: int | None = 4096  # first n tokens of the real vocabulary; None: all of it
    n_embd: int = 64
    n_layer: int = 2
    n_ff: int = 128
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int | None = None  # written as {arch}.attention.key_length/value_length when given
    tied: bool = True  # no output.weight: the lm_head is token_embd
    bias: bool = False  # q/k/v biases (Qwen2)
    qk_norm: bool = False  # attn_q_norm / attn_k_norm (Qwen3, Gemma-3)
    post_norms: bool = False  # post_attention_norm / post_ffw_norm (Gemma)
    rope_base: float = 10000.0
    rope_linear: float | None = None  # {arch}.rope.scaling.type = linear, .factor = this
    rope_freqs: tuple[float, ...] | None = None  # rope_freqs.weight (divides each frequency)
    sliding_window: int = 0  # {arch}.attention.sliding_window
    attn_softcap: float | None = None  # {arch}.attn_logit_softcapping
    final_softcap: float | None = None  # {arch}.final_logit_softcapping
    quant: dict[str, int] = field(default_factory=dict)  # tensor-name suffix -> ggml type (2-D, 3-D weights)
    n_expert: int = 0  # mixture of experts (qwen3moe): the router and stacked expert matrices instead of the FFN
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0  # a shared expert (qwen2moe)
    extra: tuple[tuple[str, int], ...] = ()  # more float32 vectors (name, length): tensors a variant adds
    longrope: tuple[tuple[float, ...], tuple[float, ...], int, float] | None = None  # long, short, orig ctx, attn factor
    yarn: tuple[float, int] | None = None  # {arch}.rope.scaling.type = yarn: (factor, original context length)
    eps: float = 1e-6
    seed: int = 0
    chat_template: str | None = None  # tokenizer.chat_template in place of the vocabulary file's (if any)
    pooling_type: int | None = None  # {arch}.pooling_type (embeddings: 1 mean, 2 cls, 3 last)
    added_tokens: tuple[str, ...] = ()  # control tokens appended to the vocabulary (gpt-oss's Harmony markers)

    @property
    def dim(self) -> int:
        return self.head_dim or self.n_embd // self.n_head


def vocab_metadata(vocab: str, n: int | None) -> list[tuple[str, Any, VT, VT | None]]:
    """(key, value, type, array item type) of every ``tokenizer.*`` key of a real vocabulary, cut to n tokens."""
    f = open_gguf(VOCAB_DIR / f"ggml-vocab-{vocab}.gguf")
    meta, types = f.metadata, f.metadata_types
    tokens = meta["tokenizer.ggml.tokens"]
    n = len(tokens) if n is None else min(n, len(tokens))
    kept = set(tokens[:n])
    out = []
    for key, val in meta.items():
        if not key.startswith("tokenizer."):
            continue
        if key.endswith("_token_id") and val >= n:
            continue  # a special token cut from the vocabulary
        if types[key] != VT.ARRAY:
            out.append((key, val, VT(types[key]), None))
            continue
        if key == "tokenizer.ggml.merges":
            val = [m for m in val if (p := m.split(" ", 1)) and len(p) == 2 and p[0] in kept and p[1] in kept
                   and p[0] + p[1] in kept]
        elif key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            val = val[:n]
        if isinstance(val, list):
            out.append((key, val, VT.ARRAY, VT.STRING))
        else:
            out.append((key, val.tolist(), VT.ARRAY, _ARRAY_ITEM[val.dtype.name]))
    return out


def llama3_freq_factors(n_dims: int, base: float, factor: float, low_freq_factor: float, high_freq_factor: float,
                        original_context: int) -> tuple[float, ...]:
    """llama.cpp's ``convert_hf_to_gguf`` ``rope_freqs`` for a Llama-3.1 ``rope_scaling`` (one per rotated pair)."""
    out = []
    low_wavelen, high_wavelen = original_context / low_freq_factor, original_context / high_freq_factor
    for i in range(0, n_dims, 2):
        wavelen = 2 * math.pi / (1.0 / base ** (i / n_dims))
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(out)


def _tensors(m: Micro, n_vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Every tensor in numpy order ([out, in] for matrices), float32."""
    d, hd = m.n_embd, m.dim
    q, kv = m.n_head * hd, m.n_head_kv * hd

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / math.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:  # also right for Gemma's stored 1 + w
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    t = {"token_embd.weight": (EMBED_STD * rng.standard_normal((n_vocab, d))).astype(np.float32),
         "output_norm.weight": norm(d)}
    if not m.tied:
        t["output.weight"] = mat(n_vocab, d)
    if m.rope_freqs is not None:
        t["rope_freqs.weight"] = np.asarray(m.rope_freqs, np.float32)
    for name, n in m.extra:
        t[name] = np.ones(n, np.float32)
    if m.longrope is not None:
        t["rope_factors_long.weight"] = np.asarray(m.longrope[0], np.float32)
        t["rope_factors_short.weight"] = np.asarray(m.longrope[1], np.float32)
    for i in range(m.n_layer):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = norm(d)
        t[p + "attn_q.weight"] = mat(q, d)
        t[p + "attn_k.weight"] = mat(kv, d)
        t[p + "attn_v.weight"] = mat(kv, d)
        if m.bias:
            for name, n in (("attn_q.bias", q), ("attn_k.bias", kv), ("attn_v.bias", kv)):
                t[p + name] = (0.5 * rng.standard_normal(n)).astype(np.float32)
        if m.qk_norm:
            t[p + "attn_q_norm.weight"] = norm(hd)
            t[p + "attn_k_norm.weight"] = norm(hd)
        t[p + "attn_output.weight"] = mat(d, q)
        if m.post_norms:
            t[p + "post_attention_norm.weight"] = norm(d)
        t[p + "ffn_norm.weight"] = norm(d)
        if m.n_expert:  # a router scaled so that the top experts stand apart (ties would be arbitrary)
            e, f = m.n_expert, m.n_ff_exp
            t[p + "ffn_gate_inp.weight"] = 4 * mat(e, d)
            t[p + "ffn_gate_exps.weight"] = np.stack([mat(f, d) for _ in range(e)])
            t[p + "ffn_up_exps.weight"] = np.stack([mat(f, d) for _ in range(e)])
            t[p + "ffn_down_exps.weight"] = np.stack([mat(d, f) for _ in range(e)])
            if m.n_ff_shexp:
                t[p + "ffn_gate_inp_shexp.weight"] = (rng.standard_normal(d) / math.sqrt(d)).astype(np.float32)
                t[p + "ffn_gate_shexp.weight"] = mat(m.n_ff_shexp, d)
                t[p + "ffn_up_shexp.weight"] = mat(m.n_ff_shexp, d)
                t[p + "ffn_down_shexp.weight"] = mat(d, m.n_ff_shexp)
        else:
            t[p + "ffn_gate.weight"] = mat(m.n_ff, d)
            t[p + "ffn_up.weight"] = mat(m.n_ff, d)
            t[p + "ffn_down.weight"] = mat(d, m.n_ff)
        if m.post_norms:
            t[p + "post_ffw_norm.weight"] = norm(d)
        if m.arch == "gpt-oss":  # O bias, a sink logit a head, the FFN norm named post_attention_norm, biases
            t[p + "attn_output.bias"] = (0.1 * rng.standard_normal(d)).astype(np.float32)
            t[p + "attn_sinks.weight"] = rng.standard_normal(m.n_head).astype(np.float32)
            t[p + "post_attention_norm.weight"] = t.pop(p + "ffn_norm.weight")
            t[p + "ffn_gate_inp.bias"] = (0.5 * rng.standard_normal(m.n_expert)).astype(np.float32)
            for name, n in (("gate", m.n_ff_exp), ("up", m.n_ff_exp), ("down", d)):
                t[p + f"ffn_{name}_exps.bias"] = (0.1 * rng.standard_normal((m.n_expert, n))).astype(np.float32)
            t[p + "ffn_gate_exps.bias"][:, :4] += 9.0  # past the clamped SwiGLU's limit of 7: the clamps show
            t[p + "ffn_up_exps.bias"][:, :2] += 9.0
            t[p + "ffn_up_exps.bias"][:, 2:4] -= 9.0
        if m.arch == "phi3":  # llama.cpp's Phi-3 layout: one QKV matrix, one gate-up matrix (gate first)
            t[p + "attn_qkv.weight"] = np.concatenate([t.pop(p + f"attn_{x}.weight") for x in "qkv"])
            t[p + "ffn_up.weight"] = np.concatenate([t.pop(p + "ffn_gate.weight"), t.pop(p + "ffn_up.weight")])
    return t


def with_added_tokens(vocab: list[tuple[str, Any, VT, VT | None]], added: tuple[str, ...]) -> list:
    """``vocab`` (vocab_metadata's) with control tokens appended (type 3, score 0)."""
    extra = {"tokenizer.ggml.tokens": list(added), "tokenizer.ggml.token_type": [3] * len(added),
             "tokenizer.ggml.scores": [0.0] * len(added)}
    return [(k, list(v) + extra[k], vt, sub) if k in extra else (k, v, vt, sub) for k, v, vt, sub in vocab]


def write_micro(m: Micro, path: str | Path) -> Path:
    rng = np.random.default_rng(m.seed)
    a = m.arch + "."
    w = GGUFWriter(str(path), m.arch)
    w.add_name(f"micro-{m.arch}")
    vocab = with_added_tokens(vocab_metadata(m.vocab, m.n_vocab), m.added_tokens)
    n_vocab = len(next(v for k, v, _, _ in vocab if k == "tokenizer.ggml.tokens"))
    w.add_uint32(a + "context_length", 256)
    w.add_uint32(a + "embedding_length", m.n_embd)
    w.add_uint32(a + "block_count", m.n_layer)
    w.add_uint32(a + "feed_forward_length", m.n_ff)
    w.add_uint32(a + "attention.head_count", m.n_head)
    w.add_uint32(a + "attention.head_count_kv", m.n_head_kv)
    if m.head_dim is not None:
        w.add_uint32(a + "attention.key_length", m.head_dim)
        w.add_uint32(a + "attention.value_length", m.head_dim)
    if m.arch == "llama":  # llama.cpp's converter writes it for llama; transformers reads it as head_dim
        w.add_uint32(a + "rope.dimension_count", m.dim)
    w.add_float32(a + "rope.freq_base", m.rope_base)
    w.add_float32(a + "attention.layer_norm_rms_epsilon", m.eps)
    if m.rope_linear is not None:
        w.add_string(a + "rope.scaling.type", "linear")
        w.add_float32(a + "rope.scaling.factor", m.rope_linear)
    if m.sliding_window:
        w.add_uint32(a + "attention.sliding_window", m.sliding_window)
    if m.attn_softcap is not None:
        w.add_float32(a + "attn_logit_softcapping", m.attn_softcap)
    if m.final_softcap is not None:
        w.add_float32(a + "final_logit_softcapping", m.final_softcap)
    if m.yarn is not None:
        w.add_string(a + "rope.scaling.type", "yarn")
        w.add_float32(a + "rope.scaling.factor", m.yarn[0])
        w.add_uint32(a + "rope.scaling.original_context_length", m.yarn[1])
    if m.longrope is not None:
        w.add_uint32(a + "rope.scaling.original_context_length", m.longrope[2])
        w.add_float32(a + "rope.scaling.attn_factor", m.longrope[3])
    if m.n_expert:
        w.add_uint32(a + "expert_count", m.n_expert)
        w.add_uint32(a + "expert_used_count", m.n_expert_used)
        w.add_uint32(a + "expert_feed_forward_length", m.n_ff_exp)
        if m.n_ff_shexp:
            w.add_uint32(a + "expert_shared_feed_forward_length", m.n_ff_shexp)
    if m.pooling_type is not None:
        w.add_uint32(a + "pooling_type", m.pooling_type)
    for key, val, vt, sub in vocab:
        if m.chat_template is None or key != "tokenizer.chat_template":
            w.add_key_value(key, val, vt, sub_type=sub)
    if m.chat_template is not None:
        w.add_string("tokenizer.chat_template", m.chat_template)
    for name, arr in _tensors(m, n_vocab, rng).items():
        qt = next((t for suffix, t in m.quant.items() if name.endswith(suffix)), None)
        if qt is None or arr.ndim < 2:
            w.add_tensor(name, arr)
        elif qt in (QT.Q8_0, QT.Q4_0, QT.Q5_0, QT.Q4_1, QT.Q5_1):  # real quantization of the random weights
            w.add_tensor(name, quantize(arr, QT(qt)), raw_dtype=QT(qt))
        elif QT(qt).name in IQ_KERNELS:  # i-quants and MXFP4: random well-formed blocks (reference_iq)
            blocks = random_iq_blocks(QT(qt).name, arr.size, rng, scale=float(arr.std()))
            w.add_tensor(name, blocks.reshape(*arr.shape[:-1], -1), raw_dtype=QT(qt))
        else:  # K-quants: random well-formed blocks (gguf-py cannot quantize them)
            blocks = random_blocks(int(qt), arr.size, rng, scale=float(arr.std()))
            w.add_tensor(name, blocks.reshape(*arr.shape[:-1], -1), raw_dtype=QT(qt))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def prompt_ids(n_vocab: int, n: int, seed: int = 1) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, n_vocab, n)]


def numpy_logits(path: str | Path, prompt: Sequence[int], more: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Our numpy backend: logits at every prompt position, then at every position of ``more`` (KV cache)."""
    f = open_gguf(path)
    cfg = config_from_gguf(f)
    be = NumpyBackend(f, cfg, n_ctx=64)
    first = be.eval(list(prompt), all_logits=True)
    second = be.eval(list(more), all_logits=True)
    return first, second


def hf_model(path: str | Path, **overrides: Any):
    """transformers' own GGUF loader (float32, eager attention); ``overrides``: config fields it does not read."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    path = Path(path)
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                attn_implementation="eager", **overrides).eval()


def hf_logits(model, ids: Sequence[int]) -> np.ndarray:
    """Logits at every position of ``ids``, in one causal pass."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].float().numpy()
