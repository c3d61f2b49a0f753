"""Launchers of the tensor-core kernels (matmul_mma.cu; glu_wgmma.cu on Hopper where the knob
asks): tile shapes, K splits, shared memory.

Products of more than MAX_MMV_TOKENS rows in the batch decode steps; see matmul_mma.cu.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import cupy as cp

from .knobs import KernelKnobs
from .launch_core import fused_act, Kernels, Mat, _Counted, i32, ptr

MMA_MIN_BLOCKS = 132  # one wave on an H100: below this, smaller tiles or K splits (more blocks) win
MMA_SPLIT_BLOCKS = KernelKnobs().mma_split_blocks  # mma_config's defaults without a backend (the knobs')
MMA_TK = 128  # columns per k step (matmul_mma.cu TK)
MMA_TALL_MIN_COLS = 1024
MMA_MAX_SPLIT = KernelKnobs().mma_max_split
# Types whose A fragments are built in registers (mma_regs.cuh): x tile row stride in halves. x
# and each k step's raw weights (REG_A_WROW: bytes per weight row) go through shared memory in
# mma_stages' buffers.
REG_A_LDX = {"TQ4_K": 160, "TQ6_K": 144}
REG_A_WROW = {"TQ4_K": 96, "TQ6_K": 144}


def mma_stages(structs: Sequence[str], n_mats: int, ra: int, stages: tuple[int, int] = (2, 2)) -> int:
    """The ST template argument: stages[n_mats - 1] (KernelKnobs.mma_stages) where a segment builds
    its fragments in registers (its raw weights staged), else 2."""
    if not ra or not any(s in REG_A_LDX for s in structs):
        return 2
    return stages[n_mats - 1]


class MmaConfig(NamedTuple):
    wr: int  # warps along the rows: a row tile is 16 wr rows
    nt: int  # 8-token MMA columns per warp: a token tile is 8 nt (4 / wr) tokens
    split: int  # blocks sharing the k steps of a tile
    h: int = 1  # row tiles stacked in a block (2: x read half as often)


def mma_config(rows: Sequence[int], n_tok: int, cols: int = 0, tall: bool = True, floor: int = 0,
               split_blocks: int = MMA_SPLIT_BLOCKS, max_split: int = MMA_MAX_SPLIT) -> MmaConfig:
    """The largest block (x is read once per row tile: large tiles read it least) that fills a wave
    with at most MMA_MAX_SPLIT K splits; cols = 0: no split. tall: blocks of two stacked 64-row
    tiles where they fill the GPU unsplit and K is long (output heads: faster for the 8B's at B=64,
    slower for SmolLM2's, K = 576: hence MMA_TALL_MIN_COLS); split tall blocks were slower than
    split 64-row ones (the 8B's o-proj). Where that split leaves a block fewer than ``floor`` k
    steps (KernelKnobs.mma_split_min_steps) and the token tile is wider than 32, the split is
    lowered to keep them and the token tiles are halved to keep the blocks (the 8B's o-proj at
    B=64: 2 splits of 32-token tiles beat 4 splits of 64-token tiles; measured: see
    bench/RESULTS.md). split_blocks and max_split: KernelKnobs.mma_split_blocks / mma_max_split."""
    steps = -(-cols // MMA_TK)

    def plan(wr: int, nt: int, h: int) -> tuple[int, int]:  # (tiles, split before the floor)
        tiles = sum(-(-n // (16 * wr * h)) for n in rows) * -(-n_tok // (8 * nt * (4 // wr)))
        return tiles, max(1, min(steps, max_split, -(-split_blocks // tiles)))

    for wr, h in ((4, 2), (4, 1), (2, 1), (1, 1)):
        if h == 2 and not tall:
            continue
        nt = min(8, max(1, -(-min(n_tok, 64) // (8 * (4 // wr)))))
        tiles, split = plan(wr, nt, h)
        if h == 2 and (tiles < split_blocks or cols < MMA_TALL_MIN_COLS):
            continue
        if tiles * split >= MMA_MIN_BLOCKS or wr == 1:
            runs = max(1, steps // floor) if floor else split  # splits of at least `floor` k steps
            if runs < split and nt > 4 and tiles * runs >= MMA_MIN_BLOCKS // 2:
                nt = 4  # fewer, longer split runs; twice the token tiles keep the blocks
                tiles, split = plan(wr, nt, h)
                split = min(split, runs)
            return MmaConfig(wr, nt, split, h)
    raise AssertionError


def mma_smem(fn: "_Counted", wr: int, nt: int, n_mats: int, structs: Sequence[str], ra: int, st: int) -> int:
    """Dynamic shared memory of an mma kernel: the x tile and n_mats W tiles, f16, padded rows;
    for a register-fragment segment st x tiles and st stages of raw weights (the largest over the
    segments)."""
    tb = 8 * nt * (4 // wr)
    size = max(st * (tb * REG_A_LDX[s] * 2 + n_mats * 16 * wr * REG_A_WROW[s])
               if ra and s in REG_A_LDX else (tb + n_mats * 16 * wr) * (MMA_TK + 8) * 2 for s in structs)
    fn.allow_smem(size)
    return size


def mma_name(structs: Sequence[str], wr: int, nt: int, mode: int, h: int = 1, ra: int = 1,
             stages: tuple[int, int] = (2, 2), min_blocks: int = 0) -> str:
    s = list(structs) + [structs[0]] * (3 - len(structs))
    mb = f", {min_blocks}" if min_blocks else ""
    return f"mma_group<{s[0]}, {s[1]}, {s[2]}, {wr}, {nt}, {mode}, {h}, {ra}, {mma_stages(s, h, ra, stages)}{mb}>"


def mma_glu_name(struct: str, wr: int, nt: int, act: int, ra: int = 1, stages: tuple[int, int] = (2, 2),
                 min_blocks: int = 0) -> str:
    mb = f", {min_blocks}" if min_blocks else ""
    return f"mma_glu<{struct}, {wr}, {nt}, {act}, {ra}, {mma_stages([struct], 2, ra, stages)}{mb}>"


@functools.lru_cache(maxsize=None)
def hopper() -> bool:
    """Whether the current GPU takes sm_90a code (glu_wgmma.cu): compute capability 9.0."""
    return cp.cuda.Device().compute_capability == "90"


WG_X_BYTES = 64 * MMA_TK * 2  # glu_wgmma.cu: a step's x tile (64 tokens, unpadded) ...
WG_W_BYTES = 2 * 64 * REG_A_WROW["TQ4_K"]  # ... and its staged gate and up rows


def _glu_wgmma(k: Kernels, gate: Mat, up: Mat, x16: int, ldx16: int, n_tok: int, act: str, y16: int, ldy16: int,
               stages: int) -> None:
    """mma_glu's 64-row tiles of Q4_K on wgmma (glu_wgmma.cu), 64 tokens a tile (fewer: zero
    columns), unsplit."""
    fn = k.fn("glu_wgmma.cu", f"mma_glu_wg<{fused_act(act)}, {stages}>")
    smem = stages * (WG_X_BYTES + WG_W_BYTES)
    fn.allow_smem(smem)
    fn((-(-gate.rows // 64), -(-n_tok // 64), 1), (128,),
       (*gate.planes, *up.planes, i32(gate.rows), ptr(x16), i32(ldx16), i32(n_tok), i32(gate.cols), ptr(y16),
        i32(ldy16), ptr(0), ptr(0)),
       shared_mem=smem)


def _mma_plan(k: Kernels, rows: Sequence[int], n_tok: int, cols: int, n_mats: int, scratch: "SplitScratch | None",
              tall: bool = True) -> MmaConfig:
    """mma_config (with the knobs' split floor), without a split where the scratch cannot hold its
    partials (n_mats: W tiles per block besides the tall stacking)."""
    kn = k.knobs
    if kn.mma_shape is not None:
        return MmaConfig(*kn.mma_shape, 1, 1)

    def config(cols: int) -> MmaConfig:
        return mma_config(rows, n_tok, cols, tall, kn.mma_split_min_steps, kn.mma_split_blocks, kn.mma_max_split)
    c = config(cols if scratch else 0)
    return c if c.split == 1 or _split_fits(scratch, rows, n_tok, c, n_mats) else config(0)


def _split_fits(scratch: "SplitScratch | None", rows: Sequence[int], n_tok: int, c: MmaConfig, n_mats: int) -> bool:
    """Whether the scratch holds c's counters and partials (n_mats W tiles a block, c.h stacked)."""
    tiles = sum(-(-n // (16 * c.wr * c.h)) for n in rows) * -(-n_tok // (8 * c.nt * (4 // c.wr)))
    return scratch is not None and tiles <= scratch.counters and \
        tiles * c.split * n_mats * c.h * 512 * c.nt <= scratch.part_floats


def split_part_floats(rows: int, n_tok: int, max_split: int = MMA_MAX_SPLIT) -> int:
    """Floats of partials any split product with <= rows output rows and n_tok tokens needs."""
    return max_split * -(-rows // 64) * 64 * -(-n_tok // 64) * 64


@dataclass(frozen=True)
class SplitScratch:
    """Workspace of K-split products: partial C fragments and one zeroed counter per tile."""
    part: int
    part_floats: int
    counter: int
    counters: int


def mma(k: Kernels, mats: Sequence[Mat], outs: Sequence[tuple[int, int]], biases: Sequence[int | None],
        x16: int, ldx16: int, n_tok: int, mode: int, scratch: SplitScratch | None = None) -> None:
    """Tensor-core version of ``mmv`` for any number of tokens: x in f16, y f32 (f32 accumulate).
    K is split over several blocks when ``scratch`` holds their partials."""
    assert 1 <= len(mats) <= 3
    kn, rows = k.knobs, [m.rows for m in mats]
    wr, nt, split, h = _mma_plan(k, rows, n_tok, mats[0].cols, 1, scratch)
    ra, st, structs = int(kn.mma_reg_a), kn.mma_stages, [m.struct for m in mats]
    fn = k.fn("matmul_mma.cu", mma_name(structs, wr, nt, mode, h, ra, st, kn.mma_min_blocks))
    args: list = []
    for i in range(3):
        if i < len(mats):
            m, (y, ldy), bias = mats[i], outs[i], biases[i]
            args += [*m.planes, i32(m.rows), ptr(y), i32(ldy), ptr(bias)]
        else:
            args += [ptr(0)] * 4 + [i32(0), ptr(0), i32(0), ptr(0)]
    args += [ptr(x16), i32(ldx16), i32(n_tok), i32(mats[0].cols)]
    part, counter = (scratch.part, scratch.counter) if split > 1 else (0, 0)
    grid = (sum(-(-n // (16 * wr * h)) for n in rows), -(-n_tok // (8 * nt * (4 // wr))), split)
    fn(grid, (128,), (*args, ptr(part), ptr(counter)),
       shared_mem=mma_smem(fn, wr, nt, h, structs, ra, mma_stages(structs, h, ra, st)))


def mma_glu(k: Kernels, gate: Mat, up: Mat, x16: int, ldx16: int, n_tok: int, act: str, y16: int, ldy16: int,
            scratch: SplitScratch | None = None) -> None:
    """y16[t, :] = f16(act(G x[t]) * (U x[t])), x in f16. Not split by the rule: with two W tiles
    per block the 8B's GLU fills the GPU unsplit, and splitting SmolLM2's made it much slower; the
    knobs' glu_split / glu_shape ask for a split / a tile shape."""
    kn = k.knobs
    wr, nt, split, _ = _mma_plan(k, [gate.rows], n_tok, 0, 2, scratch, tall=False)
    if kn.glu_shape is not None:
        wr, nt = kn.glu_shape
    if kn.glu_split > 1 and _split_fits(scratch, [gate.rows], n_tok, MmaConfig(wr, nt, kn.glu_split), 2):
        split = kn.glu_split
    ra, st = int(kn.mma_reg_a), kn.mma_stages
    if kn.mma_wgmma and ra and gate.struct == up.struct == "TQ4_K" and wr == 4 and split == 1 and hopper():
        return _glu_wgmma(k, gate, up, x16, ldx16, n_tok, act, y16, ldy16, st[1])
    fn = k.fn("matmul_mma.cu", mma_glu_name(gate.struct, wr, nt, fused_act(act), ra, st, kn.glu_min_blocks))
    part, counter = (scratch.part, scratch.counter) if split > 1 else (0, 0)
    grid = (-(-gate.rows // (16 * wr)), -(-n_tok // (8 * nt * (4 // wr))), split)
    fn(grid, (128,), (*gate.planes, *up.planes, i32(gate.rows), ptr(x16), i32(ldx16), i32(n_tok), i32(gate.cols),
                      ptr(y16), i32(ldy16), ptr(part), ptr(counter)),
       shared_mem=mma_smem(fn, wr, nt, 2, [gate.struct], ra, mma_stages([gate.struct], 2, ra, st)))
