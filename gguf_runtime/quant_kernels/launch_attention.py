"""Launchers of the attention kernels and their block shapes.

attention.cu (decode of one or a few sequences, prefill): a block of W warps takes four keys per
warp per round; a split covers at least ``rounds`` rounds (min_keys = 4 W rounds keys), so short
contexts run one block per KV head and merge their warps in shared memory, not across blocks.
attention_tiles.cu (batch decode steps): one block per (KV head, row), keys streamed in tiles.
flash_attn.cu (prompt chunks): tensor-core flash attention, a block per (KV head, 16 WT rows).
flash_decode.cu (decode steps up to 8 rows): attention.cu's splits on the tensor cores, per-warp
cp.async rings. attention.cu and attention_tiles.cu read float32 or f16 caches; the flash kernels
also q8_0 and q4_0 (kv_layout.py); each type compiled apart (``kv``: the cache's type name).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from . import kv_layout as KL
from .grids import dec_grid_y
from .knobs import ATTN_MAX_SPLITS
from .launch_core import NO_PTRS, Kernels, Q8Vec, f32, i32, ptr

if TYPE_CHECKING:
    from .launchers import RopeKV

ATTN_WARPS = (4, 8, 16)  # the compiled block sizes


class AttnShape(NamedTuple):
    warps: int  # W: 32 W threads per block
    min_keys: int  # keys per split at least (fewer splits than n_split below n_split x min_keys keys)


def attn_shape(head_dim: int, group: int, warps: int = 0, rounds: int = 2) -> AttnShape:
    """warps = 0: the widest block whose per-thread state (G x head_dim / 32 accumulators and
    queries) fits the 128 registers of a 512-thread block, 8 and 4 warps for wider heads."""
    if not warps:
        width = group * head_dim
        warps = 16 if width <= 512 else 8 if width <= 1024 else 4
    if warps not in ATTN_WARPS or rounds < 1:
        raise ValueError(f"attention block of {warps} warps and {rounds} rounds per split is not compiled")
    return AttnShape(warps, 4 * warps * rounds)


def kv_ctype(kv: str, quantized: bool = False) -> str:
    """The kernels' KV template argument: the C type of a cache of type ``kv`` (quantized: the
    kernel reads q8_0 / q4_0 too)."""
    if kv in KL.QUANT and not quantized:
        raise ValueError(f"this attention kernel reads f32 and f16 caches, not {kv}")
    return KL.CTYPE[kv]


def kernel_name(head_dim: int, group: int, shape: AttnShape, kv: str = "f32") -> str:
    return f"attn_split<{head_dim}, {group}, {shape.warps}, {kv_ctype(kv)}>"


def attention(k: Kernels, q: int, ldq: int, rows: int, kcache: int, vcache: int, pos: int, seq: int, table: int,
              max_pages: int, page_size: int, n_head: int, n_head_kv: int, head_dim: int, scale: float, cap: float,
              window: int, n_split: int, part_o: int, part_ml: int, counter: int, out: int, ldo: int,
              out16: int | None = None, ld16: int = 0, q8: Q8Vec | None = None, shape: AttnShape | None = None,
              early: bool = False, kv: str = "f32", sinks: int = 0) -> None:
    """Split-K attention over the paged cache, merged in the same launch (counter: rows x n_head_kv
    zeros, left zero); q8: also the output's int8 copy (head_dim % 16 == 0). early: every row is
    one token of its own sequence (decode), so the keys before its position are loaded before the
    wait for the kernel that wrote q (attention.cu). sinks: n_head float32 sink logits (gpt-oss)
    joining each head's softmax denominator, or 0."""
    g = n_head // n_head_kv
    assert q8 is None or head_dim % 16 == 0
    shape = shape or attn_shape(head_dim, g)
    assert 1 <= n_split <= ATTN_MAX_SPLITS and page_size & (page_size - 1) == 0, (n_split, page_size)
    k.fn("attention.cu", kernel_name(head_dim, g, shape, kv))(
        (n_head_kv, n_split, rows), (32 * shape.warps,),
        (ptr(q), i32(ldq), ptr(kcache), ptr(vcache), ptr(pos), ptr(seq), ptr(table), i32(max_pages),
         i32(page_size), i32(n_head_kv), f32(scale), f32(cap), i32(window), i32(n_split), i32(shape.min_keys),
         i32(1 if early else 0), ptr(part_o), ptr(part_ml), ptr(counter), ptr(out), i32(ldo), ptr(out16), i32(ld16),
         *(q8.ptrs() if q8 else NO_PTRS), ptr(sinks)))


