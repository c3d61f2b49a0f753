"""The floor of a chain of dependent kernels in one replayed graph: per-kernel time of N kernels,
without programmatic dependent launch (PDL), with it as the runtime uses it (on: wait, then let the
next kernel launch), and with the next kernel let launch before the wait (trigger-first), for an empty
kernel and for one that loads weights from HBM, then reads the previous kernel's output and
writes its own, as the decode step's kernels do.
Usage (GPU machine): python bench/launch_floor.py [--n 150] [--blocks 72]
"""

from __future__ import annotations

import argparse
import os

import cupy as cp
import numpy as np

from gguf_runtime.quant_kernels import pdl
from gguf_runtime.quant_kernels.launch_core import OPTIONS

SRC = r"""
#include "common.cuh"
#ifdef TRIGGER_FIRST  // the variant: the next kernel may launch before this one's wait
#define pdl_enter() do { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); \
                         asm volatile("griddepcontrol.wait;" ::: "memory"); } while (0)
#endif
extern "C" __global__ void empty() { pdl_enter(); }
// y = x + w (w loaded before pdl_enter, as the matvecs load their first weights), then a warp sum.
// 4 16-byte weight loads per thread at this kernel's own offset (off): 150 kernels of 72 blocks
// read 88 MB, more than L2, so each replay streams them from HBM as a decode step does.
extern "C" __global__ void chain(const float* x, float* y, const float4* w, long off, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const float4* wp = w + off + 4 * (long)i;
    float4 a = wp[0], b = wp[1], c = wp[2], d = wp[3];
    pdl_enter();
    float v = x[i % n] + (a.x + b.y) + (c.z + d.w);
    v = warp_sum(v) * (1.f / 32.f);
    if (i < n) y[i] = v;
}
"""


def run(n: int, blocks: int, kernel: str, use_pdl: bool, wait_first: bool, reps: int = 20) -> float:
    mod = cp.RawModule(code=SRC, options=OPTIONS + (() if wait_first else ("-DTRIGGER_FIRST",)))
    fn = mod.get_function(kernel)
    a, b = cp.ones(4096, cp.float32), cp.ones(4096, cp.float32)
    per = blocks * 128 * 4  # float4s per kernel
    w = cp.ones((n * per, 4), cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)

    def launch(i: int) -> None:
        src, dst = (a, b) if i % 2 == 0 else (b, a)
        args = () if kernel == "empty" else (np.uint64(src.data.ptr), np.uint64(dst.data.ptr), np.uint64(w.data.ptr),
                                             np.int64(i * per), np.int32(576))
        if use_pdl:
            pdl.launch(fn.kernel.ptr, (blocks,), (128,), args, 0, stream.ptr)
        else:
            fn((blocks,), (128,), args)

    with stream:
        for i in range(n):
            launch(i)
        stream.begin_capture()
        for i in range(n):
            launch(i)
        g = stream.end_capture()
    g.upload(stream)
    for _ in range(3):
        g.launch(stream)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    for _ in range(reps):
        g.launch(stream)
    end.record(stream)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) * 1e3 / reps / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=150)
    ap.add_argument("--blocks", type=int, default=72)
    args = ap.parse_args()
    print(f"{os.uname().nodename}: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, "
          f"{args.n} kernels per graph, {args.blocks} blocks x 128 threads")
    print(f"{'kernel':<8}{'PDL':>12}{'us/kernel':>11}")
    for kernel in ("empty", "chain"):
        for use_pdl, wait_first, label in ((False, True, "off"), (True, True, "on"), (True, False, "trigger-first")):
            us = run(args.n, args.blocks, kernel, use_pdl, wait_first)
            print(f"{kernel:<8}{label:>12}{us:>11.2f}")

if __name__ == "__main__":
    main()
