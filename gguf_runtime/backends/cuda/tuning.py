"""The CUDA backend's tuning table: every measured choice, in one frozen object chosen at load.

``choose(cfg, weight_bytes, overrides)`` picks the values for a model (by its size) on this GPU and
the backend passes the object down (blocks, workspace, KV cache, prefill, and the kernel launchers
through ``KernelKnobs``). Each field says in one line why it has its value; the measurements
behind them are in bench/RESULTS.md. Nothing else in the product reads the environment: the one
override, for measuring, is ``GGUF_RUN_TUNE="field=value;field=value"`` (``help()`` lists the
fields and their values' spelling), read here at load.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Mapping

from ...errors import BackendError
from ...quant_kernels.formats import FORMATS
from ...quant_kernels.knobs import ATTN_MAX_SPLITS, KernelKnobs
from ...quant_kernels.kv_layout import KV_TYPES

ENV = "GGUF_RUN_TUNE"
MMV_ROLES = ("QKV", "O", "DOWN", "GLU", "HEAD")
ROLE_SETS = ("qkv", "o", "glu", "down", "head")  # the matvecs of kstage and q8_res
# Rests for the int8 inputs of these roles, by architecture: Gemma-3's activations have outlier
# channels, and its decode-path perplexity was +0.2% over float32 with int8 inputs alone (real
# 270M file); rests into QKV and the GLU bring it under +0.1% at -0.6% tg128 (every role: -3%;
# SmolLM2 and the 8B lose 3% and 7.5% for QKV + GLU: off there). bench/RESULTS.md rows 105-106.
Q8_RES_BY_ARCH = {"gemma3": frozenset({"qkv", "glu"})}
BIG_MODEL_BYTES = 1 << 30  # "big": the 8B (4.6 GiB) and up; the 135M-270M models are under it
KV16_MAX_HEAD_DIM = 128  # small models' f16 KV cache up to this head size (Gemma-3's 256 keeps f32: faster)


@dataclass(frozen=True)
class Tuning:
    # -- prefill
    prefill_chunk: int = 2048  # rows per prefill call (the workspace's height): weights dequantized once per 2048 rows
    prefill_quantum: int = 64  # chunks pad to multiples of this: few graph sizes, mma-friendly rows
    prefill_graph: bool = True  # chunks (and packed prompts) replay as graphs from a size's second run (small models' prefill is host-bound)
    f16_resident_max_bytes: int = 1 << 30  # f16 prefill copies kept up to this; above, dequantized per group
    # (each cuBLAS product of a model whose f16 copies are not resident dequantizes all its weights
    # first, whatever the chunk's rows: bench/RESULTS.md rows 153 and 156)
    prefill_mma_rows: int = 64  # ... so chunks up to this many rows take the batch steps' tensor-core products; 0: off
    # -- the matvec path (decode, short prompts)
    q8: bool = True  # int8 activations + dp4a for integer weights: faster on every reference model
    decode_mmv_rows: int = 8  # decode rows on the matvecs; big models 2 (tensor cores win from 4 rows)
    fuse_norm_max_cols: int = 2048  # RMSNorm fused into f32 matvecs up to this width (the 8B's lose)
    post_q8: bool = True  # a post-norm's kernel writes the next pre-norm's int8 input (one launch less)
    q8_res: frozenset[str] = frozenset()  # roles whose int8 input carries its rests (~15 bits; Q8_RES_BY_ARCH)
    kstage: frozenset[str] = frozenset({"qkv", "o", "glu", "down"})  # K-quant scales staged (the head lost)
    head_mma_rows: int = 0  # decode steps of this many rows or more (not verification's) take the output
    # head on the tensor cores (f16 input; 8-token matvecs of a vocabulary's rows are dp4a-bound); small models 4
    mmv: tuple[tuple[str, tuple[int, int]], ...] = ()  # (role[_TYPE], (R, WG)) over mmv_config: measuring
    mmv_token_grid: int = 0  # matvecs of 2..this many rows as one-token products side by side (one
    # launch, launchers.token_grid); small models 8: their steps of several rows are latency-bound
    mmv_grid_waves: tuple[int, int] = (1, 2)  # waves of warps (32 a SM) a token grid may take, under 8
    # tokens : of 8 (past them the compiled-count kernels; 8 tokens' kernels are the slowest of those)
    mmv_grid_groups: bool = True  # ... and where one-token blocks do not fit, blocks of 2 or 4 tokens side by side
    # (launchers.token_groups: faster steps of 4 and 8 rows on both small models, bench/RESULTS.md)
    mmv_grid_tokens: int = 0  # measuring: token grids of blocks of this many tokens wherever it divides the count
    mmv_wide_rows: str = "verify"  # matvecs of several tokens with wider row groups, each row's sums still one
    # token's (launchers.mmv_config): in speculative verification ("verify"), every step ("all") or none ("off");
    # SmolLM2's and Gemma-3's verifications gained, their batch steps split both ways (bench/RESULTS.md)
    # -- mixtures of experts
    moe_norm_epilogue: int = 1  # MoE decode steps of at most this many rows: O's epilogue writes the experts' int8
    # input (no FFN norm kernel; 0: never): one row gained, eight lost (bench/RESULTS.md 195, 270)
    moe_down_epilogue: int = 1  # ... and the experts' down writes the next layer's QKV (or the head's) int8 input at
    # steps of at most this many rows (16 rows a block as two row groups of warps; no attention norm kernel; 0:
    # never): one row gained (bench/RESULTS.md 273; 16 rows a block by more registers a warp lost, 271)
    moe_topk_glu_blocks: int = 3  # the experts' GLU kernel does the router's top-k (no moe_topk launch) where its
    # blocks, each repeating it, fit this many an SM (one wave; 0: never): Qwen3-30B-A3B at one row gains,
    # gpt-oss (two waves) and eight rows lose (bench/RESULTS.md 259, 261)
    moe_router_topk: bool = False  # steps of up to 8 rows: the router and its top-k in one launch (moe.cu); off: measured (RESULTS 195)
    moe_mma_slots: int = 0  # slots a tensor-core tile of one expert (8..64); 0: launch_moe.mma_tile_slots's rule
    moe_down_q8: bool = True  # the down matvec's input (the GLU's outputs) as int8 on the matvec path (row 111)
    moe_rows: tuple[int, int] = (8, 4)  # the matvec path's rows a warp: GLU (gate and up, even; 8: 16 a block,
    # so its q8 epilogue writes down's input), down (the fastest pair measured: bench/RESULTS.md rows 111-112)
    moe_down_sub: bool = True  # the down of rows of at most 16 units (Qwen3-30B-A3B's Q6_K, 768 columns) in two
    # 16-lane row sets a warp: half the blocks, fewer idle lanes (bench/RESULTS.md 265)
    moe_min_blocks: tuple[int, int] = (1, 2)  # the matvec path's GLU and down on int8 inputs: blocks an SM their
    # registers must allow (launch bounds; 1: the compiler's choice). Qwen3-30B-A3B's Q6_K down (8 warps a block)
    # went from 182 registers, one block an SM, to 128 and two (bench/RESULTS.md 255)
    moe_min_blocks_mxfp4: tuple[int, int] = (3, 4)  # the same for MXFP4 experts (gpt-oss: the GLU from 239
    # registers, two blocks an SM, to 160 and three; down from 152 to 123 and four; RESULTS 255)
    moe_min_blocks_wide: tuple[int, int] = (3, 2)  # ... and for the types of moe_wide_glu (RESULTS 257)
    moe_wide_glu: frozenset[str] = frozenset({  # experts whose GLU ptxas gives over 200 registers unbounded (two
        # blocks an SM) and none spilled at three: Q5_K, Q3_K and IQ4_XS retypes of the Qwen3-30B-A3B twin
        # gained by it, the other i-quants' registers are alike; not Q6_K (it spills at three)
        "Q2_K", "Q3_K", "Q5_K", "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_S", "IQ1_M"})
    # -- attention
    attn_early: bool = True  # decode rows load keys before waiting for the QKV kernel
    own_row: bool = True  # q8_0 / q4_0 caches: flash_decode quantizes a decode row's key (no rope_kv launch)
    decode_rope: bool = True  # f16 caches: flash_decode does rope_kv's work where no matvec epilogue does (QK norms,
    # NEOX, tensor-core batches): a launch less a layer; small gains, none lost (bench/RESULTS.md 247)
    attn_small: tuple[int, int] = (0, 1)  # (warps, rounds) up to 8 rows: widest block, one round
    attn_big: tuple[int, int] = (4, 1)  # (warps, rounds) of larger calls: 4 warps, one round a split
    attn_parts: int = 2048  # splits x rows budget of the attention partials (workspace)
    decode_splits: int = 32  # splits a row up to 8 rows (any B); choose(): (KV head, split) blocks in one wave
    batch_split_budget: int = 256  # splits x rows of tensor-core steps: rows fill the GPU
    tiles: str = "auto"  # batch decode steps on attention_tiles.cu: "auto" (tiles_min_blocks), "on", "off"
    tiles_min_blocks: int = 256  # (KV head, row) blocks from which tiles beat splits
    tiles_max_keys: int = 768  # ... unless the rows hold more keys than this on average: flash_decode then (0: never; RESULTS 219, 221)
    tiles_rope: bool = True  # attention_tiles also does rope_kv's work (one launch less per layer)
    tiles_shape: tuple[int, int] | None = None  # (keys, stages); None: 8 KiB tiles, 2 stages (6 blocks/SM)
    flash: bool = True  # prompt chunks' attention on flash_attn.cu (tensor cores); off: the split kernel
    flash_shape: tuple[int, int] | None = None  # (rows a block, keys a tile); None: flash_config's rule
    flash_decode: bool = True  # decode steps (up to 8 rows) of f16 caches on flash_decode.cu; off: attention.cu
    decode_shape: tuple[int, int] | None = None  # flash_decode (keys a tile, stages); None: decode_config's 16:2
    decode_warps: int = 0  # flash_decode's warps a block; 0: decode_config's (8, fewer where rings do not fit)
    decode_min_keys: int = 0  # flash_decode's keys a split at least; 0: launch_attention.decode_min_keys's rule
    decode_fit: int = 1024  # rows split alone: the fewest splits giving their warps as many rounds of tiles, where a
    # KV head's partials (query heads x head dim) hold this many floats (0: never): fewer to merge won there and
    # lost where they are half that (bench/RESULTS.md row 264)
    flash_decode_batch: bool = True  # ... and tensor-core steps attention_tiles does not take (8B B=4-16: +6-8%)
    decode_bulk: bool = False  # flash_decode's f16 tiles by cp.async.bulk, a row a request (slower: RESULTS 225)
    decode_packed: bool = True  # flash_decode of several rows: (row, split) blocks in grid.y, keyed ones first (off: z rows)
    deep_decode_shape: tuple[int, int] | None = (16, 3)  # deep batch steps' flash_decode (keys a tile, stages); None: as others
    deep_decode_warps: int = 4  # ... and its warps a block (two blocks an SM: RESULTS 230); 0: decode_config's
    decode_work_split: bool = True  # flash_decode splits a batch's rows by its total keys (uneven depths: +30%)
    sm_count: int = 0  # the GPU's SMs (choose() fills it in)
    # -- tensor cores (batch steps)
    mma_reg_a: bool = True  # Q4_K / Q6_K A fragments built in registers
    mma_split_min_steps: int = 12  # K-split floor: fewer, longer splits over halved token tiles
    mma_split_blocks: int = 264  # blocks the K splits aim at (two an SM: the 64-row tiles' registers)
    mma_max_split: int = 4  # K splits a product at most (sizes the workspace's partials)
    mma_stages: tuple[int, int] = (2, 2)  # staged tiles' depth, products / GLU (deeper pipelines were slower)
    mma_wgmma: bool = False  # Q4_K GLUs of 64-row tiles by wgmma (glu_wgmma.cu, CC 9.0; slower: RESULTS 227)
    glu_split: int = 0  # GLUs of batch steps split K this many ways (sizes the split scratch; 0: unsplit)
    glu_shape: tuple[int, int] | None = None  # (WR, NT) of the GLU's tiles; None: mma_config's rule
    mma_min_blocks: int = 0  # products compiled for this many blocks an SM at least (0: ptxas's registers)
    glu_min_blocks: int = 0  # ... and the GLU
    mma_shape: tuple[int, int] | None = None  # (WR, NT) of every tensor-core tile, no split (measuring only)
    # -- graphs
    pdl: str = "auto"  # programmatic dependent launch: "auto" (pdl_any_rows), "off", "all" graphs
    pdl_any_rows: bool = True  # PDL in every graph (small models); big: matvec steps only
    pdl_big_graph_kernels: tuple[str, ...] = ("rmsnorm",)  # ... in larger graphs these only (products lose)
    lookahead: int = 4  # decode steps enqueued ahead of the token the host reads (one sequence, batches)
    # -- serving
    serve_chunk: int = 2048  # a prompt admitted while others decode: tokens evaluated between two of their steps
    # (0: the whole prompt at admission): bounds the running streams' wait for a document; smaller chunks cost
    # the documents' TTFT (bench/RESULTS.md row 130)
    serve_pack: bool = True  # prompts admitted in one step evaluated in shared forwards (seq_prefill_many); off: one by one
    serve_pack_rows: int = 16  # ... their flash blocks' query rows, so parts pad to this (0: flash_config's 32-64)
    serve_capture_packed: int = 4096  # ... and their graphs up to this many rows (capped by the workspace)
    # captured at serve start (0: each size's on its second run, mid-serving, while the streams wait; row 202)
    serve_spec_seqs: int = 2  # serve --spec ngram verifies proposals while at most this many sequences decode
    # (more: plain batch steps; with 4 sequences speculation lost to them, with 2 it was level)
    # -- tensor parallelism
    tp_oneshot_rows: int = 64  # sums of up to this many rows on allreduce.cu (peer memory; 0: NCCL for every sum):
    # faster than NCCL from one row to 64 (rows 188-189)
    tp_norm_rows: int = 8  # steps of up to this many rows sum a split's O and down products inside the next
    # RMSNorm's launch (layers.cu's rmsnorm_allreduce; 0: never) ...
    tp_norm_min_rows: int = 8  # ... and at least this many: it won at 8 rows and lost at one (row 190)
    tp_moe: bool = False  # split mixtures of experts too (format/shard.py: inside every expert); off until run on GPUs
    tp_reduce_off: bool = False  # measuring only: no all-reduce at all (wrong sums): a split's compute alone
    # -- KV cache
    kv_type: str = "f32"  # f16 up to 128-dim heads (half the bytes; flash_decode reads it); 256-dim: f32 (faster);
    # q8_0 / q4_0 only where the user asks (-ctk / -ctv): the flash kernels read them

    def knobs(self, verify: bool = False) -> KernelKnobs:
        """The kernel launchers' share of the table (``verify``: for a speculative verification's kernels)."""
        return KernelKnobs(mma_reg_a=self.mma_reg_a, mma_split_min_steps=self.mma_split_min_steps,
                           mma_split_blocks=self.mma_split_blocks, mma_max_split=self.mma_max_split,
                           mma_stages=self.mma_stages, mma_wgmma=self.mma_wgmma, glu_split=self.glu_split,
                           glu_shape=self.glu_shape, mma_min_blocks=self.mma_min_blocks,
                           glu_min_blocks=self.glu_min_blocks, tiles=self.tiles_shape,
                           flash=self.flash_shape,
                           decode=(self.decode_warps, *(self.decode_shape or (0, 0))),
                           decode_min_keys=self.decode_min_keys, decode_fit=self.decode_fit,
                           decode_bulk=self.decode_bulk,
                           decode_packed=self.decode_packed,
                           sm_count=self.sm_count if self.decode_work_split else 0, mma_shape=self.mma_shape,
                           mmv_token_grid=self.mmv_token_grid, gpu_sms=self.sm_count,
                           grid_waves=self.mmv_grid_waves, grid_groups=self.mmv_grid_groups,
                           grid_tokens=self.mmv_grid_tokens,
                           mmv_wide_rows=self.mmv_wide_rows == "all" or (verify and self.mmv_wide_rows == "verify"))

    def moe_bounds(self, type_name: str) -> tuple[int, int]:
        """(GLU, down) blocks an SM for the experts' matvecs on int8 inputs, by the experts' quant type."""
        if type_name == "MXFP4":
            return self.moe_min_blocks_mxfp4
        return self.moe_min_blocks_wide if type_name in self.moe_wide_glu else self.moe_min_blocks

    def mmv_override(self, role: str, type_name: str | None = None) -> tuple[int, int] | None:
        """(R, WG) for a role's matvec (and one weight type: "DOWN_Q6_K"), where measuring sets one."""
        table = dict(self.mmv)
        return (table.get(f"{role}_{type_name}") if type_name else None) or table.get(role)


