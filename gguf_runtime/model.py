"""The one model definition: a decoder-only transformer over a backend's blocks.

Every supported architecture is ``forward`` with a different ``ModelConfig``. A backend provides
the ``Blocks`` protocol: six operations at the granularity where a GPU backend fuses kernels
(norm + QKV + RoPE + KV write; attention; output projection + residual; the whole FFN +
residual). ``ComposedBlocks`` defines what each block computes, from unfused primitives; the
numpy backend runs it, and the CUDA backend's fused kernels are tested against it.
Arrays are [tokens, features]; heads are a reshape away.
"""

from __future__ import annotations

import math
from typing import Any, Protocol, Sequence

import numpy as np

from .format.model_config import ModelConfig


class Blocks(Protocol):
    def embed(self, tokens: Sequence[int]) -> Any: ...
    def attn_in(self, x: Any, layer: int, positions: Any) -> Any: ...  # -> q [T, H, D]; K, V cached
    def attend(self, layer: int, q: Any, positions: Any) -> Any: ...  # -> [T, H * Dv]
    def attn_out(self, x: Any, a: Any, layer: int) -> Any: ...  # -> x + O(a)
    def ffn(self, x: Any, layer: int) -> Any: ...  # -> x + FFN(x)
    def logits(self, x: Any) -> Any: ...  # final norm, lm_head, soft-cap


def layers(blocks: Blocks, cfg: ModelConfig, tokens: Sequence[int], positions: Any) -> Any:
    """Run ``tokens`` at ``positions`` through every layer, filling the KV cache; the residual
    stream [T, n_embd] before the output norm (embeddings: the norm, then pooling)."""
    x = blocks.embed(tokens)
    for i in range(cfg.n_layer):
        q = blocks.attn_in(x, i, positions)
        a = blocks.attend(i, q, positions)
        x = blocks.attn_out(x, a, i)
        x = blocks.ffn(x, i)
    return x


def forward(blocks: Blocks, cfg: ModelConfig, tokens: Sequence[int], positions: Any,
            all_logits: bool = False) -> Any:
    """Run ``tokens`` at ``positions``, filling the KV cache; logits [T or 1, n_vocab]."""
    x = layers(blocks, cfg, tokens, positions)
    if not all_logits:
        x = x[len(tokens) - 1:]
    return blocks.logits(x)


def lm_head_name(cfg: ModelConfig) -> str:
    return "token_embd.weight" if cfg.tied_embeddings else "output.weight"


class Collectives(Protocol):
    """Tensor parallelism's two collectives over the ranks (format/shard.py splits the model)."""

    def all_reduce(self, x: Any) -> Any: ...  # the sum of every rank's x
    def all_gather(self, x: Any) -> Any: ...  # [T, N] of each rank -> [T, ranks * N], rank-major


class Primitives(Protocol):
    """Unfused operations; weights are named by their GGUF tensor names."""

    def embed(self, tokens: Sequence[int]) -> Any: ...  # includes the embedding scale
    def rms_norm(self, x: Any, weight: str) -> Any: ...  # over the last axis
    def linear(self, x: Any, weight: str, bias: str | None = None) -> Any: ...  # x @ W.T (+ b)
    def expert_linear(self, x: Any, weight: str, expert: int) -> Any: ...  # x @ W[expert].T (stacked experts)
    def expert_bias(self, name: str, expert: int) -> Any: ...  # row expert of a stacked [experts, n] bias
    def rope(self, x: Any, positions: Any, layer: int) -> Any: ...  # x [T, heads, head_dim]
    def store_kv(self, layer: int, k: Any, v: Any, positions: Any) -> None: ...
    def attention(self, layer: int, q: Any, positions: Any) -> Any: ...  # over the cache -> [T, H, Dv]
    def glu(self, gate: Any, up: Any) -> Any: ...  # act(gate) * up
    def softcap(self, x: Any, cap: float) -> Any: ...


