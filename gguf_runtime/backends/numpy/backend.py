"""The numpy reference backend: runs anywhere, and is the oracle for the CUDA backend.

Weights are dequantized to float32 with the formats' numpy code (cached while they fit a memory
budget, otherwise dequantized at each use); the KV cache is a float32 array per layer.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from ..host_loop import host_sample_loop
from ...errors import BackendError, ContextOverflowError
from ...format.gguf_file import GGUFFile
from ...model import ComposedBlocks, forward, layers, lm_head_name, rope_inv_freq
from ...format.model_config import ROPE_NEOX, ModelConfig, model_tensors
from ...quant_kernels import reference_kv
from ...quant_kernels.reference import dequantize, dequantize_rows

DEFAULT_WEIGHT_BUDGET = 8 << 30  # bytes of float32 weights kept dequantized


def _physical_memory() -> float:
    """Bytes of RAM (inf where the platform does not say): a cache larger than that cannot work,
    whatever the allocator's overcommit promises."""
    try:
        return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return float("inf")


def apply_rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, style: str,
               mscale: float = 1.0) -> np.ndarray:
    """Rotate the first 2*len(inv_freq) dims of x [T, H, D] by angle pos * inv_freq (cos and sin times
    mscale: LongRoPE's attention factor)."""
    half = inv_freq.shape[0]
    ang = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # [T, half]
    cos = (np.cos(ang) * mscale).astype(np.float32)[:, None, :]
    sin = (np.sin(ang) * mscale).astype(np.float32)[:, None, :]
    out = x.copy()
    if style == ROPE_NEOX:
        a, b = x[..., :half], x[..., half:2 * half]
        out[..., :half] = a * cos - b * sin
        out[..., half:2 * half] = a * sin + b * cos
    else:
        a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        out[..., 0:2 * half:2] = a * cos - b * sin
        out[..., 1:2 * half:2] = a * sin + b * cos
    return out


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.float32(0.7978845608028654) * (x + np.float32(0.044715) * x * x * x)))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _quiet() -> np.errstate:
    """A damaged file's overflows and NaNs are reported once, by the logits' finiteness check
    (host_loop), not as numpy warnings on stderr beside that one line."""
    return np.errstate(over="ignore", invalid="ignore", divide="ignore")


