"""Launchers of the matvec kernels (matvec.cu): one to eight tokens against up to three matrices
sharing x (fused RMSNorm, int8 activations, RoPE + KV write and int8 epilogues), and the GLU
matvec. Argument conventions and the kernel cache: launch_core.py; the per-layer kernels:
launch_layers.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .launch_core import fused_act, NO_PTRS, NO_QOUT, Q8_OUT_ROWS, UNIT_ELEMS, Kernels, Mat, Q8Vec, f32, i32, ptr
from .launch_layers import rope_kv

MAX_MMV_TOKENS = 8


# ---- name expressions ----------------------------------------------------------------------------
def mmv_name(structs: Sequence[str], b: int, r: int, wg: int, mode: int, io: int = 0) -> str:
    """io: bit 0 int8 activations in, bit 1 the q8 epilogue, bit 2 staged scales, bit 3 rests in, bit 4
    rests out, bit 5 a token grid (matvec.cu)."""
    s = list(structs) + [structs[0]] * (3 - len(structs))
    return f"mmv_group<{s[0]}, {s[1]}, {s[2]}, {b}, {r}, {wg}, {mode}, {io}>"


def glu_name(struct: str, b: int, r: int, wg: int, act: int, io: int = 0) -> str:
    return f"mmv_glu<{struct}, {b}, {r}, {wg}, {act}, {io}>"


FLOAT_STRUCTS = ("TF32", "TF16", "TBF16")


def q8_capable(mats: Sequence["Mat"]) -> bool:
    """Whether the int8-activation matvec (dp4a) handles these matrices: every quantized type."""
    return all(m.struct not in FLOAT_STRUCTS for m in mats)


NO_Q8 = (*NO_PTRS, i32(0), f32(0.0))


def block_warps(r: int, wg: int, io: int) -> int:
    """matvec.cu's block_warps: 4, or 16 * WG / R with a q8 epilogue (r: rows per group)."""
    if io & 2 and (Q8_OUT_ROWS * wg) % r:
        raise ValueError(f"a q8 epilogue needs whole row groups in its 16 rows: {r} rows per group")
    return Q8_OUT_ROWS * wg // r if io & 2 else 4


def q8_out_config(r: int, wg: int) -> tuple[int, int]:
    """(R, WG) of a residual matvec with the q8 epilogue, from its usual config: at most 2 rows per
    group (16 rows per block), at most 32 warps per block."""
    r = min(r, 2)
    return r, min(wg, 2 * r)