class ComposedBlocks:
    """The blocks' definition, composed from primitives."""

    def __init__(self, prim: Primitives, cfg: ModelConfig, comm: "Collectives | None" = None) -> None:
        self.p, self.cfg, self.comm = prim, cfg, comm

    def embed(self, tokens: Sequence[int]) -> Any:
        return self.p.embed(tokens)

    def attn_in(self, x: Any, layer: int, positions: Any) -> Any:
        p, cfg, n = self.p, self.cfg, x.shape[0]
        w = f"blk.{layer}."
        h = p.rms_norm(x, w + "attn_norm.weight")
        b = cfg.attn_bias
        if cfg.fused_qkv:  # Phi-3: one product, then Q | K | V rows
            hq, hk = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
            qkv = p.linear(h, w + "attn_qkv.weight")
            q, k, v = qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:]
        else:
            q = p.linear(h, w + "attn_q.weight", w + "attn_q.bias" if b else None)
            k = p.linear(h, w + "attn_k.weight", w + "attn_k.bias" if b else None)
            v = p.linear(h, w + "attn_v.weight", w + "attn_v.bias" if b else None)
        q = q.reshape(n, cfg.n_head, cfg.head_dim)
        k = k.reshape(n, cfg.n_head_kv, cfg.head_dim)
        v = v.reshape(n, cfg.n_head_kv, cfg.head_dim_v)
        if cfg.qk_norm:
            q = p.rms_norm(q, w + "attn_q_norm.weight")
            k = p.rms_norm(k, w + "attn_k_norm.weight")
        q = p.rope(q, positions, layer)
        k = p.rope(k, positions, layer)
        p.store_kv(layer, k, v, positions)
        return q

    def attend(self, layer: int, q: Any, positions: Any) -> Any:
        a = self.p.attention(layer, q, positions)
        return a.reshape(a.shape[0], self.cfg.n_head * self.cfg.head_dim_v)

    def attn_out(self, x: Any, a: Any, layer: int) -> Any:
        w = f"blk.{layer}."
        o = self.p.linear(a, w + "attn_output.weight", w + "attn_output.bias" if self.cfg.o_bias else None)
        if self.comm is not None:  # a rank's heads: a partial sum of O's product (format/shard.py)
            o = self.comm.all_reduce(o)
        if self.cfg.post_norms:
            o = self.p.rms_norm(o, w + "post_attention_norm.weight")
        return x + o

    def ffn(self, x: Any, layer: int) -> Any:
        p, w = self.p, f"blk.{layer}."
        h = p.rms_norm(x, w + self.cfg.ffn_norm + ".weight")
        if self.cfg.n_expert:
            d = self.moe(h, layer)
        elif self.cfg.fused_gate_up:  # Phi-3: one product, gate rows first
            gu = p.linear(h, w + "ffn_up.weight")
            d = p.linear(p.glu(gu[:, :self.cfg.n_ff], gu[:, self.cfg.n_ff:]), w + "ffn_down.weight")
        else:
            d = p.linear(p.glu(p.linear(h, w + "ffn_gate.weight"), p.linear(h, w + "ffn_up.weight")),
                         w + "ffn_down.weight")
        if self.comm is not None:  # a rank's FFN rows: a partial sum of down's product
            d = self.comm.all_reduce(d)
        if self.cfg.post_norms:
            d = p.rms_norm(d, w + "post_ffw_norm.weight")
        return x + d

    def moe(self, h: np.ndarray, layer: int) -> np.ndarray:
        """Mixture of experts (Qwen3-MoE, Qwen2-MoE, as llama.cpp's build_moe_ffn): router
        probabilities by softmax, the n_expert_used most probable experts a token (renormalized over
        them where expert_norm), each a SwiGLU; tokens grouped by expert; then the shared expert."""
        p, cfg, w = self.p, self.cfg, f"blk.{layer}."
        b = cfg.expert_bias  # gpt-oss: the router and every expert product carry biases
        logits = np.asarray(p.linear(h, w + "ffn_gate_inp.weight", w + "ffn_gate_inp.bias" if b else None), np.float32)
        probs = softmax(logits)
        chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :cfg.n_expert_used]  # ties: the lower id
        weights = np.take_along_axis(probs, chosen, -1)
        if cfg.expert_norm:  # (gpt-oss' softmax over the k largest logits is the same)
            weights = weights / weights.sum(-1, keepdims=True)

        def lin(x: np.ndarray, name: str, e: int) -> np.ndarray:
            y = p.expert_linear(x, w + name + ".weight", e)
            return y + p.expert_bias(w + name + ".bias", e) if b else y

        out = np.zeros_like(h)
        for e in np.unique(chosen):
            rows, slot = np.nonzero(chosen == e)
            he = h[rows]
            y = lin(p.glu(lin(he, "ffn_gate_exps", e), lin(he, "ffn_up_exps", e)), "ffn_down_exps", e)
            out[rows] += weights[rows, slot][:, None] * y
        if cfg.n_ff_shexp:  # Qwen2-MoE's shared expert, every token, times sigmoid(h . w)
            shared = p.linear(p.glu(p.linear(h, w + "ffn_gate_shexp.weight"), p.linear(h, w + "ffn_up_shexp.weight")),
                              w + "ffn_down_shexp.weight")
            g = np.asarray(p.linear(h, w + "ffn_gate_inp_shexp.weight"), np.float32).reshape(-1, 1)
            out += shared / (1 + np.exp(-g))
        return out

    def final_norm(self, x: Any) -> Any:
        """The output RMSNorm: the final hidden states (the lm_head's input, embeddings' rows)."""
        return self.p.rms_norm(x, "output_norm.weight")

    def logits(self, x: Any) -> Any:
        out = self.p.linear(self.final_norm(x), lm_head_name(self.cfg))
        if self.comm is not None:  # a rank's vocabulary rows: every rank's, side by side
            out = self.comm.all_gather(out)[:, :self.cfg.n_vocab]
        if self.cfg.final_softcap:
            out = self.p.softcap(out, self.cfg.final_softcap)
        return out


