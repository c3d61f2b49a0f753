"""The 8B's batch-decode products on their own: GPU time per call of each tensor-core kernel at
B tokens, random weights of the real types and shapes, for each tile config given and with the
register fragments on and off (GGUF_RUN_MMA_REGA). Faster to iterate on than a whole twin.
Usage (GPU machine): python bench/mma_shapes.py [--tokens 64] [--configs "" 4:8 2:4] [--reps 100]
  [--only glu] [--ra 1 0] [--stages "" 2:2 3:3] [--host]
  (--stages: GGUF_RUN_MMA_STAGES values, "" the default; staged types only)
  (a config WR:NT[:H[:S]] replaces the launcher's choice for every shape: H = 2, tall blocks, for
  the single-matrix products; S K splits, 0 or absent: as planned)
"""

from __future__ import annotations

import argparse
import os

import cupy as cp
import numpy as np

from gguf_runtime.quant_kernels import launch_mma as LM
from gguf_runtime.quant_kernels import launchers as L
from gguf_runtime.quant_kernels.formats import BY_NAME
from gguf_runtime.quant_kernels.reference import random_blocks
from gguf_runtime.quant_kernels.repack import repack

K8B, F8B = 4096, 14336


def upload(name: str, rows: int, cols: int, rng, keep: list) -> L.Mat:
    t = BY_NAME[name]
    p = repack(random_blocks(t, rows * cols, rng, scale=0.02), t, rows, cols)
    dev = cp.asarray(p.buffer)
    keep.append(dev)
    b, o = dev.data.ptr, p.offsets
    return L.Mat(t, rows, cols, b + o["qs"], b + o.get("qh", -b), b + o.get("sc", -b), b + o.get("d", -b))


def timed(fn, reps: int, graph: bool = True) -> float:
    """GPU time per call (us): ``reps`` calls captured in one CUDA graph, replayed after a warm-up.
    Launched one by one from Python (graph=False), a call of a few tens of us is host-bound: the
    GPU waits for the next launch (why the split products' rows swung by +-40% before 2026-11-22)."""
    for _ in range(3):
        fn()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    if not graph:
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return cp.cuda.get_elapsed_time(start, end) * 1000 / reps
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        fn()
        stream.begin_capture()
        for _ in range(reps):
            fn()
        g = stream.end_capture()
        g.launch(stream)
        start.record(stream)
        g.launch(stream)
        end.record(stream)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) * 1000 / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--configs", nargs="*", default=[""])
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--head-rows", type=int, default=32768)
    ap.add_argument("--only", default="", help="products whose name contains this")
    ap.add_argument("--ra", nargs="*", default=["1", "0"])
    ap.add_argument("--stages", nargs="*", default=[""])
    ap.add_argument("--host", action="store_true", help="time launches from Python, not a captured graph")
    a = ap.parse_args()
    rng, keep, k, t = np.random.default_rng(0), [], L.Kernels(), a.tokens
    x = cp.asarray(rng.standard_normal((t, F8B)).astype(np.float16))
    y = cp.zeros((t, max(F8B, a.head_rows)), cp.float32)
    y16 = cp.zeros((t, F8B), cp.float16)
    part = cp.zeros(LM.split_part_floats(max(F8B, a.head_rows), t), cp.float32)
    counter = cp.zeros(-(-max(F8B, a.head_rows) // 16) * -(-t // 16), cp.uint32)
    sc = LM.SplitScratch(part.data.ptr, part.size, counter.data.ptr, counter.size)
    gate, up = upload("Q4_K", F8B, K8B, rng, keep), upload("Q4_K", F8B, K8B, rng, keep)
    o, down4 = upload("Q4_K", K8B, K8B, rng, keep), upload("Q4_K", K8B, F8B, rng, keep)
    down6 = upload("Q6_K", K8B, F8B, rng, keep)
    o1k, o2k = upload("Q4_K", K8B, 1024, rng, keep), upload("Q4_K", K8B, 2048, rng, keep)
    q, kk = upload("Q4_K", K8B, K8B, rng, keep), upload("Q4_K", 1024, K8B, rng, keep)
    v = upload("Q6_K", 1024, K8B, rng, keep)
    head = upload("Q6_K", a.head_rows, K8B, rng, keep)
    xp, yp, ly = x.data.ptr, y.data.ptr, y.shape[1]

    def product(mats, cols, mode, outs=None):
        return lambda: LM.mma(k, mats, outs or [(yp, ly)], [None] * len(mats), xp, cols, t, mode, sc)

    shapes = {
        "glu Q4_K 2x14336x4096": (2 * F8B * K8B, lambda: LM.mma_glu(k, gate, up, xp, K8B, t, "silu", y16.data.ptr, F8B,
                                                                     sc)),
        "o Q4_K 4096x4096 (+=)": (K8B * K8B, product([o], K8B, 1)),
        "down Q4_K 4096x14336 (+=)": (K8B * F8B, product([down4], F8B, 1)),
        "o-short Q4_K 4096x1024 (+=)": (K8B * 1024, product([o1k], 1024, 1)),
        "o-short Q4_K 4096x2048 (+=)": (K8B * 2048, product([o2k], 2048, 1)),
        "down Q6_K 4096x14336 (+=)": (K8B * F8B, product([down6], F8B, 1)),
        "qkv Q4_K/Q4_K/Q6_K 6144x4096": (6144 * K8B, product([q, kk, v], K8B, 0,
                                                            [(yp, ly), (yp + 4 * K8B, ly), (yp + 4 * 5120, ly)])),
        f"head Q6_K {a.head_rows}x4096": (a.head_rows * K8B, product([head], K8B, 0)),
    }
    plan, rows_out = LM._mma_plan, []
    for cfg in a.configs:
        if cfg:
            wr, nt, h, sp = ([int(v) for v in cfg.split(":")] + [1, 0])[:4]
            LM._mma_plan = lambda rows, n, cols, nm, s, tall=True, wr=wr, nt=nt, h=h, sp=sp: LM.MmaConfig(
                wr, nt, sp or plan(rows, n, cols, nm, s, tall).split, h if nm == 1 else 1)
        else:
            LM._mma_plan = plan
        for ra in a.ra:
            os.environ["GGUF_RUN_MMA_REGA"] = ra
            for st in a.stages if ra == "1" else [""]:
                if st:
                    os.environ["GGUF_RUN_MMA_STAGES"] = st
                else:
                    os.environ.pop("GGUF_RUN_MMA_STAGES", None)
                for name, (macs, fn) in shapes.items():
                    if a.only not in name:
                        continue
                    us = timed(fn, a.reps, not a.host)
                    label = ra + (f" st {st}" if st else "")
                    rows_out.append((cfg or "plan", label, name, us, 2 * macs * t / us / 1e6))
    print(f"{'config':<7} {'regA':<10} {'product':<32} {'us':>8} {'TFLOP/s':>8}")
    for cfg, ra, name, us, tf in rows_out:
        print(f"{cfg:<7} {ra:<10} {name:<32} {us:8.1f} {tf:8.1f}")


if __name__ == "__main__":
    main()
