"""The one model definition: a decoder-only transformer over a backend's ops.

Every supported architecture is this function with a different ``ModelConfig``; every backend
implements the ``Ops`` protocol below on its own arrays (numpy on the CPU, CuPy kernels on the
GPU). Arrays are [tokens, features]; heads are a reshape away.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from .model_config import ModelConfig


class Ops(Protocol):
    """What a backend provides. ``positions`` are absolute positions of the rows of x."""

    def embed(self, tokens: Sequence[int]) -> Any: ...
    def rms_norm(self, x: Any, weight: str) -> Any: ...  # normalizes the last axis
    def linear(self, x: Any, weight: str, bias: str | None = None) -> Any: ...  # x @ W.T (+ b)
    def rope(self, x: Any, positions: Any, layer: int) -> Any: ...  # x: [T, heads, head_dim]
    def attend(self, layer: int, q: Any, k: Any, v: Any, positions: Any) -> Any: ...  # stores k, v
    def glu(self, gate: Any, up: Any) -> Any: ...  # act(gate) * up
    def add(self, x: Any, y: Any) -> Any: ...
    def softcap(self, x: Any, cap: float) -> Any: ...


def lm_head_name(cfg: ModelConfig) -> str:
    return "token_embd.weight" if cfg.tied_embeddings else "output.weight"


def forward(ops: Ops, cfg: ModelConfig, tokens: Sequence[int], positions: Any,
            all_logits: bool = False) -> Any:
    """Run ``tokens`` at ``positions`` through the model, filling the KV cache.

    Returns logits [T, n_vocab] if ``all_logits`` else [1, n_vocab] for the last token.
    """
    n = len(tokens)
    x = ops.embed(tokens)
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        h = ops.rms_norm(x, p + "attn_norm.weight")
        bias = cfg.attn_bias
        q = ops.linear(h, p + "attn_q.weight", p + "attn_q.bias" if bias else None)
        k = ops.linear(h, p + "attn_k.weight", p + "attn_k.bias" if bias else None)
        v = ops.linear(h, p + "attn_v.weight", p + "attn_v.bias" if bias else None)
        q = q.reshape(n, cfg.n_head, cfg.head_dim)
        k = k.reshape(n, cfg.n_head_kv, cfg.head_dim)
        v = v.reshape(n, cfg.n_head_kv, cfg.head_dim_v)
        if cfg.qk_norm:
            q = ops.rms_norm(q, p + "attn_q_norm.weight")
            k = ops.rms_norm(k, p + "attn_k_norm.weight")
        q = ops.rope(q, positions, i)
        k = ops.rope(k, positions, i)
        a = ops.attend(i, q, k, v, positions)
        o = ops.linear(a.reshape(n, cfg.n_head * cfg.head_dim_v), p + "attn_output.weight")
        if cfg.post_norms:
            o = ops.rms_norm(o, p + "post_attention_norm.weight")
        x = ops.add(x, o)

        h = ops.rms_norm(x, p + "ffn_norm.weight")
        m = ops.glu(ops.linear(h, p + "ffn_gate.weight"), ops.linear(h, p + "ffn_up.weight"))
        d = ops.linear(m, p + "ffn_down.weight")
        if cfg.post_norms:
            d = ops.rms_norm(d, p + "post_ffw_norm.weight")
        x = ops.add(x, d)

    if not all_logits:
        x = x[n - 1:]
    x = ops.rms_norm(x, "output_norm.weight")
    logits = ops.linear(x, lm_head_name(cfg))
    if cfg.final_softcap:
        logits = ops.softcap(logits, cfg.final_softcap)
    return logits