class NumpyBackend:
    """``model.Primitives`` in numpy, run through ``ComposedBlocks``; one sequence."""

    name = "numpy"

    def __init__(self, gguf: GGUFFile, cfg: ModelConfig, n_ctx: int,
                 weight_budget: int = DEFAULT_WEIGHT_BUDGET, kv_types: tuple[str, str] = ("f32", "f32"),
                 comm=None) -> None:
        self.f, self.cfg, self.n_ctx = gguf, cfg, n_ctx
        # the cache's element types (keys, values): stored values round as reference_kv says
        try:
            self.kv_types = (reference_kv.check(kv_types[0], cfg.head_dim),
                             reference_kv.check(kv_types[1], cfg.head_dim_v))
        except ValueError as e:
            raise BackendError(str(e)) from None
        self._weights: dict[str, np.ndarray] = {}
        self._budget = weight_budget
        factors = cfg.rope.factors_for(n_ctx)
        ff = self.weight(factors) if factors else None
        self._inv_freq = {}
        for key in {cfg.rope_key(i) for i in range(cfg.n_layer)}:
            self._inv_freq[key] = rope_inv_freq(cfg, *key, ff)
        need = 4 * cfg.n_layer * n_ctx * cfg.n_head_kv * (cfg.head_dim + cfg.head_dim_v)
        try:
            if need > _physical_memory():
                raise MemoryError
            self.k_cache = np.zeros((cfg.n_layer, n_ctx, cfg.n_head_kv, cfg.head_dim), np.float32)
            self.v_cache = np.zeros((cfg.n_layer, n_ctx, cfg.n_head_kv, cfg.head_dim_v), np.float32)
        except MemoryError:
            raise BackendError(f"a context of {n_ctx:,} tokens needs {need / 2**30:.1f} GiB of KV cache, more than "
                               "this machine can give; lower --ctx-size") from None
        self.n_past = 0
        self.blocks = ComposedBlocks(self, cfg, comm)  # comm: one rank of a split model (tests)

    # ---- weights ----------------------------------------------------------------------------
    def weight(self, name: str) -> np.ndarray:
        w = self._weights.get(name)
        if w is None:
            t = self.f.tensors[name]
            w = dequantize(self.f.raw(name), t.type_id, t.shape)
            if w.nbytes <= self._budget:
                self._budget -= w.nbytes
                self._weights[name] = w
        return w

    def preload(self, progress=None) -> None:
        """Dequantize every weight the model uses now (within the budget) instead of at first use;
        tensors of the file the model does not name are left alone (never read)."""
        used = model_tensors(self.cfg)
        names = [n for n in self.f.tensors if n in used]
        for i, name in enumerate(names):
            if name != "token_embd.weight" or lm_head_name(self.cfg) == name:
                self.weight(name)
            if progress:
                progress(i + 1, len(names))

    # ---- ops ---------------------------------------------------------------------------------
    def embed(self, tokens: Sequence[int]) -> np.ndarray:
        t = self.f.tensors["token_embd.weight"]
        ids = np.asarray(tokens, dtype=np.int64)
        if "token_embd.weight" in self._weights:
            x = self._weights["token_embd.weight"][ids]
        else:
            x = dequantize_rows(self.f.raw(t.name), t.type_id, t.ne[0], ids)
        if self.cfg.embed_scale != 1.0:
            x = x * np.float32(self.cfg.embed_scale)
        return x.astype(np.float32, copy=False)

    def rms_norm(self, x: np.ndarray, weight: str) -> np.ndarray:
        ms = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True)
        return (x / np.sqrt(ms + np.float32(self.cfg.rms_eps))) * self.weight(weight)

    def linear(self, x: np.ndarray, weight: str, bias: str | None = None) -> np.ndarray:
        y = x @ self.weight(weight).T
        return y + self.weight(bias) if bias else y

    def expert_linear(self, x: np.ndarray, weight: str, expert: int) -> np.ndarray:
        return x @ self.expert(weight, expert).T

    def expert_bias(self, name: str, expert: int) -> np.ndarray:
        return self.weight(name)[expert]

    def expert(self, name: str, e: int) -> np.ndarray:
        """Expert e's matrix of a stacked [experts, rows, columns] tensor: the whole tensor where the
        budget keeps it, else only e's rows dequantized (a 30B MoE's experts exceed any budget)."""
        w = self._weights.get(name)
        if w is not None:
            return w[e]
        t = self.f.tensors[name]
        n_exp, rows, cols = t.shape
        if 4 * n_exp * rows * cols <= self._budget:
            return self.weight(name)[e]
        return dequantize_rows(self.f.raw(name), t.type_id, cols, np.arange(e * rows, (e + 1) * rows))

    def rope(self, x: np.ndarray, positions: np.ndarray, layer: int) -> np.ndarray:
        return apply_rope(x, positions, self._inv_freq[self.cfg.rope_key(layer)], self.cfg.rope.style,
                          self.cfg.rope.attn_factor)

    def store_kv(self, layer: int, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> None:
        self.k_cache[layer, positions] = reference_kv.roundtrip(k, self.kv_types[0])
        self.v_cache[layer, positions] = reference_kv.roundtrip(v, self.kv_types[1])

    def attention(self, layer: int, q: np.ndarray, positions: np.ndarray) -> np.ndarray:
        cfg = self.cfg
        n_kv = int(positions.max()) + 1
        keys = self.k_cache[layer, :n_kv]  # [S, Hkv, D]
        vals = self.v_cache[layer, :n_kv]
        t = q.shape[0]
        qg = q.reshape(t, cfg.n_head_kv, cfg.n_gqa, cfg.head_dim)
        s = np.einsum("thgd,shd->hgts", qg, keys) * np.float32(cfg.attn_scale)  # [Hkv, G, T, S]
        if cfg.attn_softcap:
            s = np.float32(cfg.attn_softcap) * np.tanh(s / np.float32(cfg.attn_softcap))
        s = np.where(self.attention_mask(layer, positions, n_kv)[None, None], np.float32(-np.inf), s)
        if cfg.attn_sinks:  # gpt-oss: each head's sink logit joins the denominator (no value)
            sink = self.weight(f"blk.{layer}.attn_sinks.weight").reshape(cfg.n_head_kv, cfg.n_gqa, 1, 1)
            m = np.maximum(s.max(axis=-1, keepdims=True), sink)
            p = np.exp(s - m)
            p /= p.sum(axis=-1, keepdims=True) + np.exp(sink - m)
        else:
            s = s - s.max(axis=-1, keepdims=True)
            p = np.exp(s)
            p /= p.sum(axis=-1, keepdims=True)
        out = np.einsum("hgts,shd->thgd", p, vals)
        return out.astype(np.float32, copy=False).reshape(t, cfg.n_head, cfg.head_dim_v)

    def attention_mask(self, layer: int, positions: np.ndarray, n_kv: int) -> np.ndarray:
        """[T, S]: True where query row t must not see key s (a later key, or one outside the
        layer's sliding window)."""
        dist = positions[:, None] - np.arange(n_kv)[None, :]
        mask = dist < 0
        if self.cfg.layer_window[layer]:
            mask |= dist >= self.cfg.layer_window[layer]
        return mask

    def glu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        cfg = self.cfg
        if cfg.activation == "swiglu_oai":  # gpt-oss: clamped, sigmoid(alpha x), up + 1
            lim = np.float32(cfg.glu_limit)
            g = np.minimum(gate, lim)
            return g / (1 + np.exp(-np.float32(cfg.glu_alpha) * g)) * (np.clip(up, -lim, lim) + np.float32(1))
        act = gelu_tanh(gate) if cfg.activation == "gelu_tanh" else silu(gate)
        return act * up

    def softcap(self, x: np.ndarray, cap: float) -> np.ndarray:
        return np.float32(cap) * np.tanh(x / np.float32(cap))

    # ---- sequence ----------------------------------------------------------------------------
    def truncate(self, n: int) -> None:
        """Forget cached positions >= n (a chat rolling back, or dropping a reply)."""
        self.n_past = min(self.n_past, n)

    def eval(self, tokens: Sequence[int], all_logits: bool = False, chunk: int = 256) -> np.ndarray:
        """Append tokens to the sequence; returns logits of the last (or every) token."""
        if self.n_past + len(tokens) > self.n_ctx:
            raise ContextOverflowError(
                f"{self.n_past + len(tokens)} tokens do not fit the context of {self.n_ctx}; "
                "raise --ctx-size or shorten the input")
        outs = []
        for s in range(0, len(tokens), chunk):
            part = list(tokens[s:s + chunk])
            pos = np.arange(self.n_past, self.n_past + len(part))
            last = s + chunk >= len(tokens)
            with _quiet():
                logits = forward(self.blocks, self.cfg, part, pos, all_logits=all_logits)
            if all_logits or last:
                outs.append(logits)
            self.n_past += len(part)
        self.last_logits = outs[-1][-1]
        return np.concatenate(outs, axis=0).astype(np.float32, copy=False)

    def prefill(self, tokens: Sequence[int]) -> None:
        self.eval(tokens)

    def hidden(self, tokens: Sequence[int], chunk: int = 256) -> np.ndarray:
        """The final hidden states (after the output RMSNorm) of ``tokens`` as a sequence of their
        own at positions 0, 1, ...: [T, n_embd] float32 (embeddings). A cache of T positions is made
        for the call; the sequence in the backend's own cache (and n_past) is left as it was."""
        n = len(tokens)
        if not n:
            raise ValueError("no tokens to evaluate")
        if n > self.n_ctx:
            raise ContextOverflowError(f"{n} tokens do not fit the context of {self.n_ctx}; raise --ctx-size or "
                                       "shorten the input")
        cfg, saved = self.cfg, (self.k_cache, self.v_cache)
        try:
            self.k_cache = np.zeros((cfg.n_layer, n, cfg.n_head_kv, cfg.head_dim), np.float32)
            self.v_cache = np.zeros((cfg.n_layer, n, cfg.n_head_kv, cfg.head_dim_v), np.float32)
            outs = []
            for s in range(0, n, chunk):
                part = list(tokens[s:s + chunk])
                x = layers(self.blocks, cfg, part, np.arange(s, s + len(part)))
                outs.append(self.blocks.final_norm(x))
        finally:
            self.k_cache, self.v_cache = saved
        return np.concatenate(outs, axis=0).astype(np.float32, copy=False)

    def sample_loop(self, n: int, params, history: list[int], stop: frozenset[int], constraint=None,
                    on_token=None):
        return host_sample_loop(self, n, params, history, stop, constraint=constraint, on_token=on_token)
