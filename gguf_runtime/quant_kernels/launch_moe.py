"""Launchers of moe.cu: the router's top-k and the chosen experts' products (conventions in
launch_core.py). ``slots`` = tokens x experts a token; slot s is token s // k's rank s % k expert.
A stacked expert matrix is one ``Mat`` of n_expert * n rows; ``n`` is one expert's rows."""

from __future__ import annotations

from dataclasses import dataclass

from .launch_core import (ACT, fused_act, NO_PTRS, NO_QOUT, Q8_OUT_ROWS, UNIT_ELEMS, Kernels, Mat, Q8Vec, f32, i32,
                          ptr)
from .launch_mma import mma_smem, mma_stages

MAX_EXPERTS = 256  # moe.cu's MOE_MAX_EXPERTS
MAX_USED = 32  # experts a token: one lane each in moe_topk
WARPS = 4  # moe.cu's MOE_WARPS
NO_Q8 = (*NO_PTRS, i32(0), f32(0.0))


def _norm_args(norm: tuple[int, float] | None) -> tuple:
    """An RMSNorm the kernel applies to its input (weight, eps), or none."""
    return (ptr(norm[0]), f32(norm[1])) if norm else (ptr(0), f32(0.0))


def _x_args(x: int, ldx: int, norm: tuple[int, float] | None, q8: Q8Vec | None, with_norm: bool = True) -> tuple:
    head = (ptr(x), i32(ldx))
    if with_norm:
        head += _norm_args(norm)
    return (*head, *(q8.args() if q8 else NO_Q8))


def _io(q8: Q8Vec | None) -> int:
    return (1 | q8.io()) if q8 is not None else 0


@dataclass(frozen=True)
class TopK:
    """The router's top-k done by the expert GLU (glu's topk): logits [rows, ld] f32, n_expert of
    them a token, the chosen ones renormalized where renorm, bias (gpt-oss's router bias) or 0; w:
    the weights' buffer (ids: glu's own)."""
    logits: int
    ld: int
    n_expert: int
    renorm: bool
    w: int
    bias: int = 0

    def args(self) -> tuple:
        return (ptr(self.logits), i32(self.ld), i32(self.n_expert), ptr(self.bias), i32(self.renorm), ptr(self.w))


NO_TOPK = TopK(0, 0, 0, False, 0)


