"""What a grid-wide barrier costs inside one persistent kernel, against a kernel boundary (H100 probe).

A persistent layer kernel would replace the launches between a decode step's products by grid
barriers. This times N phases of the same small work (each block reads 64 KiB of weights and
writes one float), separated either by a grid barrier (every block co-resident: an atomic
arrival counter and a generation word, spun on with acquire loads) or by kernel boundaries (one
launch per phase, captured in a CUDA graph). Medians of 7 replays, event-timed.

    python3 bench/grid_barrier_probe.py [--phases 64]
"""

from __future__ import annotations

import argparse

import cupy as cp
import numpy as np

SRC = r"""
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v; asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
// every block arrives; the last one bumps the generation; the others spin on it
__device__ void grid_barrier(unsigned* count, unsigned* gen) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned g = ld_acquire(gen);
        __threadfence();
        if (atomicAdd(count, 1u) == gridDim.x - 1) { *count = 0; __threadfence(); atomicAdd(gen, 1u); }
        else while (ld_acquire(gen) == g) {}
    }
    __syncthreads();
}
__device__ float phase(const uint4* w, int p, float* out) {
    const uint4* base = w + ((long)p * gridDim.x + blockIdx.x) * 4096;  // 64 KiB per block and phase
    unsigned s = 0;
    for (int i = threadIdx.x; i < 4096; i += blockDim.x) { const uint4 v = __ldg(base + i); s ^= v.x ^ v.w; }
    return (float)(s & 1);
}
extern "C" __global__ void persistent(const uint4* w, int phases, float* out, unsigned* count, unsigned* gen) {
    for (int p = 0; p < phases; ++p) {
        const float r = phase(w, p % 8, out);
        if (threadIdx.x == 0) out[blockIdx.x] += r;
        grid_barrier(count, gen);
    }
}
extern "C" __global__ void one_phase(const uint4* w, int p, float* out) {
    const float r = phase(w, p % 8, out);
    if (threadIdx.x == 0) out[blockIdx.x] += r;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phases", type=int, default=64)
    a = ap.parse_args()
    mod = cp.RawModule(code=SRC, options=("-std=c++17",))
    pers, one = mod.get_function("persistent"), mod.get_function("one_phase")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    ev = [cp.cuda.Event() for _ in range(2)]
    stream = cp.cuda.Stream(non_blocking=True)

    def timed(fn) -> float:
        ts = []
        for _ in range(8):
            ev[0].record(stream)
            fn()
            ev[1].record(stream)
            ev[1].synchronize()
            ts.append(cp.cuda.get_elapsed_time(ev[0], ev[1]) * 1e3)
        return float(np.median(ts[1:]))

    print(f"{'blocks':>6} {'phases':>6} {'barriers us':>12} {'per phase':>10} "
          f"{'graph of launches us':>21} {'per phase':>10}")
    for blocks in (sms, 2 * sms):
        w = cp.ones(8 * blocks * 4096 * 4, cp.uint32)  # 8 phases' worth, 64 KiB per block each
        out = cp.zeros(blocks, cp.float32)
        count = cp.zeros(1, cp.uint32)
        gen = cp.zeros(1, cp.uint32)
        with stream:
            t_bar = timed(lambda: pers((blocks,), (256,), (w, np.int32(a.phases), out, count, gen)))
            stream.begin_capture()
            for p in range(a.phases):
                one((blocks,), (256,), (w, np.int32(p), out))
            graph = stream.end_capture()
            t_graph = timed(lambda: graph.launch(stream))
        print(f"{blocks:>6} {a.phases:>6} {t_bar:>12.1f} {t_bar / a.phases:>10.2f} {t_graph:>21.1f} "
              f"{t_graph / a.phases:>10.2f}")


if __name__ == "__main__":
    main()
