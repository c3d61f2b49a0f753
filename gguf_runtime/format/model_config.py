"""Model configuration read from GGUF metadata, and the checks that a file can run here.

One ``ModelConfig`` describes every supported architecture (llama, gemma3, qwen2, qwen3, qwen3moe,
qwen2moe, phi3, gpt-oss):
the differences are data (norm placement, activation, RoPE style, per-layer windows, biases, a
mixture-of-experts FFN), so a single model definition (``model.py``) runs them all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import GGUFError, UnsupportedModelError
from .gguf_file import GGUFFile
from .blocks import SUPPORTED, SUPPORTED_IDS

SUPPORTED_ARCHS = ("llama", "gemma3", "qwen2", "qwen3", "qwen3moe", "qwen2moe", "phi3", "gpt-oss")
ARCH_EXAMPLES = ("llama (SmolLM2, Llama 2/3, Mistral, TinyLlama), gemma3, qwen2, qwen3, qwen3moe (Qwen3-30B-A3B, "
                 "Qwen3-235B-A22B), and on the numpy backend qwen2moe (Qwen1.5-MoE, Qwen2-57B-A14B), phi3 (Phi-3, "
                 "Phi-3.5, Phi-4-mini), gpt-oss (gpt-oss-20b, -120b)")
MOE_ARCHS = ("qwen3moe", "qwen2moe", "gpt-oss")
# gpt-oss: the clamped SwiGLU's alpha and limit (llama.cpp and transformers' defaults: the files carry neither)
OAI_GLU_ALPHA, OAI_GLU_LIMIT = 1.702, 7.0
MAX_EXPERTS = 1024

ROPE_NORM, ROPE_NEOX = "norm", "neox"


@dataclass(frozen=True)
class RopeConfig:
    style: str  # "norm": rotate pairs (2i, 2i+1) as llama.cpp's LLaMA; "neox": pairs (i, i + n_dims/2)
    n_dims: int  # rotated dimensions per head (the rest pass through)
    base: float
    scale: float = 1.0  # linear position scaling: positions are multiplied by this
    base_local: float | None = None  # sliding-window layers' base (Gemma-3), None = same as base
    scale_local: float = 1.0  # sliding-window layers' position scaling (Gemma-3 scales global layers only)
    freq_factors: str | None = None  # tensor dividing each frequency (Llama-3.1 long-context scaling)
    # LongRoPE (Phi-3.5, Phi-4-mini): factor tensors for contexts up to / past orig_ctx, chosen by
    # the context size as llama.cpp does, and attn_factor scaling cos and sin
    long_factors: str | None = None
    short_factors: str | None = None
    orig_ctx: int = 0
    attn_factor: float = 1.0
    # YaRN (gpt-oss): frequencies between interpolated (divided by yarn_factor) and extrapolated ones,
    # ramped over the dimensions whose wavelengths lie between the beta_fast and beta_slow rotations
    # in orig_ctx tokens; attn_factor = 1 + 0.1 ln(factor) scales cos and sin
    yarn_factor: float = 0.0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0

    def factors_for(self, n_ctx: int) -> str | None:
        """The frequency-factor tensor of a context of n_ctx tokens (None: plain RoPE)."""
        if self.long_factors:
            return self.long_factors if n_ctx > self.orig_ctx else self.short_factors
        return self.freq_factors


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    name: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int  # key/query head size
    head_dim_v: int
    n_ctx_train: int
    rms_eps: float
    rope: RopeConfig
    activation: str  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    tied_embeddings: bool
    embed_scale: float  # Gemma multiplies embeddings by sqrt(n_embd)
    qk_norm: bool  # per-head RMSNorm of q and k (Gemma-3, Qwen3)
    attn_bias: bool  # q/k/v biases (Qwen2)
    post_norms: bool  # Gemma's extra norms after attention and after the FFN
    attn_scale: float
    attn_softcap: float | None
    final_softcap: float | None
    layer_window: tuple[int, ...] = field(default=())  # per layer: 0 = full attention, else window
    # mixture of experts (n_expert > 0): every layer's FFN is n_expert SwiGLU experts of n_ff_exp,
    # n_expert_used of them a token, chosen by a softmax router and weighted by its probabilities
    # (renormalized over the chosen ones where expert_norm: Qwen3-MoE, not Qwen2-MoE), plus a
    # shared expert of n_ff_shexp (Qwen2-MoE) scaled by a sigmoid gate of its own
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    expert_norm: bool = True
    n_ff_shexp: int = 0
    # Phi-3: Q, K and V rows in one matrix (attn_qkv), gate and up rows in one (ffn_up: gate first)
    fused_qkv: bool = False
    fused_gate_up: bool = False
    # gpt-oss: the FFN's norm tensor (post_attention_norm there), an O bias, per-head attention sinks
    # (a logit in every softmax's denominator), router and expert biases (its softmax over the k
    # largest logits is expert_norm's renormalized top-k), and activation "swiglu_oai" (gate clamped
    # to glu_limit, up to +-glu_limit, (up + 1) gate sigmoid(alpha gate))
    ffn_norm: str = "ffn_norm"
    o_bias: bool = False
    attn_sinks: bool = False
    expert_bias: bool = False
    glu_limit: float = 0.0
    glu_alpha: float = 0.0
    # embeddings: llama.cpp's {arch}.pooling_type (0 none, 1 mean, 2 cls, 3 last, 4 rank); None where the
    # file has no such key (a decoder LLM: engine/embed.py pools its last token)
    pooling_type: int | None = None

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv

    def is_local(self, layer: int) -> bool:
        return self.layer_window[layer] > 0

    def rope_base(self, layer: int) -> float:
        if self.is_local(layer) and self.rope.base_local is not None:
            return self.rope.base_local
        return self.rope.base

    def rope_scale(self, layer: int) -> float:
        if self.is_local(layer) and self.rope.base_local is not None:
            return self.rope.scale_local
        return self.rope.scale

    def rope_key(self, layer: int) -> tuple[float, float]:
        """(base, position scale) of layer's RoPE: layers with equal keys share a table."""
        return self.rope_base(layer), self.rope_scale(layer)