def topk(k: Kernels, logits: int, ld: int, n_expert: int, used: int, renorm: bool, rows: int, ids: int,
         w: int, bias: int = 0) -> None:
    """ids[t, :used], w[t, :used] = the used most probable experts of token t and their router
    probabilities (renormalized over them with ``renorm``); bias: n_expert f32 added to every
    token's logits first (gpt-oss's router bias), or 0."""
    assert 1 <= used <= min(n_expert, MAX_USED) and n_expert <= MAX_EXPERTS
    per_block = 4
    k.fn("moe.cu", "moe_topk")((-(-rows // per_block),), (32 * per_block,),
                               (ptr(logits), i32(ld), ptr(bias), i32(n_expert), i32(used), i32(renorm), i32(rows),
                                ptr(ids), ptr(w)))


def mv(k: Kernels, m: Mat, n: int, ids: int | None, used: int, x: int, ldx: int, slots: int, y: int, ldy: int,
       norm: tuple[int, float] | None = None, q8: Q8Vec | None = None, r: int = 2, wg: int = 1) -> None:
    """y[s, :n] = W_e x'[s // used] (e = ids[s]; ids None: the matrix itself, e.g. the router);
    (r, wg): rows and warps a row group."""
    fn = k.fn("moe.cu", f"moe_mv<{m.struct}, {r}, {wg}, {_io(q8)}>")
    fn(((-(-n // (r * WARPS // wg))), slots), (32 * WARPS,),
       (*m.planes, i32(n), i32(m.cols), ptr(ids), i32(used), *_x_args(x, ldx, norm, q8), ptr(y), i32(ldy)))


ROUTER = (1, 4)  # (rows, warps) a row group of the router: one row a block (few rows, long f32 ones)
ROUTER_TILE = 8  # tokens a block of the router past the matvec rows


def router(k: Kernels, m: Mat, x: int, ldx: int, rows: int, y: int, ldy: int,
           norm: tuple[int, float] | None = None) -> None:
    """y[t, :n] = W x'[t] for t < rows (W the F32 router of n = m.rows experts): one token a block up
    to ROUTER_TILE rows (mv), tiles of ROUTER_TILE tokens above; a quantized router (legal, if rare:
    llama-quantize keeps it F32) one token a block at every row count."""
    if rows <= ROUTER_TILE or m.struct != "TF32":
        mv(k, m, m.rows, None, 1, x, ldx, rows, y, ldy, norm=norm, r=ROUTER[0], wg=ROUTER[1])
        return
    r, wg = ROUTER
    fn = k.fn("moe.cu", f"moe_router<{r}, {wg}, {ROUTER_TILE}>")
    fn(((-(-m.rows // (r * WARPS // wg))), -(-rows // ROUTER_TILE)), (32 * WARPS,),
       (*m.planes, i32(m.rows), i32(m.cols), i32(rows), ptr(x), i32(ldx),
        *_norm_args(norm), ptr(y), i32(ldy)))


def router_topk(k: Kernels, m: Mat, x: int, ldx: int, rows: int, y: int, ldy: int, used: int, renorm: bool,
                ids: int, w: int, counters: int, norm: tuple[int, float] | None = None) -> None:
    """router (y[t, :n] = W x'[t], up to ROUTER_TILE tokens) and topk over its logits in one launch:
    the block that finishes a token's logits last picks its experts; counters: ROUTER_TILE uint32,
    zero between calls (each token's last block puts its own back)."""
    n = m.rows
    assert rows <= ROUTER_TILE and m.struct == "TF32" and 1 <= used <= min(n, MAX_USED) and n <= MAX_EXPERTS
    r, wg = ROUTER
    fn = k.fn("moe.cu", f"moe_router_topk<{r}, {wg}>")
    fn(((-(-n // (r * WARPS // wg))), rows), (32 * WARPS,),
       (*m.planes, i32(n), i32(m.cols), ptr(x), i32(ldx),
        *_norm_args(norm), ptr(y), i32(ldy), i32(used), i32(renorm),
        ptr(ids), ptr(w), ptr(counters)))


def glu_blocks(n: int, slots: int, r: int) -> int:
    """Blocks of glu's launch: r / 2 gate and up rows a warp over n rows, for each slot."""
    return -(-n // (r // 2 * WARPS)) * slots


def glu(k: Kernels, gate: Mat, up: Mat, n: int, ids: int, used: int, x: int, ldx: int, slots: int, act: str,
        y: int, ldy: int, norm: tuple[int, float] | None = None, q8: Q8Vec | None = None, r: int = 4,
        q8_out: Q8Vec | None = None, biases: tuple[int, int] = (0, 0), mb: int = 1,
        topk: TopK | None = None) -> None:
    """y[s, :n] = act(G_e x'[s // used] + bg_e) * (U_e x'[s // used] + bu_e), e = ids[s] (gate and
    up of one type; biases (bg, bu): the experts' [n_expert, n] f32 rows, or 0, 0); act also gpt-oss's
    "swiglu_oai"; q8_out (r = 8: 16 rows a block; n % 16 == 0): y's int8 copy too, row s of it for slot s;
    mb: blocks an SM its registers must allow (launch bounds; 1: the compiler's choice). topk: the
    kernel picks the experts itself, as topk() would (no launch of it before), and writes ids and
    topk.w for the down."""
    assert gate.type_id == up.type_id and gate.cols == up.cols
    assert topk is None or (1 <= used <= min(topk.n_expert, MAX_USED) and topk.n_expert <= MAX_EXPERTS)
    io = _io(q8)
    if q8_out is not None:
        assert r // 2 * WARPS == 16 and n % 16 == 0
        io |= 2 | q8_out.io(True)
    fn = k.fn("moe.cu", f"moe_glu<{gate.struct}, {r}, 1, {ACT[act]}, {io}, {mb}>")
    fn((glu_blocks(n, 1, r), slots), (32 * WARPS,),
       (*gate.planes, *up.planes, i32(n), i32(gate.cols), ptr(ids), i32(used), *_x_args(x, ldx, norm, q8),
        ptr(y), i32(ldy), *(q8_out.ptrs() if q8_out is not None else (ptr(0), i32(0), ptr(0), i32(0), i32(0))),
        ptr(biases[0]), ptr(biases[1]), *(topk or NO_TOPK).args()))


DOWN_SUB = 16  # lanes of a sub-warp row set (moe.cu's moe_down SUB)
DOWN_Q8_OUT_R = 4  # down's rows a sub-warp set with a q8 epilogue (its Q8_OUT_ROWS a block: two row groups)


def down_sub(m: Mat, q8: Q8Vec | None) -> bool:
    """Whether down may take sub-warp row sets: int8 inputs and rows of at most DOWN_SUB units."""
    return q8 is not None and m.cols // UNIT_ELEMS[m.struct] <= DOWN_SUB


def down(k: Kernels, m: Mat, n: int, ids: int, w: int, used: int, x: int, ldx: int, rows: int, y: int, ldy: int,
         q8: Q8Vec | None = None, r: int = 2, bias: int = 0, mb: int = 1, sub: bool = False,
         q8_out: tuple[Q8Vec, int] | None = None) -> None:
    """y[t, :n] += sum_j w[t, j] (W_e x'[t * used + j] + b_e) (e = ids[t, j]; bias: the experts'
    [n_expert, n] f32 rows, or 0): the residual add of the experts; r rows a block, one warp a rank
    (up to 8 at once); mb as glu's. sub (where down_sub allows): each warp's lanes in two sets of
    DOWN_SUB, each on r rows of the block's 2 r. q8_out = (buffer, the next RMSNorm's weight): the
    new y rows' int8 copy times that weight, with their squares (n % 16 == 0; a block then takes 16
    rows, as row groups of its warps' r x sets), row t of the buffer for row t of y."""
    kw = min(8, 1 << (used - 1).bit_length())
    sets = 32 // DOWN_SUB if sub and down_sub(m, q8) else 1
    io, rg = _io(q8), 1
    if q8_out is not None:
        rg = Q8_OUT_ROWS // (r * sets)
        assert rg * r * sets == Q8_OUT_ROWS and n % Q8_OUT_ROWS == 0 and sets > 1, (r, sets, n)
        io |= 2 | q8_out[0].io(True)
        mb = max(1, mb // rg)  # (the same registers a thread as rg blocks of r x sets rows)
    targs = [m.struct, r, kw, io, mb] + ([DOWN_SUB] if sets > 1 else []) + ([rg] if rg > 1 else [])
    fn = k.fn("moe.cu", f"moe_down<{', '.join(map(str, targs))}>")
    fn(((-(-n // (r * sets * rg))), rows), (32 * kw * rg,),
       (*m.planes, i32(n), i32(m.cols), ptr(ids), ptr(w), i32(used), *_x_args(x, ldx, None, q8, with_norm=False),
        ptr(y), i32(ldy), ptr(bias), *(q8_out[0].out_args(0, q8_out[1]) if q8_out is not None else NO_QOUT)))


# ---- grouped by expert: moe.cu's sort and sum, moe_mma.cu's tensor-core tiles ---------------------
MMA_WR = 4  # warps along the rows: 64 rows a block, every warp on all of the tile's slots
MIN_TILE = 8  # the fewest slots a tile: one 8-column MMA


def max_tiles(slots: int, n_expert: int, mt: int = MIN_TILE) -> int:
    """Tiles of up to mt slots moe_sort can list for ``slots`` slots: each expert's last tile may be
    partial."""
    return -(-slots // mt) + n_expert


def sort(k: Kernels, ids: int, slots: int, n_expert: int, pos: int, order: int, tiles: int, mt: int) -> None:
    """order = the slots grouped by expert; tiles = {expert, start, count} of up to mt slots each
    (max_tiles entries, the unused ones with count 0)."""
    k.fn("moe.cu", "moe_sort")((1,), (1024,), (ptr(ids), i32(slots), i32(n_expert), i32(mt),
                                               i32(max_tiles(slots, n_expert, mt)), ptr(pos), ptr(order), ptr(tiles)))


def mma_tile_slots(slots: int, n_expert: int, fixed: int = 0) -> int:
    """Slots a tensor-core tile (8, 16, 32 or 64): ``fixed``, else the power of two that holds twice
    an expert's mean share (few padded columns where each expert has few slots; where they have
    many, the widest tiles read each expert's weights least often: bench/RESULTS.md, the MoE
    section's tile-size table)."""
    if fixed:
        assert fixed in (8, 16, 32, 64)
        return fixed
    avg = -(-2 * slots // n_expert)
    return min(64, max(MIN_TILE, 1 << (avg - 1).bit_length()))


def gather_f16(k: Kernels, h: int, ldh: int, order: int, used: int, n: int, xs16: int, ldxs: int, slots: int) -> None:
    """xs16[i] = f16(h[order[i] // used]): each slot's token row in expert order, in f16 (n % 4 == 0)."""
    assert n % 4 == 0
    k.fn("moe_mma.cu", "moe_gather_f16")((slots,), (128,), (ptr(h), i32(ldh), ptr(order), i32(used), i32(n),
                                                            ptr(xs16), i32(ldxs), i32(slots)))


def _mma_fn(k: Kernels, name: str, struct: str, n_mats: int, tb: int, *extra: int):
    nt, ra = tb // 8, int(k.knobs.mma_reg_a)
    st = mma_stages([struct], n_mats, ra, k.knobs.mma_stages)
    fn = k.fn("moe_mma.cu", f"{name}<{struct}, {MMA_WR}, {nt}, {''.join(f'{e}, ' for e in extra)}{ra}, {st}>")
    return fn, mma_smem(fn, MMA_WR, nt, n_mats, [struct], ra, st)


def glu_mma(k: Kernels, gate: Mat, up: Mat, n: int, tiles: int, n_tiles: int, x16: int, ldx: int, act: str,
            y16: int, ldy: int, tb: int) -> None:
    """y16[i] = f16(act(G_e x16[i]) * (U_e x16[i])) for the sorted slots i of each tile of up to tb
    slots (sort's mt), e: the tile's expert."""
    assert gate.type_id == up.type_id and gate.cols == up.cols
    fn, smem = _mma_fn(k, "moe_mma_glu", gate.struct, 2, tb, fused_act(act))
    fn((-(-n // (16 * MMA_WR)), n_tiles), (128,),
       (*gate.planes, *up.planes, i32(n), ptr(tiles), ptr(x16), i32(ldx), i32(gate.cols), ptr(y16), i32(ldy)),
       shared_mem=smem)


def down_mma(k: Kernels, m: Mat, n: int, tiles: int, n_tiles: int, order: int, x16: int, ldx: int, ys: int,
             ldys: int, tb: int) -> None:
    """ys[order[i]] = W_e x16[i] for the sorted slots i of each tile: back in slot order."""
    fn, smem = _mma_fn(k, "moe_mma_down", m.struct, 1, tb)
    fn((-(-n // (16 * MMA_WR)), n_tiles), (128,),
       (*m.planes, i32(n), ptr(tiles), ptr(order), ptr(x16), i32(ldx), i32(m.cols), ptr(ys), i32(ldys)),
       shared_mem=smem)


def combine(k: Kernels, ys: int, ldys: int, w: int, used: int, x: int, ldx: int, n: int, rows: int) -> None:
    """x[t] += sum_j w[t, j] ys[t * used + j] in rank order."""
    k.fn("moe.cu", "moe_combine")((-(-n // 256), rows), (256,), (ptr(ys), i32(ldys), ptr(w), i32(used), ptr(x),
                                                                i32(ldx), i32(n), i32(rows)))


def add_bias(k: Kernels, y: int, ldy: int, b: int, ids: int, n: int, slots: int) -> None:
    """y[s, :n] += b[ids[s], :n] (b: the experts' [n_expert, n] f32 biases; gpt-oss)."""
    k.fn("moe.cu", "moe_add_bias")((-(-n // 256), slots), (256,), (ptr(y), i32(ldy), ptr(b), ptr(ids), i32(n),
                                                                   i32(slots)))