# ---- attention_tiles.cu: batch decode steps, one block per (KV head, row) ---------------------------
TILE_HEAD_DIMS = (64, 128, 256)
TILE_BYTES = 8192  # keys of one tile: 8 KiB in the cache's type (tiles_config)


def tiles_ok(head_dim: int, head_dim_v: int) -> bool:
    return head_dim == head_dim_v and head_dim in TILE_HEAD_DIMS


def tiles_warps(head_dim: int, group: int) -> int:
    """One thread per (head, 4 dims) in P V, between 2 and 8 warps."""
    return min(8, max(2, group * head_dim // 128))


def tiles_config(head_dim: int, kv: str = "f32", knobs: tuple[int, int] | None = None) -> tuple[int, int]:
    """(keys per tile, stages): ``knobs`` (KernelKnobs.tiles) where given, else tiles of TILE_BYTES
    of keys, two stages (f32 64/128/256: 32, 16, 8 keys; f16 twice as many)."""
    if knobs:
        return knobs
    return TILE_BYTES // (head_dim * (2 if kv == "f16" else 4)), 2


def tiles_kernel_name(head_dim: int, group: int, config: tuple[int, int] | None = None, kv: str = "f32") -> str:
    kt, st = config or tiles_config(head_dim, kv)
    return f"attn_tiles<{head_dim}, {group}, {tiles_warps(head_dim, group)}, {kt}, {st}, {kv_ctype(kv)}>"


def tiles_smem(head_dim: int, group: int, config: tuple[int, int] | None = None, kv: str = "f32") -> int:
    """Bytes: the stages of K and V tiles (K rows padded, as attention_tiles.cu's Tile) and the
    row's own key and value, in the cache's type; q, per-head scratch and the RoPE angles (float)."""
    kt, st = config or tiles_config(head_dim, kv)
    nt = 32 * tiles_warps(head_dim, group)
    sp = 1 if group * kt >= nt or nt % (group * kt) else nt // (group * kt)
    pad = 8 if kv == "f16" and sp == 1 else 4 * sp
    kv_elems = st * kt * (head_dim + pad) + st * kt * head_dim + 2 * head_dim
    return (2 if kv == "f16" else 4) * kv_elems + 4 * (group * head_dim + head_dim + group * kt + 2 * group)


def attention_tiles(k: Kernels, q: int, ldq: int, rows: int, kcache: int, vcache: int, pos: int, seq: int,
                    table: int, max_pages: int, page_size: int, n_head: int, n_head_kv: int, head_dim: int,
                    scale: float, cap: float, window: int, out: int, ldo: int, out16: int | None = None,
                    ld16: int = 0, early: bool = False, config: tuple[int, int] | None = None,
                    inv_freq: int = 0, n_rot: int = 0, neox: bool = False, kv: str = "f32") -> None:
    """Each row's attention over its own keys, one block per (KV head, row) streaming them in tiles
    (attention_tiles.cu); out16: also an f16 copy. early: every row is one token of its own
    sequence, so its keys before its position are loaded before the wait for the kernel before.
    n_rot > 0 (early only): q points at raw QKV rows, and the kernel does rope_kv's work (RoPE of
    the first n_rot dims at angles pos * inv_freq (float64), K and V into the cache)."""
    assert n_rot == 0 or early
    g = n_head // n_head_kv
    assert tiles_ok(head_dim, head_dim) and page_size & (page_size - 1) == 0  # common.cuh's kv_page
    config = config or tiles_config(head_dim, kv, k.knobs.tiles)
    fn = k.fn("attention_tiles.cu", tiles_kernel_name(head_dim, g, config, kv))
    smem = tiles_smem(head_dim, g, config, kv)
    fn.allow_smem(smem)
    fn((n_head_kv, rows), (32 * tiles_warps(head_dim, g),),
       (ptr(q), i32(ldq), ptr(kcache), ptr(vcache), ptr(pos), ptr(seq), ptr(table), i32(max_pages), i32(page_size),
        i32(n_head_kv), f32(scale), f32(cap), i32(window), i32(1 if early else 0), ptr(inv_freq), i32(n_rot),
        i32(1 if neox else 0), ptr(out), i32(ldo), ptr(out16), i32(ld16)), shared_mem=smem)


# ---- flash_attn.cu: prompt chunks (prefill) on the tensor cores ----------------------------------
FLASH_HEAD_DIMS = (64, 128, 256)


def flash_ok(head_dim: int, head_dim_v: int, group: int) -> bool:
    return head_dim == head_dim_v and head_dim in FLASH_HEAD_DIMS and 1 <= group <= 8


def flash_config(head_dim: int, group: int, kv: str, knobs: tuple[int, int] | None = None) -> tuple[int, int, int]:
    """(WT, KT, ST): 16 WT rows a block (G WT warps: up to 8), KT keys a tile, ST stages. ``knobs``
    (KernelKnobs.flash: rows, keys) where given; else 64 rows for one head a group, 32 up to 4 (16 from 5), and
    tiles of 64 keys where a key row is at most 256 bytes in the cache (32 above)."""
    rows, kt = knobs or (64 if group == 1 else 32 if group <= 4 else 16,
                         64 if KL.row_bytes(kv, head_dim)[0] <= 256 else 32)
    return max(1, rows // 16), kt, 2


def flash_kernel_name(head_dim: int, group: int, config: tuple[int, int, int], kv: str) -> str:
    wt, kt, st = config
    return f"flash_prefill<{head_dim}, {group}, {wt}, {kt}, {st}, {kv_ctype(kv, True)}>"


def stage_bytes(head_dim: int, kt: int, kv: str) -> tuple[int, int]:
    """(bytes of one stage of K or V, of the f16 tile a raw stage converts into; kv_cache.cuh's
    layout: f16 stages are the tiles, rows padded to head_dim + 8 halves)."""
    ldh = head_dim + 8
    if kv == "f16":
        return kt * ldh * 2, 0
    vb, sb = KL.row_bytes(kv, head_dim)
    return kt * (vb + sb), kt * ldh * 2


def flash_smem(head_dim: int, group: int, config: tuple[int, int, int], kv: str) -> int:
    """Bytes of dynamic shared memory (flash_attn.cu's Flash::BYTES)."""
    wt, kt, st = config
    q_frags = group * wt * (head_dim // 16) * 32 * 16 if head_dim > 128 else 0  # uint4 per (warp, k step, lane)
    stage, tile = stage_bytes(head_dim, kt, kv)
    return 2 * st * stage + 2 * tile + q_frags


def flash_prefill(k: Kernels, q: int, ldq: int, rows: int, kcache: int, vcache: int, pos: int, seq: int,
                  table: int, max_pages: int, page_size: int, n_head: int, n_head_kv: int, head_dim: int,
                  scale: float, cap: float, window: int, out: int, ldo: int, out16: int | None = None,
                  ld16: int = 0, kv: str = "f32", config: tuple[int, int, int] | None = None, sinks: int = 0) -> None:
    """Attention of ``rows`` rows (the non-padding ones: one sequence, as a prompt chunk) over the
    paged cache on the tensor cores (flash_attn.cu); out16: also an f16 copy; sinks: n_head float32
    sink logits (gpt-oss) joining each head's softmax denominator, or 0."""
    g = n_head // n_head_kv
    assert flash_ok(head_dim, head_dim, g) and page_size & (page_size - 1) == 0  # common.cuh's kv_page
    config = config or flash_config(head_dim, g, kv, k.knobs.flash)
    fn = k.fn("flash_attn.cu", flash_kernel_name(head_dim, g, config, kv))
    smem = flash_smem(head_dim, g, config, kv)
    fn.allow_smem(smem)
    bq = 16 * config[0]
    fn((n_head_kv, -(-rows // bq)), (32 * g * config[0],),
       (ptr(q), i32(ldq), ptr(kcache), ptr(vcache), ptr(pos), ptr(seq), ptr(table), i32(max_pages), i32(page_size),
        i32(n_head_kv), i32(rows), f32(scale), f32(cap), i32(window), ptr(out), i32(ldo), ptr(out16), i32(ld16),
        ptr(sinks)),
       shared_mem=smem)


# ---- flash_decode.cu: decode steps on the tensor cores, keys split as attention.cu's -------------
DECODE_WARPS = 8
DECODE_SMEM_MAX = 200 * 1024  # the rings of a block at most (an H100 block takes up to 227 KiB)
SM_SMEM = 228 * 1024  # shared memory of an H100 SM (blocks an SM holds: this over a block's share)


def decode_config(head_dim: int, kv: str, knobs: tuple[int, int, int] | None = None) -> tuple[int, int, int]:
    """(NW, KT, ST): NW warps a block, each with a ring of ST stages of KT keys. ``knobs``
    (KernelKnobs.decode: warps, keys, stages; 0 for the rule's) where given; else 16 keys, 2 stages,
    and 8 warps (one block an SM for 128-dim heads; bench/RESULTS.md), fewer where the rings do not
    fit."""
    w0, kt, st = knobs or (0, 0, 0)
    kt, st = kt or 16, st or 2  # 0: the rule's
    nw = w0 or next((w for w in (DECODE_WARPS, 4, 2, 1)
                     if decode_smem(head_dim, (w, kt, st), kv) <= DECODE_SMEM_MAX), 1)
    return nw, kt, st


NO_ATTN_ROPE = (ptr(0), i32(0), i32(0), ptr(0), ptr(0), f32(0.0))  # flash_decode without rope_kv's work (RopeKV.attn_args)


def decode_min_keys(head_dim: int, config: tuple[int, int, int], kv: str) -> int:
    """The fewest keys a flash_decode split takes: one tile a warp, two for f16 heads up to 64 wide
    (SmolLM2 at depth 4096 +1%, level at short contexts and B=64: bench/RESULTS.md row 162)."""
    nw, kt, _ = config
    return nw * kt * (2 if head_dim <= 64 and kv == "f16" else 1)


def decode_kernel_name(head_dim: int, group: int, config: tuple[int, int, int], kv: str, bulk: bool = False) -> str:
    nw, kt, st = config
    return f"flash_decode<{head_dim}, {group}, {nw}, {kt}, {st}, {kv_ctype(kv, True)}{', 1' if bulk else ''}>"


def decode_smem(head_dim: int, config: tuple[int, int, int], kv: str) -> int:
    """Bytes of dynamic shared memory (flash_decode.cu's Dec::BYTES)."""
    nw, kt, st = config
    stage, tile = stage_bytes(head_dim, kt, kv)
    if kv == "q8_0":  # converted in registers (Dec::REG): no f16 tiles, rows padded by 16 bytes
        stage, tile = stage + kt * 16, 0
    return nw * (2 * st * stage + 2 * tile)


def flash_decode(k: Kernels, q: int, ldq: int, rows: int, kcache: int, vcache: int, pos: int, seq: int, table: int,
                 max_pages: int, page_size: int, n_head: int, n_head_kv: int, head_dim: int, scale: float,
                 cap: float, window: int, n_split: int, part_o: int, part_ml: int, counter: int, out: int, ldo: int,
                 out16: int | None = None, ld16: int = 0, q8: Q8Vec | None = None, early: bool = False,
                 kv: str = "f32", config: tuple[int, int, int] | None = None, sinks: int = 0,
                 own: tuple[int, int] | None = None, per_row: bool = False, bulk: bool | None = None,
                 rope: RopeKV | None = None) -> None:
    """attention()'s contract (rows: each one token of its own sequence, or of one sequence without
    ``early``) on the tensor cores: f16 operands (q scaled, K, V, P), f32 accumulation. A split
    covers at least one tile per warp: short contexts run one block per KV head, no merge of splits.
    per_row: each row's keys split as a one-row call splits them (not by the step's total work):
    speculative verification, whose rows then get what one-row decode steps get, bit for bit.
    sinks: as flash_prefill's. own = (qkv, ld), q8_0 / q4_0 caches with ``early``: each row's own
    key and value are not in the cache yet but in qkv's row (Q, K rotated, V; float32): the kernel
    quantizes them into the cache (rope_kv's work for the row, without its launch). bulk (None: the
    knobs' decode_bulk): an f16 cache's tiles by cp.async.bulk, a row a request (the same bits).
    rope (early, f16 caches): q points at raw QKV rows (Q, K, V unrotated) and the kernel does
    ``rope.launch``'s work itself (QK norms, RoPE, the rows' keys and values into the cache): the
    bits of rope_kv then this kernel, without rope_kv's launch."""
    g = n_head // n_head_kv
    assert flash_ok(head_dim, head_dim, g) and (q8 is None or head_dim % 16 == 0)
    assert 1 <= n_split <= ATTN_MAX_SPLITS and page_size & (page_size - 1) == 0, (n_split, page_size)
    assert own is None or (early and kv in KL.QUANT), (own, early, kv)
    config = config or decode_config(head_dim, kv, k.knobs.decode)
    bulk = (k.knobs.decode_bulk if bulk is None else bulk) and kv == "f16"
    assert rope is None or (early and kv == "f16" and not bulk and rope.head_dim == rope.head_dim_v == head_dim
                            and rope.n_rot % 2 == 0), (early, kv, bulk, rope)
    fn = k.fn("flash_decode.cu", decode_kernel_name(head_dim, g, config, kv, bulk))
    smem = decode_smem(head_dim, config, kv)
    fn.allow_smem(smem)
    # batches: the step's blocks in one wave, SMs x the blocks an SM holds (shared memory); one row
    # (or no SM count): n_split alone (the totals' loop cost SmolLM2 1.5-3% at one row)
    per_sm = max(1, SM_SMEM // (smem + 2048))
    target = k.knobs.sm_count * per_sm if k.knobs.sm_count and rows > 1 and not per_row else 0
    packed = rows > 1 and k.knobs.decode_packed
    fn((n_head_kv, dec_grid_y(rows, n_split, target, n_head_kv, window, packed), 1 if packed else rows),
       (32 * config[0],),
       (ptr(q), i32(ldq), ptr(kcache), ptr(vcache), ptr(pos), ptr(seq), ptr(table), i32(max_pages),
        i32(page_size), i32(n_head_kv), f32(scale), f32(cap), i32(window), i32(n_split),
        i32(k.knobs.decode_min_keys or decode_min_keys(head_dim, config, kv)), i32(target),
        i32(1 if k.knobs.decode_fit and g * head_dim >= k.knobs.decode_fit else 0), i32(1 if early else 0),
        ptr(part_o),
        ptr(part_ml), ptr(counter), ptr(out), i32(ldo), ptr(out16), i32(ld16), *(q8.ptrs() if q8 else NO_PTRS),
        ptr(sinks), ptr(own[0] if own else 0), i32(own[1] if own else 0), i32(rows),
        *(rope.attn_args() if rope else NO_ATTN_ROPE)),
       shared_mem=smem)
