"""Does the order in which a matvec's warps touch DRAM cost bandwidth? (H100 probe)

Each warp reads ROUNDS chunks of 512 bytes (16 per lane), ILP of them at a time (the next
round's address depends on the data of the one before, as a lane's next loads wait for its dot
products in matvec.cu), in blocks of 16 warps, over a 64 MiB region (the 8B's GLU reads 66 MB).
Only the mapping of (block, warp, round) to addresses changes:

- rows:        a warp owns a row of ROUNDS x 512 bytes, rows one after another (the GLU's layout:
               at a round the block's 16 warps touch 16 chunks 2 KiB apart)
- block-tiled: round i of a block's 16 warps reads 16 consecutive chunks (8 KiB in one piece)
- global:      round i of every warp of the grid reads the next chunk in a single stream

Event-timed over 20 launches, two halves of a 128 MiB buffer alternating (the L2 is 50 MB).

    python3 bench/dram_pattern_probe.py [--rounds 4]
"""

from __future__ import annotations

import argparse

import cupy as cp
import numpy as np

SRC = r"""
// ILP: independent 16-byte loads per lane per round (chunks of the round i, i + rounds / ILP, ...)
template <int MODE, int ILP>
__global__ void __launch_bounds__(512) walk(const uint4* __restrict__ base, int rounds, unsigned* out) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long nw = (long)gridDim.x * 16, w = (long)blockIdx.x * 16 + warp;
    unsigned s = 0, dep = 0;
    for (int i = 0; i < rounds / ILP; ++i) {
        uint4 v[ILP];
#pragma unroll
        for (int j = 0; j < ILP; ++j) {
            const int c = i + j * (rounds / ILP);
            long chunk;
            if (MODE == 0) chunk = w * rounds + c;                                  // rows
            else if (MODE == 1) chunk = ((long)blockIdx.x * rounds + c) * 16 + warp;  // block-tiled
            else chunk = (long)c * nw + w;                                          // global
            v[j] = __ldg(base + chunk * 32 + lane + (dep == 0xdeadbeefu));  // waits for the round before
        }
#pragma unroll
        for (int j = 0; j < ILP; ++j) s ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
        dep = s;
    }
    if (s == 0x12345678u) out[0] = s;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--mib", type=int, nargs="+", default=[64], help="bytes each launch reads")
    a = ap.parse_args()
    names = [f"walk<{m}, {ilp}>" for m in range(3) for ilp in (1, 2, 4)]
    mod = cp.RawModule(code=SRC, options=("-std=c++17",), name_expressions=names)
    buf = cp.ones(2 * max(a.mib) << 20 >> 2, cp.uint32)
    out = cp.zeros(1, cp.uint32)
    ev = [cp.cuda.Event() for _ in range(2)]
    print(f"{'MiB':>5} {'rounds':>6} {'warps/SM':>8} {'ILP':>3} {'mode':<12} {'us':>8} {'GB/s':>7}")
    for mib, rounds, smem, ilp in [(m, r, s, i) for m in a.mib for r in a.rounds for s in (0, 100 << 10)
                                   for i in (1, 2, 4)]:
        half = mib << 20
        blocks = half // (16 * rounds * 512)
        for mode, label in enumerate(("rows", "block-tiled", "global")):
            if ilp > 1 and mode == 1:
                continue
            fn = mod.get_function(names[3 * mode + (1, 2, 4).index(ilp)])
            fn.max_dynamic_shared_size_bytes = smem  # 100 KiB: 2 blocks (32 warps) per SM, as the GLU
            ts = []
            for rep in range(22):
                ptr = buf.data.ptr + (rep % 2) * half
                ev[0].record()
                fn((blocks,), (512,), (np.uint64(ptr), np.int32(rounds), out), shared_mem=smem)
                ev[1].record()
                ev[1].synchronize()
                if rep >= 2:
                    ts.append(cp.cuda.get_elapsed_time(ev[0], ev[1]) * 1e3)
            t = float(np.median(ts))
            warps = 64 if smem == 0 else 32
            print(f"{mib:>5} {rounds:>6} {warps:>8} {ilp:>3} {label:<12} {t:>8.1f} {half / t / 1e3:>7.0f}")


if __name__ == "__main__":
    main()