def mmv_config(structs: Sequence[str], rows: Sequence[int], cols: int, b: int,
               q8_out: bool = False, several: bool = False) -> tuple[int, int]:
    """(R, WG): weight rows per row group and warps per group. One warp per group was best or
    tied on every shape tried; 4 rows per group won on the large output heads (32K+ rows), 2
    elsewhere, except one row for a lone matrix of under 2,048 rows (the small models' o-proj and
    down: faster for Gemma-3, even for SmolLM2, in graphs with PDL). Every segment must hold whole
    blocks.
    q8_out (a residual matvec with the q8 epilogue): two warps per group of two rows (faster for
    the 8B's residual matvecs; one row per group, or one or two warps per row, were slower);
    for one token and rows of 128-256 units whose scales can be staged (kstage_bytes: the 8B's
    o-proj, 128 units, and Q6_K down, 224), two warps per group of four rows, 8 warps a block (a
    small gain for the 8B; with per-unit scales this shape had been slower). Its Q4_K down (448
    units: 7 rounds a warp either way) keeps two rows per two warps, faster there than four.
    several (a launch of several tokens, b being its blocks' tokens; the knobs' mmv_wide_rows):
    wider row groups with one token's WG, so each row's sums are one token's bit for bit: two rows
    for a lone matrix of under 2,048 rows (one row a group had put the small models' 8-token
    residual products in 1,024-thread blocks over two waves) and four for output heads whatever b
    (x read once for four rows). Measured: see bench/RESULTS.md."""
    head, lone = sum(rows) >= 32768, len(rows) == 1 and rows[0] < 2048
    want = 4 if head else (1 if lone and not several else 2)
    fits = [r for r in (4, 2, 1) if r <= want and (r * b <= 8 or (several and head))
            and all(n % (4 * r) == 0 for n in rows)]
    r, wg = (fits[0], 1) if fits else (1, 4)
    if q8_out:
        # two warps per row where one warp would take two rounds of loads: every lane's weights are
        # then loaded before pdl_enter (faster for SmolLM2's down, 1,536 columns; the 8B's down was
        # slower at four warps per two rows)
        if b == 1 and r == 2 and 128 <= cols // UNIT_ELEMS[structs[0]] <= 256 and kstage_bytes(structs, cols):
            return 4, 2
        # (a lone matrix's WG is its one-row groups', whatever several made of r)
        return q8_out_config(r, 2 if (r >= 2 and not lone) or cols // UNIT_ELEMS[structs[0]] > 32 else 1)
    return r, wg


def glu_config(struct: str, n: int, cols: int, b: int) -> tuple[int, int]:
    """(R, WG) of a GLU row group: one gate row and its up row per warp."""
    return (2, 1) if n % 4 == 0 else (2, 4)


def glu_q8_out_config(struct: str, n: int, cols: int, b: int, several: bool = False) -> tuple[int, int]:
    """(R, WG) of a GLU with the q8 epilogue: one gate and one up row per warp (16 WG warps a block),
    but for one token and rows of at least 128 units (the 8B's 4,096 columns), two of each per two
    warps: a small gain for the 8B; SmolLM2 and Gemma-3, one round a row, were slower with it.
    several (as mmv_config's): two of each with the one-row groups' WG, on rows under 128 units."""
    long_rows = cols // UNIT_ELEMS[struct] >= 128
    if long_rows and b == 1:
        return 4, 2
    return 4 if several and not long_rows else 2, min(glu_config(struct, n, cols, b)[1], 2)


def kstage_bytes(structs: str | Sequence[str], cols: int, rows: int = Q8_OUT_ROWS) -> int:
    """Shared memory for a block's staged scales (matvec.cu, IO bit 2; quant_staged.cuh: four float4s
    per row and superblock, for the ``rows`` rows a block stages: the GLU 2 x 16, a q8 epilogue 16);
    0 unless every matrix's type has a staged twin, the rows are long enough (KSTAGE_MIN_COLS) and
    the copy fits KSTAGE_MAX."""
    size = rows * (cols // 256) * 4 * 16
    ok = all(s in KSTAGE_STRUCTS for s in ([structs] if isinstance(structs, str) else structs))
    return size if ok and cols % 256 == 0 and KSTAGE_MIN_COLS <= cols and size <= KSTAGE_MAX else 0


def mmv_kstage_bytes(structs: Sequence[str], cols: int, r: int, wg: int, io: int) -> int:
    """kstage_bytes for an int8 (io bit 0) mmv_group launch of (R, WG) = (r, wg): its blocks' rows,
    which the kernel needs a power of two (it finds a row's slot as row % P); 0 for f32 input."""
    per_block = r * block_warps(r, wg, io) // wg
    return kstage_bytes(structs, cols, per_block) if io & 1 and per_block & (per_block - 1) == 0 else 0


def glu_kstage_bytes(structs: Sequence[str], cols: int) -> int:
    """kstage_bytes for a GLU with the q8 epilogue: 16 gate and 16 up rows a block."""
    return kstage_bytes(structs, cols, 2 * Q8_OUT_ROWS)


KSTAGE_STRUCTS = ("TQ4_K", "TQ6_K")
# Staging pays on long rows: the 8B's (4,096 and 14,336 columns) gained; Gemma-3's o-proj and down
# (1,024 and 2,048 columns) were slightly slower with it
KSTAGE_MIN_COLS = 4096
KSTAGE_MAX = 96 * 1024  # two blocks of it per SM, beside the L1 (the 8B's down: 56 KiB, its GLU 32 KiB)

MMV_TOKENS = (8, 4, 2, 1)  # compiled token counts; other counts run as a sum of these


GRID_IO = 32  # matvec.cu's IO bit of a token grid
GRID_MAX_Y = 65535  # CUDA's limit on gridDim.y (a token grid's row blocks)
# A token grid reads the weights once a token (from L2 where the blocks of the same rows run side by
# side): it pays on small matrices, whose products are latency-bound; an output head (SmolLM2's 28M
# weights, Gemma-3's 168M) reads its bytes once for all tokens instead
GRID_MAX_WEIGHTS = 1 << 23
# ... and only where its warps are resident at once (the knobs' grid_waves: 8 tokens, whose kernels
# are the slowest, may take two): past that the grid's next wave costs what the b-token kernel's
# longer chains do (SmolLM2's GLU and down with q8 epilogues, 16-32 warps a block of ~50-64
# registers: 2 and 1 blocks an SM, were slower as 4-token grids)
GRID_WARPS_PER_SM = 32


def token_grid(k: Kernels, b: int, rows: int, weights: int, r: int, wg: int, io: int, tokens: int = 0) -> int:
    """Tokens of a matvec launched as a token grid (matvec.cu: b one-token products side by side,
    grid (b, row blocks)), or 1 (chunks of compiled token counts): where the knobs' mmv_token_grid
    allows b, the ``weights`` of its matrices are at most GRID_MAX_WEIGHTS, its ``rows`` make row
    blocks within CUDA's limit on gridDim.y, and the grid's warps fit the knobs' grid_waves waves
    (b < 8 : b = 8) of GRID_WARPS_PER_SM on each of its gpu_sms SMs (0: not bounded); (r, wg) is the
    one-token shape (R rows a group of WG warps). ``tokens``: the matvec's tokens where the grid's b
    blocks carry several each (token_groups), which choose the waves instead of b."""
    nw = block_warps(r, wg, io)
    blocks = -(-rows // (r * nw // wg))
    sms = k.knobs.gpu_sms
    return (b if 1 < b <= k.knobs.mmv_token_grid and weights <= GRID_MAX_WEIGHTS and blocks <= GRID_MAX_Y
            and (not sms or b * blocks * nw <= sms * GRID_WARPS_PER_SM * k.knobs.grid_waves[(tokens or b) >= 8]) else 1)


def token_groups(k: Kernels, b: int, rows: int, weights: int, dims, io: int) -> int:
    """Groups of a matvec of b tokens launched as a token grid of b / g-token blocks side by side
    (matvec.cu, IO bit 5: grid (g, row blocks)), or 1 (no grid): one-token blocks where token_grid
    allows them, else, with the knobs' grid_groups, the fewest tokens a block (2, then 4, dividing b)
    whose grid token_grid's bounds allow (its groups counted as its tokens). ``dims(t)``: the
    (R, WG) of a t-token block, as token_grid takes them. The knobs' grid_tokens t (measuring,
    tests): blocks of t tokens wherever 1 <= t < b divides b (up to mmv_token_grid tokens)."""
    t = k.knobs.grid_tokens
    if 0 < t < b <= k.knobs.mmv_token_grid and b % t == 0:
        return b // t
    g = token_grid(k, b, rows, weights, *dims(1), io)
    if g > 1 or not k.knobs.grid_groups:
        return g
    for t in (2, 4):
        if t < b and b % t == 0 and token_grid(k, b // t, rows, weights, *dims(t), io, b) > 1:
            return b // t
    return 1


def _grid(blocks: int, tokens: int) -> tuple[int, ...]:
    return (tokens, blocks) if tokens > 1 else (blocks,)


def token_chunks(b: int) -> list[tuple[int, int]]:
    """(first row, rows) pieces of b rows, each a compiled token count."""
    out, row = [], 0
    for n in MMV_TOKENS:
        while b - row >= n:
            out.append((row, n))
            row += n
    return out


@dataclass(frozen=True)
class RopeKV:
    """The arguments of rope_kv (RoPE on the Q and K heads of fused QKV rows, K and V into the
    paged cache at pos[t]); pointers are of row 0."""

    qkv: int
    ld: int
    n_head: int
    n_head_kv: int
    head_dim: int
    head_dim_v: int
    n_rot: int
    neox: bool
    qnw: int | None
    knw: int | None
    eps: float
    inv_freq: int
    pos: int
    seq: int
    table: int
    max_pages: int
    page_size: int
    kcache: int
    vcache: int
    kv: str = "f32"  # the caches' type (kv_layout.py)
    # quantized caches: the epilogue may leave K (rotated) and V in the QKV rows for the decode
    # attention kernel to quantize into the cache (flash_decode's own); mmv says whether it did
    own: bool = False

    @property
    def fusable(self) -> bool:
        """Whether the QKV matvec's epilogue can do it (rope pairs (2i, 2i+1), no per-head norm)."""
        return (not self.neox and self.qnw is None and self.knw is None and self.head_dim == self.head_dim_v
                and self.head_dim % 2 == 0 and self.n_rot % 2 == 0
                and (self.kv in ("f32", "f16") or (self.own and self.head_dim % 32 == 0)))

    def launch(self, k: Kernels, row: int, rows: int) -> None:
        rope_kv(k, self.qkv + 4 * row * self.ld, self.ld, rows, self.n_head, self.n_head_kv, self.head_dim,
                self.head_dim_v, self.n_rot, self.neox, self.qnw, self.knw, self.eps, self.inv_freq,
                self.pos + 4 * row, self.seq + 4 * row, self.table, self.max_pages, self.page_size, self.kcache,
                self.vcache, self.kv)

    def attn_args(self) -> tuple:
        """flash_decode's arguments for doing this work itself (launch_attention.flash_decode)."""
        return (ptr(self.inv_freq), i32(self.n_rot), i32(self.neox), ptr(self.qnw), ptr(self.knw), f32(self.eps))

    def fused_args(self, row: int) -> tuple:
        return (ptr(self.pos + 4 * row), ptr(self.seq + 4 * row), ptr(self.table), i32(self.max_pages),
                i32(self.page_size), ptr(self.inv_freq), i32(self.n_rot), i32(self.head_dim), i32(self.n_head_kv),
                ptr(self.kcache), ptr(self.vcache), i32(2 if self.kv not in ("f32", "f16") else self.kv == "f16"))


NO_ROPE = (ptr(0), ptr(0), ptr(0), i32(0), i32(0), ptr(0), i32(0), i32(0), i32(0), ptr(0), ptr(0), i32(0))


def mmv(k: Kernels, mats: Sequence[Mat], outs: Sequence[tuple[int, int]], biases: Sequence[int | None],
        x: int, ldx: int, b: int, mode: int, config: tuple[int, int] | None = None,
        norm: tuple[int, float] | None = None, rope: RopeKV | None = None, q8: Q8Vec | None = None,
        q8_out: tuple[Q8Vec, int | None] | None = None, kstage: bool = False) -> bool:
    """y_i[t, :] (=|+=) W_i x[t, :] (+ bias_i) for up to 3 matrices sharing x; t < b <= 8.
    ``norm`` = (weight, eps): x is RMS-normalized first (fused, see matvec.cu).
    ``q8``: the activations are these int8 ones instead of x (dp4a; no fused norm; quantized types).
    ``q8_out`` = (buffer, w): residual mode, one matrix of rows % 16 == 0: also the int8 copy of
    the new y (times w, the next RMSNorm's weight, when given) into buffer.
    ``rope``: the outputs are Q, K, V rows, and RoPE + the KV-cache write follow: fused into the
    epilogue where the row groups are rope pairs (R = 2; one warp on the f32 path: the tested shapes),
    else a rope_kv launch.
    ``config`` = (R, WG) overrides the automatic choice (the tuning table's ``mmv``, to measure).
    ``kstage``: with q8, each block's scales staged in shared memory where kstage_bytes allows.
    Returns whether every chunk's epilogue did ``rope`` (else rope_kv launches did)."""
    assert 1 <= len(mats) <= 3 and 1 <= b <= MAX_MMV_TOKENS
    assert q8 is None or (norm is None and q8_capable(mats))
    assert q8_out is None or (q8 is not None and mode == 1 and len(mats) == 1 and mats[0].rows % Q8_OUT_ROWS == 0)
    cols = mats[0].cols
    total = sum(m.rows for m in mats)
    io = (q8 is not None) | (q8_out is not None) << 1 | (q8.io() if q8 else 0) | (q8_out[0].io(True) if q8_out else 0)
    chunks = []

    def shape(n: int) -> tuple[int, int]:
        r, wg = config or mmv_config([m.struct for m in mats], [m.rows for m in mats], cols, n, q8_out is not None,
                                     b > 1 and k.knobs.mmv_wide_rows)
        if q8_out and config:  # an override (mmv_config's own choice fits): up to 8 rows, 32 warps a block
            r = min(r, 8)
            wg = min(wg, 2 * r)
        return r, wg

    grid = token_groups(k, b, total, total * cols, shape, io)
    for row, n in [(0, b // grid)] if grid > 1 else token_chunks(b):
        r, wg = shape(n)
        # RoPE in the epilogue: rope pairs in one group (R = 2); the f32 path is tested at one warp
        fused = (rope is not None and mode == 0 and r == 2 and (wg == 1 or q8 is not None) and rope.fusable
                 and len(mats) == 3)
        chunks.append((row, n, r, wg, fused))
    all_fused = rope is not None and all(c[4] for c in chunks)
    for row, n, r, wg, fused in chunks:
        fused = fused and (all_fused or not rope.own)  # own: every row's cache write in one place
        nw = block_warps(r, wg, io)
        per_block = r * nw // wg
        smem = mmv_kstage_bytes([m.struct for m in mats], cols, r, wg, io) if kstage else 0
        fn = k.fn("matvec.cu", mmv_name([m.struct for m in mats], n, r, wg, mode,
                                        io | bool(smem) << 2 | (GRID_IO if grid > 1 else 0)))
        fn.allow_smem(smem)
        args: list = []
        for i in range(3):
            if i < len(mats):
                m, (y, ldy), bias = mats[i], outs[i], biases[i]
                args += [*m.planes, i32(m.rows), ptr(y + 4 * row * ldy), i32(ldy), ptr(bias)]
            else:
                args += [ptr(0)] * 4 + [i32(0), ptr(0), i32(0), ptr(0)]
        fn(_grid((total + per_block - 1) // per_block, grid), (32 * nw,),
           (*args, ptr(x + 4 * row * ldx), i32(ldx), i32(cols), *_norm_args(norm),
            *(q8.args(row) if q8 else NO_Q8), *(q8_out[0].out_args(row, q8_out[1]) if q8_out else NO_QOUT),
            *(rope.fused_args(row) if fused else NO_ROPE)), shared_mem=smem)
        if rope is not None and not fused:
            rope.launch(k, row, n * grid)
    return all_fused


def _norm_args(norm: tuple[int, float] | None) -> tuple[np.uint64, np.float32]:
    return (ptr(norm[0]), f32(norm[1])) if norm else (ptr(0), f32(0.0))


def mmv_glu(k: Kernels, gate: Mat, up: Mat, x: int, ldx: int, b: int, act: str, y: int, ldy: int,
            norm: tuple[int, float] | None = None, q8: Q8Vec | None = None, q8_out: Q8Vec | None = None,
            config: tuple[int, int] | None = None, kstage: bool = False) -> None:
    """y[t, :] = act(G x'[t]) * (U x'[t]) for t < b <= 8; x' = x, or rmsnorm(x) with ``norm``, or
    the int8 activations ``q8``; ``q8_out`` (rows % 16 == 0): also y's int8 copy. ``config`` =
    (R, WG) overrides glu_config / glu_q8_out_config (to measure). ``kstage``: with q8 and q8_out,
    each block's scales staged in shared memory where kstage_bytes allows."""
    assert q8 is None or (norm is None and q8_capable([gate, up]))
    assert q8_out is None or (q8 is not None and gate.rows % Q8_OUT_ROWS == 0)
    io = (q8 is not None) | (q8_out is not None) << 1 | (q8.io() if q8 else 0) | (q8_out.io(True) if q8_out else 0)
    smem = glu_kstage_bytes([gate.struct, up.struct], gate.cols) if kstage and io & 3 == 3 else 0
    io |= bool(smem) << 2

    def shape(n: int) -> tuple[int, int]:
        r, wg = config or (glu_q8_out_config(gate.struct, gate.rows, gate.cols, n, b > 1 and k.knobs.mmv_wide_rows)
                           if q8_out else glu_config(gate.struct, gate.rows, gate.cols, n))
        if q8_out and config:  # an override: up to 4 gate and 4 up rows per group, 32 warps per block
            r, wg = min(r, 8), min(wg, 2)
        return r, wg

    grid = token_groups(k, b, gate.rows, 2 * gate.rows * gate.cols, lambda t: (shape(t)[0] // 2, shape(t)[1]), io)
    for row, n in [(0, b // grid)] if grid > 1 else token_chunks(b):
        r, wg = shape(n)
        nw = block_warps(r // 2, wg, io)
        per_block = (r // 2) * nw // wg
        fn = k.fn("matvec.cu", glu_name(gate.struct, n, r, wg, fused_act(act), io | (GRID_IO if grid > 1 else 0)))
        fn.allow_smem(smem)
        fn(_grid((gate.rows + per_block - 1) // per_block, grid), (32 * nw,),
           (*gate.planes, *up.planes, i32(gate.rows), ptr(x + 4 * row * ldx), i32(ldx), i32(gate.cols),
            ptr(y + 4 * row * ldy), i32(ldy), *_norm_args(norm), *(q8.args(row) if q8 else NO_Q8),
            *(q8_out.out_args(row, None) if q8_out else NO_QOUT)), shared_mem=smem)