def _show(v: Any) -> str:
    text = repr(v.tolist() if hasattr(v, "tolist") else v)
    return text[:60] + "..." if len(text) > 63 else text


def _int(meta: dict[str, Any], key: str, default: int | None = None, lo: int = 0, hi: int = 1 << 40) -> int:
    """An integer field in [lo, hi] (a per-layer array of one value counts as that value)."""
    v = meta.get(key, default)
    if v is None:
        raise UnsupportedModelError(f"model metadata lacks '{key}'; the file is incomplete or not a supported model")
    if isinstance(v, (list, tuple)) or hasattr(v, "shape"):
        if not len(v) or not all(_is_int(x) for x in v):
            raise GGUFError(f"metadata '{key}' = {_show(v)} is not an integer; the file is damaged")
        vals = {int(x) for x in v}
        if len(vals) != 1:
            raise UnsupportedModelError(f"'{key}' varies per layer ({sorted(vals)[:8]}); per-layer sizes are "
                                        "not supported")
        v = vals.pop()
    if not _is_int(v) or not lo <= int(v) <= hi:
        raise GGUFError(f"metadata '{key}' = {_show(v)} is not an integer from {lo} to {hi}; the file is damaged")
    return int(v)


def _is_int(v: Any) -> bool:
    if isinstance(v, (bool, np.bool_)):
        return False
    if isinstance(v, (int, np.integer)):
        return True
    return isinstance(v, (float, np.floating)) and math.isfinite(v) and float(v).is_integer()


def _float(meta: dict[str, Any], key: str, default: float | None = None, lo: float = -math.inf,
           hi: float = math.inf, above: bool = False) -> float | None:
    """A finite number in [lo, hi] (above: strictly greater than lo)."""
    v = meta.get(key, default)
    if v is None:
        return None
    ok = not isinstance(v, (bool, np.bool_)) and isinstance(v, (int, float, np.integer, np.floating))
    if not ok or not math.isfinite(v) or not (v > lo if above else v >= lo) or v > hi:
        rng = f"{'above' if above else 'at least'} {lo:g}" + (f" and at most {hi:g}" if hi < math.inf else "")
        raise GGUFError(f"metadata '{key}' = {_show(v)} is not a finite number {rng}; the file is damaged")
    return float(v)


def _layers_in_file(f: GGUFFile) -> int:
    """1 + the highest N of the file's blk.N.* tensors (0 without any)."""
    top = -1
    for name in f.tensors:
        if name.startswith("blk."):
            n = name[4:].split(".", 1)[0]
            if n.isdigit():
                top = max(top, int(n))
    return top + 1


def config_from_gguf(f: GGUFFile) -> ModelConfig:
    """Read the architecture's hyper-parameters; refuse anything this runtime can't run. Every field is
    checked for type, range and agreement with the tensors before anything is sized from it."""
    try:
        return _config(f)
    except GGUFError as e:  # name the file in every line
        if str(e).startswith(f"{f.path}: "):
            raise
        raise GGUFError(f"{f.path}: {e}") from None