def _size_defaults(weight_bytes: int, kv_type: str | None, n_head_kv: int | None, sm_count: int | None,
                   head_dim: int | None, arch: str | None, moe: bool = False) -> dict:
    big = weight_bytes > BIG_MODEL_BYTES
    f16 = big or (head_dim is not None and head_dim <= KV16_MAX_HEAD_DIM)
    # a mixture of experts keeps small batches on the matvecs and PDL in every graph whatever its
    # size: its products read few rows each, like a small model's (bench/RESULTS.md row 116)
    small = not big or moe
    out = {"decode_mmv_rows": 8 if small else 2, "pdl_any_rows": small, "mmv_token_grid": 0 if big else 8,
           "head_mma_rows": 0 if big else 4,
           "kv_type": kv_type if kv_type not in (None, "auto") else ("f16" if f16 else "f32"),
           "q8_res": Q8_RES_BY_ARCH.get(arch or "", frozenset())}
    if sm_count:
        out["sm_count"] = sm_count
    if n_head_kv and sm_count:
        # decode attention's (KV head, split) blocks in one wave of the SMs: more waste a tail wave,
        # fewer leave SMs idle at depth (bench/RESULTS.md rows 85-86). q8_0 caches up to 128-dim
        # heads: two blocks an SM (flash_decode converts them in registers: row 150)
        per_sm = 2 if out["kv_type"] == "q8_0" and (head_dim or 128) <= 128 else 1
        out["decode_splits"] = max(1, min(ATTN_MAX_SPLITS, per_sm * sm_count // n_head_kv))
    return out


def choose(weight_bytes: int, kv_type: str | None = None, max_rows: int | None = None, max_batch: int = 1,
           overrides: str | Mapping[str, str] | None = None, n_head_kv: int | None = None,
           sm_count: int | None = None, head_dim: int | None = None, arch: str | None = None,
           moe: bool = False) -> Tuning:
    """The table for a model (architecture ``arch``; ``moe``: a mixture of experts) of ``weight_bytes`` with
    ``n_head_kv`` KV heads of
    ``head_dim`` (None: a small model's f16 cache is not chosen) on a GPU of ``sm_count`` SMs
    (kv_type: the user's choice, "auto" or None; max_rows: the rows of the largest call, default
    prefill_chunk), ``overrides`` (default: $GGUF_RUN_TUNE) applied last. Without calls of more than 8 rows there are no tensor-core
    inputs, so decode steps stay on the matvecs."""
    if overrides is None:
        overrides = os.environ.get(ENV, "")
    items = list(overrides.items() if isinstance(overrides, Mapping) else _pairs(overrides))
    # an overridden cache type sizes what follows from it (decode_splits) as the user's choice would
    kv_type = next((str(text) for name, text in items if name == "kv_type"), kv_type)
    values = _size_defaults(weight_bytes, kv_type, n_head_kv, sm_count, head_dim, arch, moe)
    mmv: dict[str, tuple[int, int]] = {}
    given = set()
    for name, text in items:
        if name.startswith("mmv."):
            role, pair = _parse(name, text)[1]
            mmv[role] = pair
        else:
            values[name] = _parse(name, text)
            given.add(name)
    values["mmv"] = tuple(sorted(mmv.items()))
    rows = max(max_rows or values.get("prefill_chunk", Tuning.prefill_chunk), max_batch)
    if rows <= 8 and "decode_mmv_rows" not in given:
        values["decode_mmv_rows"] = 8
    t = Tuning(**values)
    _check(t)
    return t


def _pairs(text: str) -> list[tuple[str, str]]:
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, sep, value = part.partition("=")
        if not sep:
            raise BackendError(f"{ENV}: {part!r} is not field=value; {help()}")
        out.append((name.strip(), value.strip()))
    return out


FIELDS = {f.name: f for f in dataclasses.fields(Tuning)}


def _parse(name: str, text: str):
    """A field's value from its spelling: numbers, on/off (1/0), A:B pairs, a+b role sets, and
    mmv.ROLE[_TYPE]=R:WG for the matvec overrides."""
    if name.startswith("mmv."):
        role = name[4:]
        if role.split("_", 1)[0] not in MMV_ROLES:
            raise BackendError(f"{ENV}: {name}: the roles are {', '.join(MMV_ROLES)}")
        return ("mmv", (role, _pair(name, text)))
    f = FIELDS.get(name)
    if f is None:
        raise BackendError(f"{ENV}: no field {name!r}; {help()}")
    default = getattr(Tuning(), name)
    try:
        if isinstance(default, bool):
            if text not in ("0", "1", "on", "off"):
                raise ValueError
            return text in ("1", "on")
        if isinstance(default, int):
            return int(text)
        if isinstance(default, frozenset):
            return frozenset() if text in ("", "none") else frozenset(text.split("+"))
        if name == "pdl_big_graph_kernels":
            return tuple(p for p in text.split("+") if p)
        if name in ("attn_small", "attn_big", "mma_stages", "tiles_shape", "flash_shape",
                    "decode_shape", "deep_decode_shape", "moe_rows", "moe_min_blocks", "moe_min_blocks_mxfp4",
                    "moe_min_blocks_wide",
                    "mma_shape", "glu_shape", "mmv_grid_waves"):
            return None if text == "none" else _pair(name, text)
        return text
    except ValueError:
        raise BackendError(f"{ENV}: {name}={text!r} is not a value of that field; {help()}") from None


def _pair(name: str, text: str) -> tuple[int, int]:
    a, sep, b = text.partition(":")
    if not sep or not a.isdigit() or not b.isdigit():
        raise BackendError(f"{ENV}: {name}={text!r}: give two numbers as A:B")
    return int(a), int(b)


def _check(t: Tuning) -> None:
    if not (t.moe_rows[0] in (2, 4, 6, 8) and 1 <= t.moe_rows[1] <= 8):
        raise BackendError(f"{ENV}: moe_rows={t.moe_rows[0]}:{t.moe_rows[1]}: give GLU rows 2, 4, 6 or 8 "
                           "and down rows 1 to 8")
    for name in ("moe_min_blocks", "moe_min_blocks_mxfp4", "moe_min_blocks_wide"):
        if not all(1 <= b <= 8 for b in getattr(t, name)):
            raise BackendError(f"{ENV}: {name}={getattr(t, name)[0]}:{getattr(t, name)[1]}: give 1 to 8 blocks an SM")
    if t.serve_pack_rows not in (0, 16, 32, 48, 64):
        raise BackendError(f"{ENV}: serve_pack_rows={t.serve_pack_rows}: give 16, 32, 48 or 64 (or 0: the flash rule's)")
    if not 1 <= t.mma_max_split <= 16 or t.mma_split_blocks < 1:
        raise BackendError(f"{ENV}: mma_max_split={t.mma_max_split}, mma_split_blocks={t.mma_split_blocks}: "
                           "give 1 to 16 splits and at least one block")
    if t.tiles_max_keys < 0:
        raise BackendError(f"{ENV}: tiles_max_keys={t.tiles_max_keys}: give 0 (never) or a number of keys a row")
    if t.serve_chunk < 0:
        raise BackendError(f"{ENV}: serve_chunk={t.serve_chunk}: give 0 (whole prompts) or a number of tokens")
    if not 1 <= t.lookahead <= 32:  # (the pinned ring holds 64 tokens a slot)
        raise BackendError(f"{ENV}: lookahead={t.lookahead}: give a number of steps from 1 to 32")
    if not 1 <= t.decode_splits <= ATTN_MAX_SPLITS:
        raise BackendError(f"{ENV}: decode_splits={t.decode_splits}: the attention kernel merges 1 to "
                           f"{ATTN_MAX_SPLITS} splits a row")
    if not 0 <= t.prefill_mma_rows <= 64:  # (the tensor-core products' split scratch: 64 rows)
        raise BackendError(f"{ENV}: prefill_mma_rows={t.prefill_mma_rows}: give 0 (off) to 64 rows")
    if not 0 <= t.moe_topk_glu_blocks <= 32:
        raise BackendError(f"{ENV}: moe_topk_glu_blocks={t.moe_topk_glu_blocks}: give 0 (never) to 32 blocks an SM")
    if not 1 <= t.decode_mmv_rows <= 8:
        raise BackendError(f"{ENV}: decode_mmv_rows={t.decode_mmv_rows}: give a number of rows from 1 to 8")
    for name, allowed in (("tiles", ("auto", "on", "off")), ("pdl", ("auto", "off", "all")),
                          ("mmv_wide_rows", ("off", "verify", "all")), ("kv_type", KV_TYPES)):
        if getattr(t, name) not in allowed:
            raise BackendError(f"{ENV}: {name}={getattr(t, name)!r} is not one of {', '.join(allowed)}")
    for name in ("kstage", "q8_res"):
        wrong = sorted(getattr(t, name) - set(ROLE_SETS))
        if wrong:
            raise BackendError(f"{ENV}: {name}: {', '.join(wrong)} not among the roles {', '.join(ROLE_SETS)}")
    quants = {f.name for f in FORMATS.values()}
    wrong = sorted(t.moe_wide_glu - quants)
    if wrong:
        raise BackendError(f"{ENV}: moe_wide_glu: {', '.join(wrong)} not quant types ({', '.join(sorted(quants))})")


def help() -> str:  # noqa: A001
    return ("fields: " + ", ".join(FIELDS) + " (bools 0/1, pairs A:B, role sets a+b, matvec shapes mmv.ROLE=R:WG "
            f"with ROLE one of {', '.join(MMV_ROLES)} or ROLE_TYPE, e.g. mmv.DOWN_Q6_K=4:2)")
