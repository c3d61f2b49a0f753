"""Launcher of the attention kernel (attention.cu) and its block shape.

A block of W warps takes four keys per warp per round; a split covers at least ``rounds`` rounds
(min_keys = 4 W rounds keys), so short contexts run one block per KV head and merge their warps
in shared memory, not across blocks.
"""

from __future__ import annotations

from typing import NamedTuple

from .launch_core import NO_PTRS, Kernels, Q8Vec, f32, i32, ptr

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


def kernel_name(head_dim: int, group: int, shape: AttnShape) -> str:
    return f"attn_split<{head_dim}, {group}, {shape.warps}>"


def attention(k: Kernels, q: int, ldq: int, rows: int, kcache: int, vcache: int, pos: int, seq: int, table: int,
              max_pages: int, page_size: int, n_head: int, n_head_kv: int, head_dim: int, scale: float, cap: float,
              window: int, n_split: int, part_o: int, part_ml: int, counter: int, out: int, ldo: int,
              out16: int | None = None, ld16: int = 0, q8: Q8Vec | None = None, shape: AttnShape | None = None,
              early: bool = False) -> None:
    """Split-K attention over the paged cache, merged in the same launch (counter: rows x n_head_kv
    zeros, left zero); q8: also the output's int8 copy (head_dim % 16 == 0). early: every row is
    one token of its own sequence (decode), so the keys before its position are loaded before the
    wait for the kernel that wrote q (attention.cu)."""
    g = n_head // n_head_kv
    assert q8 is None or head_dim % 16 == 0
    shape = shape or attn_shape(head_dim, g)
    k.fn("attention.cu", kernel_name(head_dim, g, shape))(
        (n_head_kv, n_split, rows), (32 * shape.warps,),
        (ptr(q), i32(ldq), ptr(kcache), ptr(vcache), ptr(pos), ptr(seq), ptr(table), i32(max_pages),
         i32(page_size), i32(n_head_kv), f32(scale), f32(cap), i32(window), i32(n_split), i32(shape.min_keys),
         i32(1 if early else 0), ptr(part_o), ptr(part_ml), ptr(counter), ptr(out), i32(ldo), ptr(out16), i32(ld16),
         *(q8.ptrs() if q8 else NO_PTRS)))
