"""Thin typed launchers for the kernels in this folder (NVRTC through ``cupy.RawModule``).

Every launcher takes device pointers as ints and sizes as ints, converts them to the exact C
types, and launches on CuPy's current stream, so launches can be recorded by stream capture.
Modules compile once per set of kernel names (CuPy caches the binaries on disk).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import cupy as cp
import numpy as np

from . import pdl
from .formats import FORMATS
from .sources import SRC_DIR, source

OPTIONS = ("-std=c++17", f"-I{SRC_DIR}")
TYPE_STRUCT = {"F32": "TF32", "F16": "TF16", "BF16": "TBF16", "Q4_0": "TQ4_0", "Q4_1": "TQ4_1",
               "Q5_0": "TQ5_0", "Q5_1": "TQ5_1", "Q8_0": "TQ8_0", "Q2_K": "TQ2_K", "Q3_K": "TQ3_K",
               "Q4_K": "TQ4_K", "Q5_K": "TQ5_K", "Q6_K": "TQ6_K"}
UNIT_ELEMS = {"TF32": 16, "TF16": 16, "TBF16": 16, "TQ4_0": 32, "TQ4_1": 32, "TQ5_0": 32, "TQ5_1": 32,
              "TQ8_0": 32, "TQ2_K": 64, "TQ3_K": 64, "TQ4_K": 32, "TQ5_K": 32, "TQ6_K": 64}
MAX_MMV_TOKENS = 8
SMEM_DEFAULT_MAX = 48 * 1024  # dynamic shared memory per block beyond this needs the kernel's opt-in
ACT = {"silu": 0, "gelu_tanh": 1}


def i32(v: int) -> np.int32:
    return np.int32(v)


def f32(v: float) -> np.float32:
    return np.float32(v)


def ptr(v) -> np.uint64:
    """A device pointer argument from an int, a cupy array or None (null)."""
    if v is None:
        return np.uint64(0)
    if isinstance(v, cp.ndarray):
        return np.uint64(v.data.ptr)
    return np.uint64(int(v))


@dataclass(frozen=True)
class Mat:
    """A repacked matrix on the device: plane pointers (0 when absent), shape, type."""

    type_id: int
    rows: int
    cols: int
    qs: int
    qh: int = 0
    sc: int = 0
    d: int = 0

    @property
    def struct(self) -> str:
        return TYPE_STRUCT[FORMATS[self.type_id].name]

    @property
    def planes(self) -> tuple[np.uint64, ...]:
        return (ptr(self.qs), ptr(self.qh), ptr(self.sc), ptr(self.d))


class Kernels:
    """Compiled kernels; names are C++ name expressions, e.g. ``embed_rows<TQ8_0>``."""

    def __init__(self) -> None:
        self._modules: dict[tuple[str, tuple[str, ...]], cp.RawModule] = {}
        self._fns: dict[tuple[str, str], "_Counted"] = {}
        self.launches = 0  # kernel launches issued from the host so far
        self.timeline: list | None = None  # when a list: (name, start event, end event) per launch
        self.pdl = False  # launch with programmatic dependent launch (pdl.py); set around graph capture

    def prepare(self, filename: str, names: Sequence[str]) -> None:
        """Compile ``names`` of ``filename`` in one NVRTC pass (templates need their names)."""
        todo = tuple(sorted({n for n in names if (filename, n) not in self._fns}))
        if not todo:
            return
        templates = tuple(n for n in todo if "<" in n)
        mod = cp.RawModule(code=source(filename), options=OPTIONS, name_expressions=templates or None)
        mod.compile()
        self._modules[(filename, todo)] = mod
        for n in todo:
            self._fns[(filename, n)] = _Counted(mod.get_function(n), self, n)

    def fn(self, filename: str, name: str) -> "_Counted":
        f = self._fns.get((filename, name))
        if f is None:
            self.prepare(filename, [name])
            f = self._fns[(filename, name)]
        return f


class _Counted:
    """A kernel that counts its launches on its Kernels (to prove graph replay launches none)."""

    __slots__ = ("kernel", "owner", "name", "smem_max")

    def __init__(self, kernel: cp.RawKernel, owner: Kernels, name: str) -> None:
        self.kernel, self.owner, self.name = kernel, owner, name
        self.smem_max = SMEM_DEFAULT_MAX  # dynamic shared memory the kernel is allowed

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        self.owner.launches += 1
        tl = self.owner.timeline
        if self.owner.pdl and tl is None:
            pdl.launch(self.kernel.kernel.ptr, grid, block, args, shared_mem, cp.cuda.get_current_stream().ptr)
            return
        if tl is None:
            self.kernel(grid, block, args, shared_mem=shared_mem)
            return
        start, end = cp.cuda.Event(), cp.cuda.Event()  # profiling only (bench/profile_step.py)
        start.record()
        self.kernel(grid, block, args, shared_mem=shared_mem)
        end.record()
        tl.append((self.name, start, end))


# ---- name expressions ----------------------------------------------------------------------------
def mmv_name(structs: Sequence[str], b: int, r: int, wg: int, mode: int, io: int = 0) -> str:
    """io: bit 0 int8 activations in, bit 1 the q8 epilogue (matvec.cu)."""
    s = list(structs) + [structs[0]] * (3 - len(structs))
    return f"mmv_group<{s[0]}, {s[1]}, {s[2]}, {b}, {r}, {wg}, {mode}, {io}>"


def glu_name(struct: str, b: int, r: int, wg: int, act: int, io: int = 0) -> str:
    return f"mmv_glu<{struct}, {b}, {r}, {wg}, {act}, {io}>"


FLOAT_STRUCTS = ("TF32", "TF16", "TBF16")


def q8_capable(mats: Sequence["Mat"]) -> bool:
    """Whether the int8-activation matvec (dp4a) handles these matrices: every quantized type."""
    return all(m.struct not in FLOAT_STRUCTS for m in mats)


@dataclass(frozen=True)
class Q8Vec:
    """Int8 activations of up to MAX_MMV_TOKENS rows (quant_int8.cuh): q int8 [rows, ldq] and
    (d, s, sum of squares, 0) float quads [rows, lds] per 16 columns; pointers are of row 0.
    norm_eps (as an input): the pieces are of x * w, written by a q8 epilogue for the RMSNorm
    that the matvec then applies (matvec_block.cuh)."""

    q: int
    ldq: int
    s: int
    lds: int
    norm_eps: float | None = None

    def rows_from(self, row: int) -> "Q8Vec":
        return Q8Vec(self.q + row * self.ldq, self.ldq, self.s + 16 * row * self.lds, self.lds, self.norm_eps)

    def ptrs(self, row: int = 0) -> tuple:
        """(q, ldq, s, lds) from token ``row``: the buffer arguments of every kernel."""
        return (ptr(self.q + row * self.ldq), i32(self.ldq), ptr(self.s + 16 * row * self.lds), i32(self.lds))

    def args(self, row: int = 0) -> tuple:
        """As a matvec's input: the buffer, whether to normalize, eps."""
        eps = self.norm_eps
        return (*self.ptrs(row), i32(eps is not None), f32(eps or 0.0))

    def out_args(self, row: int, w: int | None) -> tuple:
        """As a q8 epilogue's output: the buffer and the next norm's weight (or null)."""
        return (*self.ptrs(row), ptr(w))


