"""The CUDA backend's preallocated activation buffers (``Workspace``: every array a forward call
uses, sized at load for the largest call), and the attention kernel's block shape and key splits
as the tuning table sets them.
"""

from __future__ import annotations

import cupy as cp

from ...format.model_config import ModelConfig
from ...quant_kernels import launch_attention as LA
from ...quant_kernels import launch_mma as LM
from ...quant_kernels import launch_moe as LE
from ...quant_kernels import launchers as L
from .tuning import Tuning


def attn_shape(cfg: ModelConfig, warps_rounds: tuple[int, int]) -> LA.AttnShape:
    """The attention kernel's block shape (launch_attention.attn_shape) for (warps, rounds): the
    tuning table's attn_small for calls of up to MAX_MMV_TOKENS rows, attn_big above."""
    return LA.attn_shape(cfg.head_dim, cfg.n_head // cfg.n_head_kv, *warps_rounds)


def n_splits(tune: Tuning, rows: int, mmv_rows: int = L.MAX_MMV_TOKENS) -> int:
    """Attention splits per row: calls of more than mmv_rows rows (the tensor-core path) share
    tune.batch_split_budget, the others tune.attn_parts, at most tune.decode_splits each."""
    budget = tune.batch_split_budget if mmv_rows < rows <= 64 else tune.attn_parts
    return max(1, min(tune.decode_splits, budget // rows))


class Workspace:
    """Every activation buffer, sized at load for ``max_rows`` tokens per forward call."""

    def __init__(self, cfg: ModelConfig, max_rows: int, logits_rows: int, tune: Tuning) -> None:
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
        if cfg.n_expert:  # the router's logits, each token's chosen experts and weights, their GLU outputs
            used = cfg.n_expert_used
            slots = max_rows * used
            self.moe_logits = cp.zeros((max_rows, cfg.n_expert), f32)
            self.moe_ids = cp.zeros((max_rows, used), cp.int32)
            self.moe_w = cp.zeros((max_rows, used), f32)
            self.moe_count = cp.zeros(LE.ROUTER_TILE, cp.uint32)  # the fused router: blocks done a token
            gu = cp.zeros((slots, 2 * cfg.n_ff_exp), f32)
            self.moe_g, self.moe_u = gu[:, :cfg.n_ff_exp], gu[:, cfg.n_ff_exp:]
            # grouped by expert (past the matvec rows): slot order, tiles, h's rows gathered in that order
            # (f16), the GLU's f16 outputs (in gu's memory), the products in slot order
            self.moe_pos = cp.zeros(slots, cp.int32)
            self.moe_order = cp.zeros(slots, cp.int32)
            self.moe_tiles = cp.zeros((LE.max_tiles(slots, cfg.n_expert), 4), cp.int32)
            self.moe_xs16 = cp.zeros((slots, cfg.n_embd), cp.float16)
            self.moe_g16 = gu.view(cp.float16)[:, :cfg.n_ff_exp]
            self.moe_ys = cp.zeros((slots, cfg.n_embd), f32)
            # with expert biases (gpt-oss) the GLU runs apart from its products: its f16 outputs in expert order
            self.moe_g16b = cp.zeros((slots, cfg.n_ff_exp), cp.float16) if cfg.expert_bias else None
            # the GLU's outputs as int8 (the down matvec's input on the matvec path; rests as q8_norm's)
            self.moe_gq = None
            if tune.q8 and cfg.n_ff_exp % 16 == 0:
                rows, n, res = L.MAX_MMV_TOKENS * used, cfg.n_ff_exp, cfg.n_ff_exp if tune.q8_res else 0
                self._moe_gq = cp.zeros((rows, n + res), cp.int8)
                self._moe_gs = cp.zeros((rows, n // 16, 4), f32)
                self.moe_gq = L.Q8Vec(self._moe_gq.data.ptr, n + res, self._moe_gs.data.ptr, n // 16, res=res)
            if cfg.n_ff_shexp:  # the shared expert (Qwen2-MoE): its GLU's outputs (f32, f16), its products
                s = cfg.n_ff_shexp
                gu = cp.zeros((max_rows, 2 * s), f32)
                self.shexp_g, self.shexp_u = gu[:, :s], gu[:, s:]
                self.shexp_g16 = cp.zeros((max_rows, s), cp.float16)
                self.shexp_y = cp.zeros((max_rows, cfg.n_embd), f32)
                self.rows_in_order = cp.arange(max_rows, dtype=cp.int32)  # (h's rows gathered as they are)
        parts = max(tune.attn_parts, max_rows) * cfg.n_head
        self.part_o = cp.zeros(parts * cfg.head_dim_v, f32)
        self.part_ml = cp.zeros(parts * 2, f32)
        self.attn_counter = cp.zeros(max_rows * cfg.n_head_kv, cp.uint32)
        self.tokens = cp.zeros(max_rows, cp.int32)
        self.pos = cp.zeros(max_rows, cp.int32)
        self.seq = cp.zeros(max_rows, cp.int32)
        # f16 inputs of the cuBLAS and tensor-core paths
        widest = max(cfg.n_embd, cfg.n_ff, cfg.n_ff_shexp, cfg.n_head * cfg.head_dim_v)
        big = max_rows > L.MAX_MMV_TOKENS
        self.x16 = cp.zeros((max_rows, widest), cp.float16) if big else None  # f16 inputs of big matmuls
        self.g16 = cp.zeros((max_rows, cfg.n_ff), cp.float16) if big else None  # GLU output, f16
        # K-split tensor-core products of batch steps (<= logits_rows rows): QKV and the residual ones
        out = max(cfg.n_embd, self.qkv_width)
        # int8 activations of the matvecs (tune.q8): q8_norm holds the inputs after a norm (QKV, GLU,
        # lm_head), q8_plain the others (attention and GLU outputs): a residual matvec reads the one
        # and its epilogue writes the other
        self.q8_norm = self.q8_plain = None
        # and each row's second half the rests' int8 where some role takes them (tune.q8_res: Blocks
        # hands a role without rests the same buffer with res 0)
        if tune.q8:
            res = widest if tune.q8_res else 0
            self.xq = cp.zeros((2, L.MAX_MMV_TOKENS, widest + res), cp.int8)
            self.xs = cp.zeros((2, L.MAX_MMV_TOKENS, widest // 16, 4), f32)
            self.q8_norm, self.q8_plain = (L.Q8Vec(self.xq[i].data.ptr, widest + res, self.xs[i].data.ptr,
                                                   widest // 16, res=res) for i in range(2))
        part = LM.split_part_floats(out, logits_rows, tune.mma_max_split)
        if tune.glu_split > 1:  # the GLU's partials: gate's and up's rows
            part = max(part, LM.split_part_floats(2 * cfg.n_ff, logits_rows, tune.glu_split))
        self.mma_part = cp.zeros(part if big else 1, f32)
        self.mma_counter = cp.zeros(-(-out // 16) * -(-logits_rows // 16) if big else 1, cp.uint32)
        self.split = LM.SplitScratch(self.mma_part.data.ptr, self.mma_part.size, self.mma_counter.data.ptr,
                                    self.mma_counter.size)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in vars(self).values() if isinstance(a, cp.ndarray))