def _config(f: GGUFFile) -> ModelConfig:
    meta = f.metadata
    arch = f.architecture
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"{f.path}: architecture {arch!r} is not supported; supported: {ARCH_EXAMPLES}")
    a = arch + "."
    n_embd = _int(meta, a + "embedding_length")
    n_head = _int(meta, a + "attention.head_count")
    n_head_kv = _int(meta, a + "attention.head_count_kv", n_head)
    head_dim = _int(meta, a + "attention.key_length", n_embd // max(n_head, 1))
    head_dim_v = _int(meta, a + "attention.value_length", head_dim)
    n_layer = _int(meta, a + "block_count")
    if min(n_embd, n_head, n_head_kv, head_dim, n_layer) <= 0 or n_head % n_head_kv:
        raise GGUFError(f"{f.path}: inconsistent sizes (embedding {n_embd}, heads {n_head}, kv heads "
                        f"{n_head_kv}, head size {head_dim}, layers {n_layer}); the file is damaged")
    # against the tensors, before anything is sized from these numbers
    if n_layer != (held := _layers_in_file(f)):
        raise GGUFError(f"{f.path}: metadata '{a}block_count' = {n_layer}, but the file holds tensors of {held} "
                        "layers; the file is damaged")
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is not None and not (isinstance(tokens, list) and all(isinstance(t, str) for t in tokens)):
        raise GGUFError(f"{f.path}: metadata 'tokenizer.ggml.tokens' = {_show(tokens)} is not an array of "
                        "strings; the file is damaged")
    n_vocab = _int(meta, a + "vocab_size", len(tokens) if isinstance(tokens, list) else None, lo=1)
    if isinstance(tokens, list) and n_vocab != len(tokens):
        raise GGUFError(f"{f.path}: metadata '{a}vocab_size' = {n_vocab}, but tokenizer.ggml.tokens holds "
                        f"{len(tokens)} tokens; the file is damaged")
    embd = f.tensors.get("token_embd.weight")
    if embd is not None and tuple(embd.shape) != (n_vocab, n_embd):
        raise GGUFError(f"{f.path}: tensor 'token_embd.weight' has shape {list(embd.shape)}, expected "
                        f"{[n_vocab, n_embd]} from '{a}vocab_size' and '{a}embedding_length'; the file is damaged")

    gemma, oai = arch == "gemma3", arch == "gpt-oss"
    neox = arch in ("gemma3", "qwen2", "qwen3", "qwen3moe", "qwen2moe", "phi3", "gpt-oss")
    n_expert = n_expert_used = n_ff_exp = n_ff_shexp = 0
    if arch in MOE_ARCHS:
        n_expert = _int(meta, a + "expert_count", lo=1, hi=MAX_EXPERTS)
        n_expert_used = _int(meta, a + "expert_used_count", lo=1, hi=n_expert)
        n_ff_exp = _int(meta, a + "expert_feed_forward_length", lo=1, hi=1 << 20)
        if arch == "qwen2moe":
            n_ff_shexp = _int(meta, a + "expert_shared_feed_forward_length", lo=1, hi=1 << 20)
    rope_scale = 1.0
    scaling = meta.get(a + "rope.scaling.type")
    if scaling is not None and not isinstance(scaling, str):
        raise GGUFError(f"metadata '{a}rope.scaling.type' = {_show(scaling)} is not a string; the file is damaged")
    factor = _float(meta, a + "rope.scaling.factor", None, lo=0.0)
    yarn = {}
    if scaling in (None, "none") or (scaling in ("linear", "yarn") and (not factor or factor == 1.0)):
        pass
    elif scaling == "linear":
        rope_scale = 1.0 / factor
    elif scaling == "yarn" and factor and factor > 1.0:
        yarn = dict(yarn_factor=factor, orig_ctx=_int(meta, a + "rope.scaling.original_context_length", lo=1),
                    yarn_beta_fast=_float(meta, a + "rope.scaling.yarn_beta_fast", 32.0, lo=0.0, above=True),
                    yarn_beta_slow=_float(meta, a + "rope.scaling.yarn_beta_slow", 1.0, lo=0.0, above=True),
                    attn_factor=1.0 + 0.1 * math.log(factor))
    elif scaling == "yarn":
        raise GGUFError(f"metadata '{a}rope.scaling.factor' = {_show(factor)} with YaRN scaling: a YaRN factor is "
                        "1 or more; the file is damaged")
    else:
        raise UnsupportedModelError(f"{f.path}: RoPE scaling '{scaling}' is not supported (none, linear and yarn "
                                    "are)")
    if sc := _float(meta, a + "rope.scale_linear", None, lo=0.0):
        rope_scale = 1.0 / sc
    longrope = {}
    if "rope_factors_long.weight" in f.tensors or "rope_factors_short.weight" in f.tensors:
        if not {"rope_factors_long.weight", "rope_factors_short.weight"} <= set(f.tensors):
            raise GGUFError(f"{f.path}: the file holds only one of rope_factors_long / rope_factors_short; the file "
                            "is damaged")
        longrope = dict(long_factors="rope_factors_long.weight", short_factors="rope_factors_short.weight",
                        orig_ctx=_int(meta, a + "rope.scaling.original_context_length", lo=1),
                        attn_factor=_float(meta, a + "rope.scaling.attn_factor", 1.0, lo=0.0, hi=16.0, above=True))
    rope = RopeConfig(
        style=ROPE_NEOX if neox else ROPE_NORM,
        n_dims=_int(meta, a + "rope.dimension_count", head_dim),
        base=_float(meta, a + "rope.freq_base", 10000.0, lo=0.0, above=True),
        scale=rope_scale,
        base_local=10000.0 if gemma else None,
        freq_factors="rope_freqs.weight" if "rope_freqs.weight" in f.tensors else None,
        **longrope,
        **yarn,
    )
    if rope.n_dims > head_dim or rope.n_dims % 2:
        raise GGUFError(f"{f.path}: RoPE dimension count {rope.n_dims} does not fit head size {head_dim}")

    windows = [0] * n_layer
    window = _int(meta, a + "attention.sliding_window", 0)
    if gemma and window:
        pattern = meta.get(a + "attention.sliding_window_pattern")
        if pattern is not None and hasattr(pattern, "__len__") and not isinstance(pattern, str):
            flags = list(pattern)
            if len(flags) != n_layer or not all(isinstance(p, (int, np.integer, np.bool_)) for p in flags):
                raise GGUFError(f"metadata '{a}attention.sliding_window_pattern' = {_show(pattern)} is not a flag "
                                f"for each of the {n_layer} layers; the file is damaged")
            windows = [window if bool(p) else 0 for p in flags]
        else:
            period = _int(meta, a + "attention.sliding_window_pattern", 6) if pattern is not None else 6
            windows = [0 if (i + 1) % max(period, 1) == 0 else window for i in range(n_layer)]
    if oai and window:  # llama.cpp's swa pattern 2: the even layers slide
        windows = [window if i % 2 == 0 else 0 for i in range(n_layer)]

    attn_softcap = _float(meta, a + "attn_logit_softcapping", None, lo=0.0)
    final_softcap = _float(meta, a + "final_logit_softcapping", None, lo=0.0)
    cfg = ModelConfig(
        arch=arch,
        name=str(meta.get("general.name", arch)),
        n_vocab=n_vocab,
        n_embd=n_embd,
        n_layer=n_layer,
        n_ff=_int(meta, a + "feed_forward_length", n_ff_exp or None),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        n_ctx_train=_int(meta, a + "context_length", 2048, lo=1),
        rms_eps=_float(meta, a + "attention.layer_norm_rms_epsilon", 1e-5, lo=0.0, hi=1.0),
        rope=rope,
        activation="gelu_tanh" if gemma else "swiglu_oai" if oai else "silu",
        tied_embeddings="output.weight" not in f.tensors,
        embed_scale=math.sqrt(n_embd) if gemma else 1.0,
        qk_norm="blk.0.attn_q_norm.weight" in f.tensors,
        attn_bias="blk.0.attn_q.bias" in f.tensors,
        post_norms="blk.0.post_attention_norm.weight" in f.tensors and not oai,
        # llama.cpp: Gemma-3 27B (62 layers) scales by the model width per head, not the head size
        attn_scale=1.0 / math.sqrt(n_embd // n_head if gemma and n_layer == 62 else head_dim),
        attn_softcap=attn_softcap or None,
        final_softcap=final_softcap or None,
        layer_window=tuple(windows),
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        n_ff_exp=n_ff_exp,
        expert_norm=arch != "qwen2moe",
        n_ff_shexp=n_ff_shexp,
        fused_qkv="blk.0.attn_qkv.weight" in f.tensors,
        fused_gate_up=arch == "phi3",
        ffn_norm="post_attention_norm" if oai else "ffn_norm",
        o_bias="blk.0.attn_output.bias" in f.tensors,
        attn_sinks=oai,
        expert_bias=oai,
        glu_limit=OAI_GLU_LIMIT if oai else 0.0,
        glu_alpha=OAI_GLU_ALPHA if oai else 0.0,
        pooling_type=_int(meta, a + "pooling_type", lo=0, hi=4) if a + "pooling_type" in meta else None,
    )
    check_tensors(f, cfg)
    return cfg


def layer_tensors(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Name -> expected shape (numpy order) of every tensor of layer i."""
    p = f"blk.{i}."
    d, q, kv, kvv = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim, cfg.n_head_kv * cfg.head_dim_v
    t = {p + "attn_norm.weight": (d,)}
    if cfg.fused_qkv:
        t[p + "attn_qkv.weight"] = (q + kv + kvv, d)
    else:
        t.update({p + "attn_q.weight": (q, d), p + "attn_k.weight": (kv, d), p + "attn_v.weight": (kvv, d)})
    t[p + "attn_output.weight"] = (d, cfg.n_head * cfg.head_dim_v)
    if cfg.o_bias:
        t[p + "attn_output.bias"] = (d,)
    if cfg.attn_sinks:
        t[p + "attn_sinks.weight"] = (cfg.n_head,)
    t[p + cfg.ffn_norm + ".weight"] = (d,)
    if cfg.n_expert:  # the router, then every expert's matrices stacked: [expert, rows, columns]
        e, f = cfg.n_expert, cfg.n_ff_exp
        t[p + "ffn_gate_inp.weight"] = (e, d)
        t[p + "ffn_gate_exps.weight"] = (e, f, d)
        t[p + "ffn_up_exps.weight"] = (e, f, d)
        t[p + "ffn_down_exps.weight"] = (e, d, f)
        if cfg.expert_bias:
            t[p + "ffn_gate_inp.bias"] = (e,)
            t[p + "ffn_gate_exps.bias"] = (e, f)
            t[p + "ffn_up_exps.bias"] = (e, f)
            t[p + "ffn_down_exps.bias"] = (e, d)
        if cfg.n_ff_shexp:
            s = cfg.n_ff_shexp
            t[p + "ffn_gate_inp_shexp.weight"] = (d,)
            t[p + "ffn_gate_shexp.weight"] = (s, d)
            t[p + "ffn_up_shexp.weight"] = (s, d)
            t[p + "ffn_down_shexp.weight"] = (d, s)
    elif cfg.fused_gate_up:
        t[p + "ffn_up.weight"] = (2 * cfg.n_ff, d)
        t[p + "ffn_down.weight"] = (d, cfg.n_ff)
    else:
        t[p + "ffn_gate.weight"] = (cfg.n_ff, d)
        t[p + "ffn_up.weight"] = (cfg.n_ff, d)
        t[p + "ffn_down.weight"] = (d, cfg.n_ff)
    if cfg.qk_norm:
        t[p + "attn_q_norm.weight"] = (cfg.head_dim,)
        t[p + "attn_k_norm.weight"] = (cfg.head_dim,)
    if cfg.attn_bias:
        t[p + "attn_q.bias"] = (q,)
        t[p + "attn_k.bias"] = (kv,)
        t[p + "attn_v.bias"] = (kvv,)
    if cfg.post_norms:
        t[p + "post_attention_norm.weight"] = (d,)
        t[p + "post_ffw_norm.weight"] = (d,)
    return t


def model_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    t = {"token_embd.weight": (cfg.n_vocab, cfg.n_embd), "output_norm.weight": (cfg.n_embd,)}
    if not cfg.tied_embeddings:
        t["output.weight"] = (cfg.n_vocab, cfg.n_embd)
    for name in (cfg.rope.freq_factors, cfg.rope.long_factors, cfg.rope.short_factors):
        if name:
            t[name] = (cfg.rope.n_dims // 2,)
    for i in range(cfg.n_layer):
        t.update(layer_tensors(cfg, i))
    return t


def check_tensors(f: GGUFFile, cfg: ModelConfig) -> None:
    """Every tensor the model needs is present, of the right shape and of a supported type."""
    for name, shape in model_tensors(cfg).items():
        info = f.tensors.get(name)
        if info is None:
            raise UnsupportedModelError(f"{f.path}: tensor '{name}' is missing; the file is incomplete or "
                                        f"its {cfg.arch} variant is not supported")
        if info.shape != shape:
            raise GGUFError(f"{f.path}: tensor '{name}' has shape {list(info.shape)}, expected {list(shape)} "
                            "from the metadata; the file is damaged")
        if info.type_id not in SUPPORTED_IDS:
            raise UnsupportedModelError(
                f"{f.path}: tensor '{name}' uses quant type {info.type_name}, which is not supported; "
                f"supported: {', '.join(SUPPORTED)}")


