"""``model.Blocks`` on the GPU: each block is a short, fixed sequence of kernel launches.

Matrix products by row count: up to MAX_MMV_TOKENS rows run the dequantizing matvec kernels (f32
throughout: single-sequence decode, small batches, short prompts). More rows run either the
tensor-core kernels (``mma = True``: batch decode steps, which are captured in CUDA graphs) or,
for eager prefill, cuBLAS on f16 copies of the matrices (``cuda_f16``: Q/K/V and gate/up stacked,
one product each; f16 inputs written by the kernel before, f32 accumulate and output; the
residual add is its beta = 1). ``seq`` maps the rows of the current call to KV-cache sequence
slots (< 0: a padding row that writes nothing). Every array returned is a view of the
preallocated ``Workspace``: nothing is allocated per call.
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from .cuda_f16 import F16Weights
from .cuda_weights import DeviceWeights
from .kv_cache import PagedKVCache
from .model import lm_head_name
from .model_config import ROPE_NEOX, ModelConfig
from .quant_kernels import launch_mma as LM
from .quant_kernels import launchers as L

CUDA_R_16F, CUDA_R_32F = 2, 0
ATTN_PARTS = 2048  # splits x rows budget of the attention partials
DECODE_SPLITS = 32  # rows <= MAX_MMV_TOKENS: every row the same split, so its arithmetic never depends on B
# Tensor-core batch steps (9..64 rows): the rows already fill the GPU; a split of a few keys per
# block (32 splits of a 200-token context) cost more in block overhead and merging than it saved
# (H100, 8B, B=64: 72 us per layer).
BATCH_SPLIT_BUDGET = 256
# RMSNorm fused into the matvec for hidden sizes up to this: it adds ~2 instructions per element of x
# to every row group. Latency-bound small models gain (H100, 851c281: SmolLM2 tg128 999 -> 1,166,
# Gemma-3 987 -> 1,040); the 8B's matvecs are issue-bound and lost (236 -> 197).
FUSE_NORM_MAX_COLS = 2048


def n_splits(rows: int) -> int:
    budget = BATCH_SPLIT_BUDGET if L.MAX_MMV_TOKENS < rows <= 64 else ATTN_PARTS
    return max(1, min(DECODE_SPLITS, budget // rows))


class Workspace:
    """Every activation buffer, sized at load for ``max_rows`` tokens per forward call."""

    def __init__(self, cfg: ModelConfig, max_rows: int, logits_rows: int) -> None:
        f32 = cp.float32
        self.max_rows = max_rows
        self.qkv_width = (cfg.n_head + 2 * cfg.n_head_kv) * cfg.head_dim
        self.x = cp.zeros((max_rows, cfg.n_embd), f32)
        self.h = cp.zeros((max_rows, cfg.n_embd), f32)
        self.o = cp.zeros((max_rows, cfg.n_embd), f32)
        self.qkv = cp.zeros((max_rows, self.qkv_width), f32)
        self.att = cp.zeros((max_rows, cfg.n_head * cfg.head_dim_v), f32)
        gu = cp.zeros((max_rows, 2 * cfg.n_ff), f32)  # gate | up side by side: one stacked product fills both
        self.g, self.u = gu[:, :cfg.n_ff], gu[:, cfg.n_ff:]
        self.logits = cp.zeros((logits_rows, cfg.n_vocab), f32)
        parts = max(ATTN_PARTS, max_rows) * cfg.n_head
        self.part_o = cp.zeros(parts * cfg.head_dim_v, f32)
        self.part_ml = cp.zeros(parts * 2, f32)
        self.attn_counter = cp.zeros(max_rows * cfg.n_head_kv, cp.uint32)
        self.tokens = cp.zeros(max_rows, cp.int32)
        self.pos = cp.zeros(max_rows, cp.int32)
        self.seq = cp.zeros(max_rows, cp.int32)
        # f16 inputs of the cuBLAS and tensor-core paths
        widest = max(cfg.n_embd, cfg.n_ff, cfg.n_head * cfg.head_dim_v)
        big = max_rows > L.MAX_MMV_TOKENS
        self.x16 = cp.zeros((max_rows, widest), cp.float16) if big else None  # f16 inputs of big matmuls
        self.g16 = cp.zeros((max_rows, cfg.n_ff), cp.float16) if big else None  # GLU output, f16
        # K-split tensor-core products of batch steps (<= logits_rows rows): QKV and the residual ones
        out = max(cfg.n_embd, self.qkv_width)
        self.mma_part = cp.zeros(LM.split_part_floats(out, logits_rows) if big else 1, f32)
        self.mma_counter = cp.zeros(-(-out // 16) * -(-logits_rows // 16) if big else 1, cp.uint32)
        self.split = LM.SplitScratch(self.mma_part.data.ptr, self.mma_part.size, self.mma_counter.data.ptr,
                                    self.mma_counter.size)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in vars(self).values() if isinstance(a, cp.ndarray))


class CudaBlocks:
    def __init__(self, cfg: ModelConfig, w: DeviceWeights, kv: PagedKVCache, ws: Workspace,
                 kernels: L.Kernels, inv_freq: dict[tuple[float, float], cp.ndarray]) -> None:
        self.cfg, self.w, self.kv, self.ws, self.k = cfg, w, kv, ws, kernels
        self.inv_freq = inv_freq
        self.seq = ws.seq  # row -> sequence slot, for the rows of the current call
        self.mma = False  # tensor-core kernels for > MAX_MMV_TOKENS rows (capturable) instead of cuBLAS
        self.f16: F16Weights | None = None  # made by load_f16, after the kernels are compiled
        from cupy_backends.cuda.libs import cublas  # loads libcublas: only with a GPU

        self.cublas = cublas
        self.handle = cp.cuda.device.get_cublas_handle()
        self._one = np.ones(1, np.float32)
        self._zero = np.zeros(1, np.float32)

    def load_f16(self) -> None:
        """The f16 weights of the cuBLAS prefill path (resident copies or scratch)."""
        if self.ws.max_rows > L.MAX_MMV_TOKENS and self.f16 is None:
            self.f16 = F16Weights(self.cfg, self.w, self.k)

    # ---- helpers -------------------------------------------------------------------------------
    def _small(self, rows: int) -> bool:
        return rows <= L.MAX_MMV_TOKENS

    def _gemm16(self, x16: cp.ndarray, t: int, names: tuple[str, ...], y: cp.ndarray, accumulate: bool) -> None:
        """y[:t, :N] (+)= x16[:t, :K] @ W.T, W = the matrices ``names`` stacked by rows (f16)."""
        assert self.f16 is not None
        w16, cublas = self.f16.get(names), self.cublas
        cublas.setStream(self.handle, cp.cuda.get_current_stream().ptr)
        cublas.setPointerMode(self.handle, cublas.CUBLAS_POINTER_MODE_HOST)
        beta = self._one if accumulate else self._zero
        cublas.gemmEx(self.handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, w16.rows, t, w16.cols,
                      self._one.ctypes.data, w16.ptr, CUDA_R_16F, w16.cols,
                      x16.data.ptr, CUDA_R_16F, x16.strides[0] // 2,
                      beta.ctypes.data, y.data.ptr, CUDA_R_32F, y.strides[0] // 4,
                      cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)

    def _norm(self, x: cp.ndarray, name: str, y: cp.ndarray, res: cp.ndarray | None = None,
              f16: bool = False) -> None:
        """y = rmsnorm(x) (+ res); f16: also into ws.x16 (the next tensor-core matmul's input)."""
        x16 = self.ws.x16 if f16 else None
        L.rmsnorm(self.k, x.data.ptr, x.strides[0] // 4, self.w.vec(name).data.ptr, y.data.ptr, y.strides[0] // 4,
                  x.shape[0], x.shape[1], self.cfg.rms_eps,
                  res.data.ptr if res is not None else None, res.strides[0] // 4 if res is not None else 0,
                  x16.data.ptr if x16 is not None else None, x16.strides[0] // 2 if x16 is not None else 0)

    def _big_mma(self, t: int) -> bool:
        return self.mma and not self._small(t)

    def _normed(self, x: cp.ndarray, name: str) -> tuple[cp.ndarray, tuple[int, float] | None]:
        """The input of the matrix products after RMSNorm ``name``: on the matvec path (x, the norm
        for the matvec to fuse); otherwise (ws.h, None) with ws.h (and ws.x16 on the tensor-core
        and cuBLAS paths) normalized by a norm kernel."""
        t = x.shape[0]
        if self._small(t) and x.shape[1] <= FUSE_NORM_MAX_COLS:
            return x, (self.w.vec(name).data.ptr, self.cfg.rms_eps)
        h = self.ws.h[:t]
        self._norm(x, name, h, f16=True)
        return h, None

    # ---- blocks --------------------------------------------------------------------------------
    def embed(self, tokens: cp.ndarray) -> cp.ndarray:
        t = tokens.shape[0]
        x = self.ws.x[:t]
        L.embed(self.k, self.w.mat("token_embd.weight"), tokens.data.ptr, t, x.data.ptr, x.strides[0] // 4,
                self.cfg.embed_scale)
        return x

    def attn_in(self, x: cp.ndarray, layer: int, positions: cp.ndarray) -> cp.ndarray:
        cfg, ws, p = self.cfg, self.ws, f"blk.{layer}."
        t = x.shape[0]
        qkv = ws.qkv[:t]
        h, norm = self._normed(x, p + "attn_norm.weight")
        hq, hk, d = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim, cfg.head_dim
        names = [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]
        cols = [0, hq, hq + hk]
        biases = [p + "attn_q.bias", p + "attn_k.bias", p + "attn_v.bias"] if cfg.attn_bias else [None] * 3
        ld = qkv.strides[0] // 4
        kc, vc = self.kv.layer(layer)
        qn = self.w.vec(p + "attn_q_norm.weight").data.ptr if cfg.qk_norm else None
        kn = self.w.vec(p + "attn_k_norm.weight").data.ptr if cfg.qk_norm else None
        rope = L.RopeKV(qkv.data.ptr, ld, cfg.n_head, cfg.n_head_kv, d, cfg.head_dim_v, cfg.rope.n_dims,
                        cfg.rope.style == ROPE_NEOX, qn, kn, cfg.rms_eps, self.inv_freq[cfg.rope_key(layer)].data.ptr,
                        positions.data.ptr, self.seq.data.ptr, self.kv.table.data.ptr, self.kv.max_pages,
                        self.kv.page_size, kc, vc)
        if self._small(t):  # RoPE + KV write in the matvec's epilogue where it can (else a rope_kv launch)
            L.mmv(self.k, [self.w.mat(n) for n in names], [(qkv.data.ptr + 4 * c, ld) for c in cols],
                  [self.w.vec(b).data.ptr if b else None for b in biases], h.data.ptr, h.strides[0] // 4, t, 0,
                  norm=norm, rope=rope)
            return qkv
        if self.mma:
            LM.mma(self.k, [self.w.mat(n) for n in names], [(qkv.data.ptr + 4 * c, ld) for c in cols],
                  [self.w.vec(b).data.ptr if b else None for b in biases], ws.x16.data.ptr, ws.x16.strides[0] // 2,
                  t, 0, ws.split)
        else:
            self._gemm16(ws.x16, t, tuple(names), qkv, accumulate=False)
            for n, c, b in zip(names, cols, biases):
                if b:
                    L.add_bias(self.k, qkv.data.ptr + 4 * c, ld, self.w.vec(b).data.ptr, self.w.mat(n).rows, t)
        rope.launch(self.k, 0, t)
        return qkv

    def attend(self, layer: int, q: cp.ndarray, positions: cp.ndarray) -> cp.ndarray:
        cfg, ws = self.cfg, self.ws
        t = q.shape[0]
        out = ws.att[:t]
        kc, vc = self.kv.layer(layer)
        L.attention(self.k, q.data.ptr, q.strides[0] // 4, t, kc, vc, positions.data.ptr, self.seq.data.ptr,
                    self.kv.table.data.ptr, self.kv.max_pages, self.kv.page_size, cfg.n_head, cfg.n_head_kv,
                    cfg.head_dim, cfg.attn_scale, cfg.attn_softcap or 0.0, cfg.layer_window[layer], n_splits(t),
                    ws.part_o.data.ptr, ws.part_ml.data.ptr, ws.attn_counter.data.ptr, out.data.ptr,
                    out.strides[0] // 4, None if self._small(t) else ws.x16.data.ptr,
                    0 if self._small(t) else ws.x16.strides[0] // 2)
        return out

    def _project_residual(self, a: cp.ndarray, name: str, x: cp.ndarray, post_norm: str | None,
                          a16: cp.ndarray | None = None) -> cp.ndarray:
        """x += post_norm(W a) (no norm: straight into x). a16: a's f16 copy (over MAX_MMV_TOKENS rows)."""
        t = a.shape[0]
        target = self.ws.o[:t] if post_norm else x
        if self._small(t):
            L.mmv(self.k, [self.w.mat(name)], [(target.data.ptr, target.strides[0] // 4)], [None], a.data.ptr,
                  a.strides[0] // 4, t, 0 if post_norm else 1)
        elif self.mma:
            LM.mma(self.k, [self.w.mat(name)], [(target.data.ptr, target.strides[0] // 4)], [None], a16.data.ptr,
                  a16.strides[0] // 2, t, 0 if post_norm else 1, self.ws.split)
        else:
            self._gemm16(a16, t, (name,), target, accumulate=not post_norm)
        if post_norm:
            self._norm(target, post_norm, x, res=x)
        return x

    def attn_out(self, x: cp.ndarray, a: cp.ndarray, layer: int) -> cp.ndarray:
        p = f"blk.{layer}."
        return self._project_residual(a, p + "attn_output.weight", x,
                                      p + "post_attention_norm.weight" if self.cfg.post_norms else None,
                                      a16=None if self._small(a.shape[0]) else self.ws.x16)

    def ffn(self, x: cp.ndarray, layer: int) -> cp.ndarray:
        cfg, ws, p = self.cfg, self.ws, f"blk.{layer}."
        t = x.shape[0]
        g = ws.g[:t]
        gate_name, up_name = p + "ffn_gate.weight", p + "ffn_up.weight"
        gate, up = self.w.mat(gate_name), self.w.mat(up_name)
        post = p + "post_ffw_norm.weight" if cfg.post_norms else None
        big = self._big_mma(t)
        h, norm = self._normed(x, p + "ffn_norm.weight")
        down = p + "ffn_down.weight"
        if self._small(t) and gate.type_id == up.type_id:
            L.mmv_glu(self.k, gate, up, h.data.ptr, h.strides[0] // 4, t, cfg.activation, g.data.ptr, g.strides[0] // 4,
                      norm=norm)
            return self._project_residual(g, down, x, post)
        if big and gate.type_id == up.type_id:
            g16 = ws.g16
            LM.mma_glu(self.k, gate, up, ws.x16.data.ptr, ws.x16.strides[0] // 2, t, cfg.activation, g16.data.ptr,
                      g16.strides[0] // 2, ws.split)
            return self._project_residual(g, down, x, post, a16=g16)
        if self._small(t) or big:
            u = ws.u[:t]
            if big:
                x16, ld16 = ws.x16.data.ptr, ws.x16.strides[0] // 2
                LM.mma(self.k, [gate], [(g.data.ptr, g.strides[0] // 4)], [None], x16, ld16, t, 0, ws.split)
                LM.mma(self.k, [up], [(u.data.ptr, u.strides[0] // 4)], [None], x16, ld16, t, 0, ws.split)
            else:
                L.mmv(self.k, [gate], [(g.data.ptr, g.strides[0] // 4)], [None], h.data.ptr, h.strides[0] // 4, t, 0,
                      norm=norm)
                L.mmv(self.k, [up], [(u.data.ptr, u.strides[0] // 4)], [None], h.data.ptr, h.strides[0] // 4, t, 0,
                      norm=norm)
            g16 = ws.g16 if big else None
            L.glu(self.k, g.data.ptr, u.data.ptr, g.strides[0] // 4, cfg.n_ff, t, cfg.activation, g.data.ptr,
                  g.strides[0] // 4, g16.data.ptr if big else None, g16.strides[0] // 2 if big else 0)
            return self._project_residual(g, down, x, post, a16=g16)
        u = ws.u[:t]
        self._gemm16(ws.x16, t, (gate_name, up_name), g, accumulate=False)  # g | u: adjacent halves
        L.glu(self.k, g.data.ptr, u.data.ptr, g.strides[0] // 4, cfg.n_ff, t, cfg.activation, None, 0,
              ws.x16.data.ptr, ws.x16.strides[0] // 2)
        return self._project_residual(g, down, x, post, a16=ws.x16)

    def logits(self, x: cp.ndarray) -> cp.ndarray:
        cfg, ws = self.cfg, self.ws
        t = x.shape[0]
        if t > ws.logits.shape[0]:
            raise ValueError(f"logits for {t} rows requested; the workspace holds {ws.logits.shape[0]}")
        head = self.w.mat(lm_head_name(cfg))
        out = ws.logits[:t]
        ld = out.strides[0] // 4
        h, norm = self._normed(x, "output_norm.weight")
        if self._big_mma(t):
            LM.mma(self.k, [head], [(out.data.ptr, ld)], [None], self.ws.x16.data.ptr, self.ws.x16.strides[0] // 2,
                  t, 0, self.ws.split)
        else:
            for s in range(0, t, L.MAX_MMV_TOKENS):
                n = min(L.MAX_MMV_TOKENS, t - s)
                L.mmv(self.k, [head], [(out[s:].data.ptr, ld)], [None], h[s:].data.ptr, h.strides[0] // 4, n, 0,
                      norm=norm)
        if cfg.final_softcap:
            L.softcap(self.k, out.data.ptr, ld, cfg.n_vocab, t, cfg.final_softcap)
        return out
