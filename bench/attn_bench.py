"""Batch-decode attention on its own: GPU time per call of attention.cu (the split kernel, as the
batch steps launch it) and of attention_tiles.cu under each (keys per tile, stages) config, for B
rows of B sequences at each context, on a paged cache laid out as PagedKVCache allocates it.
Faster to iterate on than a whole twin; also checks that the kernels agree.
Usage (GPU machine): python bench/attn_bench.py [--shape 8b] [--rows 64] [--ctx 64 192 512]
  [--configs 32:2 16:4] [--reps 50] [--kv f32 f16] (each cache type: its own table rows)
"""

from __future__ import annotations

import argparse
import math

import cupy as cp
import numpy as np

from gguf_runtime.cuda_workspace import n_splits
from gguf_runtime.kv_cache import PAGE_SIZE
from gguf_runtime.quant_kernels import launch_attention as LA
from gguf_runtime.quant_kernels import launchers as L
from mma_shapes import timed  # (bench/ is the script's folder)

SHAPES = {"8b": (128, 32, 8), "smollm2": (64, 9, 3), "gemma3": (256, 4, 1)}  # head_dim, heads, KV heads


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--ctx", type=int, nargs="*", default=[64, 192, 512])
    ap.add_argument("--configs", nargs="*", default=[])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--kv", nargs="*", default=["f32"], choices=["f32", "f16"])
    a = ap.parse_args()
    for kv in a.kv:
        run(a, kv == "f16")


def run(a: argparse.Namespace, kv16: bool) -> None:
    d, hq, hkv = SHAPES[a.shape]
    rows, page, k = a.rows, PAGE_SIZE, L.Kernels()
    max_pages = -(-max(a.ctx) // page)
    rng = np.random.default_rng(0)
    shape = (rows * max_pages, hkv, page, d)  # sequence s owns pages [s max_pages, (s + 1) max_pages)
    kv_dtype = np.float16 if kv16 else np.float32
    kc = cp.asarray(rng.standard_normal(shape, np.float32).astype(kv_dtype))
    vc = cp.asarray(rng.standard_normal(shape, np.float32).astype(kv_dtype))
    table = cp.arange(rows * max_pages, dtype=cp.int32).reshape(rows, max_pages)
    seq = cp.arange(rows, dtype=cp.int32)
    q = cp.asarray(rng.standard_normal((rows, hq * d), np.float32))
    out = cp.zeros((rows, hq * d), cp.float32)
    out16 = cp.zeros((rows, hq * d), cp.uint16)
    ns = n_splits(rows)
    part_o = cp.zeros(rows * hq * ns * d, cp.float32)
    part_ml = cp.zeros(rows * hq * ns * 2, cp.float32)
    counter = cp.zeros(rows * hkv, cp.uint32)
    scale = 1 / math.sqrt(d)
    split_shape = LA.attn_shape(d, hq // hkv, 4, 1)
    configs = [tuple(int(v) for v in c.split(":")) for c in a.configs] or [LA.tiles_config(d, kv16)]
    print(f"{a.shape}: head_dim {d}, {hq} heads, {hkv} KV heads, B={rows}, {'f16' if kv16 else 'f32'} cache; "
          f"split kernel: {ns} splits")
    print(f"{'context':>8} {'kernel':<22} {'us/call':>9} {'KV GB/s':>9} {'rel. diff':>10}")
    for ctx in a.ctx:
        pos = cp.full(rows, ctx - 1, cp.int32)
        kv_bytes = rows * hkv * ctx * d * kc.itemsize * 2

        def split():
            LA.attention(k, q.data.ptr, hq * d, rows, kc.data.ptr, vc.data.ptr, pos.data.ptr, seq.data.ptr,
                         table.data.ptr, max_pages, page, hq, hkv, d, scale, 0.0, 0, ns, part_o.data.ptr,
                         part_ml.data.ptr, counter.data.ptr, out.data.ptr, hq * d, out16.data.ptr, hq * d,
                         shape=split_shape, early=True, kv16=kv16)
        us = timed(split, a.reps)
        ref = out.get()
        print(f"{ctx:>8} {'split':<22} {us:>9.2f} {kv_bytes / us / 1e3:>9.0f} {'':>10}")
        for cfg in configs:
            def tiles(cfg=cfg):
                LA.attention_tiles(k, q.data.ptr, hq * d, rows, kc.data.ptr, vc.data.ptr, pos.data.ptr,
                                   seq.data.ptr, table.data.ptr, max_pages, page, hq, hkv, d, scale, 0.0, 0,
                                   out.data.ptr, hq * d, out16.data.ptr, hq * d, early=True, config=cfg,
                                   kv16=kv16)
            out.fill(np.nan)
            us = timed(tiles, a.reps)
            diff = float(np.linalg.norm(out.get() - ref) / np.linalg.norm(ref))
            name = f"tiles {cfg[0]}:{cfg[1]}"
            print(f"{ctx:>8} {name:<22} {us:>9.2f} {kv_bytes / us / 1e3:>9.0f} {diff:>10.1e}")


if __name__ == "__main__":
    main()