def softmax(x: np.ndarray) -> np.ndarray:
    """Over the last axis, in x's precision (float32 for the router, as llama.cpp and transformers)."""
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def rope_inv_freq(cfg: ModelConfig, base: float, scale: float,
                  freq_factors: np.ndarray | None = None) -> np.ndarray:
    """theta_j = scale * pos * base^(-2j/n_dims) / factor_j, for j < n_dims/2 (float64)."""
    n = cfg.rope.n_dims
    inv = base ** (-np.arange(0, n, 2, dtype=np.float64) / n) * scale
    if freq_factors is not None:
        inv = inv / freq_factors.astype(np.float64)
    if cfg.rope.yarn_factor:
        inv = yarn_mix(inv, cfg.rope.yarn_factor, base, n, cfg.rope.orig_ctx, cfg.rope.yarn_beta_fast,
                       cfg.rope.yarn_beta_slow)
    return inv


def yarn_mix(inv: np.ndarray, factor: float, base: float, n_dims: int, orig_ctx: int, beta_fast: float,
             beta_slow: float) -> np.ndarray:
    """YaRN (as OpenAI's gpt-oss and transformers with truncate off): pair j keeps its frequency
    (extrapolates) below the dimension that turns beta_fast times in orig_ctx tokens, is divided by
    factor (interpolates) past the one turning beta_slow times, and ramps linearly between. llama.cpp
    rounds the two ends to whole dimensions (floor, ceil); the difference moves a few pairs near them."""
    def dim(turns: float) -> float:
        return n_dims * math.log(orig_ctx / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(dim(beta_fast), 0.0), min(dim(beta_slow), n_dims - 1.0)
    ramp = np.clip((np.arange(inv.shape[0], dtype=np.float64) - low) / max(high - low, 0.001), 0.0, 1.0)
    return inv / factor * ramp + inv * (1.0 - ramp)
