"""The CUDA backend's preallocated activation buffers (``Workspace``: every array a forward call
uses, sized at load for the largest call), and the choices that size them: int8 activations
(``use_q8``) and the attention kernel's block shape and key splits.
"""

from __future__ import annotations

import os

import cupy as cp

from .model_config import ModelConfig
from .quant_kernels import launch_attention as LA
from .quant_kernels import launch_mma as LM
from .quant_kernels import launchers as L

ATTN_PARTS = 2048  # splits x rows budget of the attention partials
DECODE_SPLITS = 32  # rows <= MAX_MMV_TOKENS: every row the same split, so its arithmetic never depends on B
# Tensor-core batch steps (9..64 rows): the rows already fill the GPU; a split of a few keys per
# block (32 splits of a 200-token context) cost more in block overhead and merging than it saved
# (H100, 8B, B=64: 72 us per layer).
BATCH_SPLIT_BUDGET = 256


def use_q8(cfg: ModelConfig) -> bool:
    """Int8 activations and dp4a matvecs (matvec_block.cuh) for the matrices with integer weights:
    faster than the f32 matvecs on every reference model (H100 tg128, bench/RESULTS.md: the 8B
    254 -> 431, SmolLM2 1,798 -> 2,231, Gemma-3 1,530 -> 1,581). GGUF_RUN_Q8=0 keeps f32."""
    return os.environ.get("GGUF_RUN_Q8", "1") != "0"


def attn_shape(cfg: ModelConfig, rows: int) -> LA.AttnShape:
    """The attention kernel's block shape (launch_attention.attn_shape). Up to MAX_MMV_TOKENS rows
    (latency: decode steps, short prompts) the widest block, one round per split (GGUF_RUN_ATTN_WARPS
    and GGUF_RUN_ATTN_ROUNDS override it, to measure); more rows (throughput: prefill, batch steps)
    blocks of 4 warps, one round per split (GGUF_RUN_ATTN_BIG="W,R" or "W:R" overrides it)."""
    env = os.environ.get
    g = cfg.n_head // cfg.n_head_kv
    if rows > L.MAX_MMV_TOKENS:
        w, r = env("GGUF_RUN_ATTN_BIG", "4,1").replace(":", ",").split(",")
        return LA.attn_shape(cfg.head_dim, g, int(w), int(r))
    return LA.attn_shape(cfg.head_dim, g, int(env("GGUF_RUN_ATTN_WARPS", "0")),
                         int(env("GGUF_RUN_ATTN_ROUNDS", "1")))


def n_splits(rows: int, mmv_rows: int = L.MAX_MMV_TOKENS) -> int:
    """Attention splits per row: calls of more than mmv_rows rows (the tensor-core path) share
    BATCH_SPLIT_BUDGET."""
    budget = BATCH_SPLIT_BUDGET if mmv_rows < rows <= 64 else ATTN_PARTS
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
        # int8 activations of the matvecs (use_q8): q8_norm holds the inputs after a norm (QKV, GLU,
        # lm_head), q8_plain the others (attention and GLU outputs): a residual matvec reads the one
        # and its epilogue writes the other
        self.q8_norm = self.q8_plain = None
        if use_q8(cfg):
            self.xq = cp.zeros((2, L.MAX_MMV_TOKENS, widest), cp.int8)
            self.xs = cp.zeros((2, L.MAX_MMV_TOKENS, widest // 16, 4), f32)
            self.q8_norm, self.q8_plain = (L.Q8Vec(self.xq[i].data.ptr, widest, self.xs[i].data.ptr, widest // 16)
                                           for i in range(2))
        self.mma_part = cp.zeros(LM.split_part_floats(out, logits_rows) if big else 1, f32)
        self.mma_counter = cp.zeros(-(-out // 16) * -(-logits_rows // 16) if big else 1, cp.uint32)
        self.split = LM.SplitScratch(self.mma_part.data.ptr, self.mma_part.size, self.mma_counter.data.ptr,
                                    self.mma_counter.size)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in vars(self).values() if isinstance(a, cp.ndarray))
