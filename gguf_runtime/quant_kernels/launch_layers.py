"""Launchers of the per-layer kernels (layers.cu, and matvec.cu's embedding and dequantizing
kernels): embedding rows, RMSNorm, int8 quantization, RoPE + KV-cache write, GLU, bias, softcap.
The matvec launchers are in launchers.py; the conventions in launch_core.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import kv_layout as KL
from .launch_core import ACT, NO_PTRS, UNIT_ELEMS, Kernels, Mat, Q8Vec, f32, i32, ptr


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
            q8: Q8Vec | None = None, w2: int | None = None, reduce: RowReduce | None = None) -> None:
    """y = rmsnorm(x) * w (+ res; y may be res); y16: also an f16 copy; q8 (n % 16 == 0): also the
    int8 copy of y, or with w2 (the next RMSNorm's weight) of y * w2 with y's squares: the input of
    a matvec that applies that norm (q8.norm_eps). reduce: x is this rank's part of a split model's
    sum: the rows are summed over the ranks first (into reduce.xsum), then normalized."""
    assert q8 is not None or w2 is None
    assert q8 is None or n % 16 == 0
    if n % 4 or n > RMSNORM_MAX_COLS:
        raise ValueError(f"RMSNorm over {n} columns: the CUDA kernel takes multiples of 4 up to {RMSNORM_MAX_COLS}")
    assert x % 16 == 0 and y % 16 == 0 and ldx % 4 == 0 and ldy % 4 == 0, "float4 rows"
    assert res is None or (res % 16 == 0 and ldr % 4 == 0), "float4 rows"
    threads = min(1024, -(-n // 128) * 32)  # a float4 per thread where it can (layers.cu)
    args = (ptr(x), i32(ldx), ptr(w), ptr(y), i32(ldy), ptr(res), i32(ldr), i32(n), f32(eps), ptr(y16), i32(ld16),
            *(q8.ptrs() if q8 else NO_PTRS), ptr(w2))
    if reduce is None:
        k.fn("layers.cu", "rmsnorm")((rows,), (threads,), args)
        return
    assert res is None and rows <= reduce.rows_cap and reduce.xsum % 16 == 0 and reduce.ldsum % 4 == 0
    k.fn("layers.cu", "rmsnorm_allreduce")((rows,), (threads,), (
        *args, ptr(reduce.xsum), i32(reduce.ldsum), ptr(reduce.recv), ptr(reduce.ep), i32(reduce.rank),
        i32(reduce.world), i32(reduce.rows_cap)))


@dataclass(frozen=True)
class RowReduce:
    """rmsnorm's all-reduce over a split model's ranks (layers.cu's rmsnorm_allreduce): the sums go
    to xsum (row stride ldsum); recv: a device array of every rank's receive buffer pointer, ep:
    this rank's buffer index a row, rows_cap: the rows each buffer holds."""

    xsum: int
    ldsum: int
    recv: int
    ep: int
    rank: int
    world: int
    rows_cap: int


def quantize_q8(k: Kernels, x: int, ldx: int, n: int, rows: int, q8: Q8Vec) -> None:
    """q8 = the int8 activations of x[:rows, :n] (n % 16 == 0)."""
    assert n % 16 == 0
    k.fn("layers.cu", "quantize_q8")((-(-n // 16 // 128), rows), (128,),
                                     (ptr(x), i32(ldx), i32(n), i32(rows), *q8.ptrs()))


def rope_kv(k: Kernels, qkv: int, ld: int, rows: int, n_head: int, n_head_kv: int, head_dim: int, head_dim_v: int,
            n_rot: int, neox: bool, qnw: int | None, knw: int | None, eps: float, inv_freq: int, pos: int, seq: int,
            table: int, max_pages: int, page_size: int, kcache: int, vcache: int, kv: str = "f32") -> None:
    threads = max(head_dim, head_dim_v)
    k.fn("layers.cu", "rope_kv")(
        (rows, n_head + 2 * n_head_kv), (threads,),
        (ptr(qkv), i32(ld), i32(n_head), i32(n_head_kv), i32(head_dim), i32(head_dim_v), i32(n_rot), i32(neox),
         ptr(qnw), ptr(knw), f32(eps), ptr(inv_freq), ptr(pos), ptr(seq), ptr(table), i32(max_pages),
         i32(page_size), ptr(kcache), ptr(vcache), i32(KL.KIND[kv])))  # quantized: head_dim threads, % 32


def _grid(n: int, threads: int = 256) -> tuple[tuple[int], tuple[int]]:
    return ((n + threads - 1) // threads,), (threads,)


def glu(k: Kernels, g: int, u: int, ld: int, n: int, rows: int, act: str, y: int | None, ldy: int,
        out16: int | None = None, ld16: int = 0) -> None:
    k.fn("layers.cu", "glu")(*_grid(rows * n), (ptr(g), ptr(u), i32(ld), i32(n), i32(rows), i32(ACT[act]), ptr(y),
                                                i32(ldy), ptr(out16), i32(ld16)))


def add_bias(k: Kernels, y: int, ldy: int, b: int, n: int, rows: int) -> None:
    k.fn("layers.cu", "add_bias")(*_grid(rows * n), (ptr(y), i32(ldy), ptr(b), i32(n), i32(rows)))


def add_gated(k: Kernels, x: int, ldx: int, h: int, ldh: int, w: int, y: int, ldy: int, n: int, rows: int) -> None:
    """x[t] += y[t] * sigmoid(h[t] . w) for t < rows (Qwen2-MoE's shared expert)."""
    k.fn("layers.cu", "add_gated")((rows,), (256,), (ptr(x), i32(ldx), ptr(h), i32(ldh), ptr(w), ptr(y), i32(ldy),
                                                   i32(n)))


def softcap(k: Kernels, x: int, ld: int, n: int, rows: int, cap: float) -> None:
    k.fn("layers.cu", "softcap")(*_grid(rows * n), (ptr(x), i32(ld), i32(n), i32(rows), f32(cap)))


AR_BLOCKS = 32  # allreduce.cu's fixed grid (its blocks pair up across ranks by index)


def allreduce_push(k: Kernels, x: int, n: int, recv: int, epoch: int, last: int, rank: int, world: int,
                   cap: int) -> None:
    """x[:n] (float32, n % 4 == 0, n <= cap) = the sum over the ranks (allreduce.cu); recv: a device
    array of every rank's receive buffer pointer, epoch / last: this rank's AR_BLOCKS counters."""
    k.fn("allreduce.cu", "allreduce_push")((AR_BLOCKS,), (256,), (ptr(x), i32(n), ptr(recv), ptr(epoch), ptr(last),
                                                                 i32(rank), i32(world), i32(cap)))