NO_PTRS = (ptr(0), i32(0), ptr(0), i32(0))
NO_Q8 = (*NO_PTRS, i32(0), f32(0.0))
NO_QOUT = (*NO_PTRS, ptr(0))
Q8_OUT_ROWS = 16  # rows per block of a q8 epilogue (16 * WG / R warps: block_warps)


def block_warps(r: int, wg: int, io: int) -> int:
    """matvec.cu's block_warps: 4, or 16 * WG / R with a q8 epilogue (r: rows per group)."""
    return Q8_OUT_ROWS * wg // r if io & 2 else 4


def q8_out_config(r: int, wg: int) -> tuple[int, int]:
    """(R, WG) of a residual matvec with the q8 epilogue, from its usual config: at most 2 rows per
    group (16 rows per block), at most 32 warps per block."""
    r = min(r, 2)
    return r, min(wg, 2 * r)


def mmv_config(structs: Sequence[str], rows: Sequence[int], cols: int, b: int,
               q8_out: bool = False) -> tuple[int, int]:
    """(R, WG): weight rows per row group and warps per group. One warp per group measured best or
    tied on every shape swept (bench/matvec_variants.py, H100, 2026-11-21); 4 rows per group won on
    the large output heads (32K+ rows), 2 elsewhere, except one row for a lone matrix of under
    2,048 rows (the small models' o-proj and down: Gemma-3 tg128 1,450 -> 1,507, SmolLM2 even,
    bench/mmv_configs.py in graphs with PDL). Every segment must hold whole blocks.
    q8_out (a residual matvec with the q8 epilogue): two warps per group of two rows (8B tg128
    405 -> 431 t/s; one row per group, or one or two warps per row: 388-395; H100, 2026-11-21)."""
    want = 4 if sum(rows) >= 32768 else (1 if len(rows) == 1 and rows[0] < 2048 else 2)
    fits = [r for r in (4, 2, 1) if r <= want and r * b <= 8 and all(n % (4 * r) == 0 for n in rows)]
    r, wg = (fits[0], 1) if fits else (1, 4)
    if q8_out:
        # two warps per row where one warp would take two rounds of loads: every lane's weights are
        # then loaded before pdl_enter (SmolLM2's down, 1,536 columns: tg128 2,204 -> 2,353; the 8B's
        # down at four warps per two rows lost, 445 -> 426; H100, 2026-11-21)
        return q8_out_config(r, 2 if r >= 2 or cols // UNIT_ELEMS[structs[0]] > 32 else 1)
    return r, wg


def glu_config(struct: str, n: int, cols: int, b: int) -> tuple[int, int]:
    """(R, WG) of a GLU row group: one gate row and its up row per warp."""
    return (2, 1) if n % 4 == 0 else (2, 4)


MMV_TOKENS = (8, 4, 2, 1)  # compiled token counts; other counts run as a sum of these


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

    @property
    def fusable(self) -> bool:
        """Whether the QKV matvec's epilogue can do it (rope pairs (2i, 2i+1), no per-head norm)."""
        return (not self.neox and self.qnw is None and self.knw is None and self.head_dim == self.head_dim_v
                and self.head_dim % 2 == 0 and self.n_rot % 2 == 0)

    def launch(self, k: Kernels, row: int, rows: int) -> None:
        rope_kv(k, self.qkv + 4 * row * self.ld, self.ld, rows, self.n_head, self.n_head_kv, self.head_dim,
                self.head_dim_v, self.n_rot, self.neox, self.qnw, self.knw, self.eps, self.inv_freq,
                self.pos + 4 * row, self.seq + 4 * row, self.table, self.max_pages, self.page_size, self.kcache,
                self.vcache)

    def fused_args(self, row: int) -> tuple:
        return (ptr(self.pos + 4 * row), ptr(self.seq + 4 * row), ptr(self.table), i32(self.max_pages),
                i32(self.page_size), ptr(self.inv_freq), i32(self.n_rot), i32(self.head_dim), i32(self.n_head_kv),
                ptr(self.kcache), ptr(self.vcache))


NO_ROPE = (ptr(0), ptr(0), ptr(0), i32(0), i32(0), ptr(0), i32(0), i32(0), i32(0), ptr(0), ptr(0))


def mmv(k: Kernels, mats: Sequence[Mat], outs: Sequence[tuple[int, int]], biases: Sequence[int | None],
        x: int, ldx: int, b: int, mode: int, config: tuple[int, int] | None = None,
        norm: tuple[int, float] | None = None, rope: RopeKV | None = None, q8: Q8Vec | None = None,
        q8_out: tuple[Q8Vec, int | None] | None = None) -> None:
    """y_i[t, :] (=|+=) W_i x[t, :] (+ bias_i) for up to 3 matrices sharing x; t < b <= 8.
    ``norm`` = (weight, eps): x is RMS-normalized first (fused, see matvec.cu).
    ``q8``: the activations are these int8 ones instead of x (dp4a; no fused norm; quantized types).
    ``q8_out`` = (buffer, w): residual mode, one matrix of rows % 16 == 0: also the int8 copy of
    the new y (times w, the next RMSNorm's weight, when given) into buffer.
    ``rope``: the outputs are Q, K, V rows, and RoPE + the KV-cache write follow: fused into the
    epilogue where the row groups are rope pairs (R = 2; one warp on the f32 path: the tested shapes),
    else a rope_kv launch.
    ``config`` = (R, WG) overrides the automatic choice (bench/matvec_variants.py)."""
    assert 1 <= len(mats) <= 3 and 1 <= b <= MAX_MMV_TOKENS
    assert q8 is None or (norm is None and q8_capable(mats))
    assert q8_out is None or (q8 is not None and mode == 1 and len(mats) == 1 and mats[0].rows % Q8_OUT_ROWS == 0)
    cols = mats[0].cols
    total = sum(m.rows for m in mats)
    io = (q8 is not None) | (q8_out is not None) << 1
    for row, n in token_chunks(b):
        r, wg = config or mmv_config([m.struct for m in mats], [m.rows for m in mats], cols, n, q8_out is not None)
        if q8_out:
            r, wg = q8_out_config(r, wg)
        # RoPE in the epilogue: rope pairs in one group (R = 2); the f32 path is tested at one warp
        fused = (rope is not None and mode == 0 and r == 2 and (wg == 1 or q8 is not None) and rope.fusable
                 and len(mats) == 3)
        fn = k.fn("matvec.cu", mmv_name([m.struct for m in mats], n, r, wg, mode, io))
        args: list = []
        for i in range(3):
            if i < len(mats):
                m, (y, ldy), bias = mats[i], outs[i], biases[i]
                args += [*m.planes, i32(m.rows), ptr(y + 4 * row * ldy), i32(ldy), ptr(bias)]
            else:
                args += [ptr(0)] * 4 + [i32(0), ptr(0), i32(0), ptr(0)]
        nw = block_warps(r, wg, io)
        per_block = r * nw // wg
        fn(((total + per_block - 1) // per_block,), (32 * nw,),
           (*args, ptr(x + 4 * row * ldx), i32(ldx), i32(cols), *_norm_args(norm),
            *(q8.args(row) if q8 else NO_Q8), *(q8_out[0].out_args(row, q8_out[1]) if q8_out else NO_QOUT),
            *(rope.fused_args(row) if fused else NO_ROPE)))
        if rope is not None and not fused:
            rope.launch(k, row, n)


def _norm_args(norm: tuple[int, float] | None) -> tuple[np.uint64, np.float32]:
    return (ptr(norm[0]), f32(norm[1])) if norm else (ptr(0), f32(0.0))


def mmv_glu(k: Kernels, gate: Mat, up: Mat, x: int, ldx: int, b: int, act: str, y: int, ldy: int,
            norm: tuple[int, float] | None = None, q8: Q8Vec | None = None, q8_out: Q8Vec | None = None) -> None:
    """y[t, :] = act(G x'[t]) * (U x'[t]) for t < b <= 8; x' = x, or rmsnorm(x) with ``norm``, or
    the int8 activations ``q8``; ``q8_out`` (rows % 16 == 0): also y's int8 copy."""
    assert q8 is None or (norm is None and q8_capable([gate, up]))
    assert q8_out is None or (q8 is not None and gate.rows % Q8_OUT_ROWS == 0)
    io = (q8 is not None) | (q8_out is not None) << 1
    for row, n in token_chunks(b):
        r, wg = glu_config(gate.struct, gate.rows, gate.cols, n)
        if q8_out:
            r, wg = 2, min(wg, 2)  # one gate and one up row per group: 16 * WG warps per block
        nw = block_warps(r // 2, wg, io)
        per_block = (r // 2) * nw // wg
        fn = k.fn("matvec.cu", glu_name(gate.struct, n, r, wg, ACT[act], io))
        fn(((gate.rows + per_block - 1) // per_block,), (32 * nw,),
           (*gate.planes, *up.planes, i32(gate.rows), ptr(x + 4 * row * ldx), i32(ldx), i32(gate.cols),
            ptr(y + 4 * row * ldy), i32(ldy), *_norm_args(norm), *(q8.args(row) if q8 else NO_Q8),
            *(q8_out.out_args(row, None) if q8_out else NO_QOUT)))


def embed(k: Kernels, table: Mat, tokens: int, n: int, x: int, ldx: int, scale: float) -> None:
    fn = k.fn("matvec.cu", f"embed_rows<{table.struct}>")
    fn((n,), (128,), (*table.planes, i32(table.cols), ptr(tokens), i32(table.rows), ptr(x), i32(ldx), f32(scale)))


def dequant_f16(k: Kernels, m: Mat, out: int) -> None:
    fn = k.fn("matvec.cu", f"dequant_f16<{m.struct}>")
    units = m.rows * (m.cols // UNIT_ELEMS[m.struct])
    fn(((units + 255) // 256,), (256,), (*m.planes, i32(m.rows), i32(m.cols), ptr(out)))


RMS_SLOTS = 2  # float4s per thread at most in layers.cu's rmsnorm
RMSNORM_MAX_COLS = 4 * RMS_SLOTS * 1024


def rmsnorm(k: Kernels, x: int, ldx: int, w: int, y: int, ldy: int, rows: int, n: int, eps: float,
            res: int | None = None, ldr: int = 0, y16: int | None = None, ld16: int = 0,
            q8: Q8Vec | None = None, w2: int | None = None) -> None:
    """y = rmsnorm(x) * w (+ res; y may be res); y16: also an f16 copy; q8 (n % 16 == 0): also the
    int8 copy of y, or with w2 (the next RMSNorm's weight) of y * w2 with y's squares: the input of
    a matvec that applies that norm (q8.norm_eps)."""
    assert q8 is not None or w2 is None
    assert q8 is None or n % 16 == 0
    if n % 4 or n > RMSNORM_MAX_COLS:
        raise ValueError(f"RMSNorm over {n} columns: the CUDA kernel takes multiples of 4 up to {RMSNORM_MAX_COLS}")
    assert x % 16 == 0 and y % 16 == 0 and ldx % 4 == 0 and ldy % 4 == 0, "float4 rows"
    assert res is None or (res % 16 == 0 and ldr % 4 == 0), "float4 rows"
    threads = min(1024, -(-n // 128) * 32)  # a float4 per thread where it can (layers.cu)
    k.fn("layers.cu", "rmsnorm")((rows,), (threads,),
                                 (ptr(x), i32(ldx), ptr(w), ptr(y), i32(ldy), ptr(res), i32(ldr), i32(n), f32(eps),
                                  ptr(y16), i32(ld16), *(q8.ptrs() if q8 else NO_PTRS), ptr(w2)))


def quantize_q8(k: Kernels, x: int, ldx: int, n: int, rows: int, q8: Q8Vec) -> None:
    """q8 = the int8 activations of x[:rows, :n] (n % 16 == 0)."""
    assert n % 16 == 0
    k.fn("layers.cu", "quantize_q8")((-(-n // 16 // 128), rows), (128,),
                                     (ptr(x), i32(ldx), i32(n), i32(rows), *q8.ptrs()))


def rope_kv(k: Kernels, qkv: int, ld: int, rows: int, n_head: int, n_head_kv: int, head_dim: int, head_dim_v: int,
            n_rot: int, neox: bool, qnw: int | None, knw: int | None, eps: float, inv_freq: int, pos: int, seq: int,
            table: int, max_pages: int, page_size: int, kcache: int, vcache: int) -> None:
    threads = max(head_dim, head_dim_v)
    k.fn("layers.cu", "rope_kv")(
        (rows, n_head + 2 * n_head_kv), (threads,),
        (ptr(qkv), i32(ld), i32(n_head), i32(n_head_kv), i32(head_dim), i32(head_dim_v), i32(n_rot), i32(neox),
         ptr(qnw), ptr(knw), f32(eps), ptr(inv_freq), ptr(pos), ptr(seq), ptr(table), i32(max_pages),
         i32(page_size), ptr(kcache), ptr(vcache)))


def _grid(n: int, threads: int = 256) -> tuple[tuple[int], tuple[int]]:
    return ((n + threads - 1) // threads,), (threads,)


def glu(k: Kernels, g: int, u: int, ld: int, n: int, rows: int, act: str, y: int | None, ldy: int,
        out16: int | None = None, ld16: int = 0) -> None:
    k.fn("layers.cu", "glu")(*_grid(rows * n), (ptr(g), ptr(u), i32(ld), i32(n), i32(rows), i32(ACT[act]), ptr(y),
                                                i32(ldy), ptr(out16), i32(ld16)))


def add_bias(k: Kernels, y: int, ldy: int, b: int, n: int, rows: int) -> None:
    k.fn("layers.cu", "add_bias")(*_grid(rows * n), (ptr(y), i32(ldy), ptr(b), i32(n), i32(rows)))


def softcap(k: Kernels, x: int, ld: int, n: int, rows: int, cap: float) -> None:
    k.fn("layers.cu", "softcap")(*_grid(rows * n), (ptr(x), i32(ld), i32(n), i32(rows), f32(cap)))
