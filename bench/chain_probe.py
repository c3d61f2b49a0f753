"""How fast can a chain of dependent weight-streaming kernels go on this GPU? (H100 probe)

The 8B's decode step is 32 layers of five dependent kernels (QKV, attention, o-proj, GLU, down),
each streaming its weights once. This replays a CUDA graph of the same chain in which every
kernel only reads its bytes (a xor, nothing computed) and a 4 KiB vector the kernel before it
wrote, so what it measures is the floor the structure itself sets: ramp-up, tail and boundary per
kernel, at the real sizes. Variants of the reader:

- ``blocks``: many blocks of 512 threads, 64 KiB each, U 16-byte loads in flight per thread (the
  shape of the matvecs).
- ``persist``: one wave of blocks (4 per SM), each an equal contiguous share.
- ``bulk``: one wave (1-2 per SM), the share streamed into a shared-memory ring by
  ``cp.async.bulk`` (TMA), ST stages of CH bytes; the first stages go out before the wait. Its
  shares are whole stages, so it reads a little fewer bytes: compare its rows by TB/s.

Each with programmatic dependent launch (``wait``: griddepcontrol.wait then launch_dependents, as
common.cuh's pdl_enter; ``go``: the reverse) or without (``plain``). Medians of 7 replays.

    python3 bench/chain_probe.py [--layers 32]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cupy as cp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gguf_runtime.quant_kernels import pdl  # noqa: E402

SRC = r"""
typedef unsigned long long u64;
__device__ __forceinline__ void pdl_sync(int order) {
    if (order == 1) {
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
        asm volatile("griddepcontrol.wait;" ::: "memory");
    } else {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
}
__device__ __forceinline__ unsigned mix(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }
// the dependency: read what the kernel before wrote, write what the next one reads
__device__ __forceinline__ void finish(unsigned s, const float* xin, float* xout) {
    const float x = xin[threadIdx.x & 1023];
    if (blockIdx.x == 0 && threadIdx.x < 1024) xout[threadIdx.x] = x + (float)(s & 1u);
    else if (s == 0x9e3779b9u && x == 1234.5f) xout[1024] = 1.f;  // keeps the reads live
}

// Each block reads the uint4s [blockIdx.x * share, +share), U loads in flight per thread.
// sync: the block meets at a barrier before it writes (as a matvec's q8 epilogue does)
template <int U>
__global__ void ldg_read(const uint4* __restrict__ w, long share, const float* xin, float* xout, int pre, int order,
                         int sync) {
    const uint4* p = w + (long)blockIdx.x * share;
    const long step = blockDim.x;
    uint4 v[U];
    long i = threadIdx.x;
    if (pre)
#pragma unroll
        for (int j = 0; j < U; ++j) v[j] = i + j * step < share ? __ldg(p + i + j * step) : make_uint4(0, 0, 0, 0);
    pdl_sync(order);
    if (!pre)
#pragma unroll
        for (int j = 0; j < U; ++j) v[j] = i + j * step < share ? __ldg(p + i + j * step) : make_uint4(0, 0, 0, 0);
    unsigned s = 0;
    for (;;) {
#pragma unroll
        for (int j = 0; j < U; ++j) s ^= mix(v[j]);
        i += U * step;
        if (i >= share) break;
#pragma unroll
        for (int j = 0; j < U; ++j) v[j] = i + j * step < share ? __ldg(p + i + j * step) : make_uint4(0, 0, 0, 0);
    }
    if (sync) __syncthreads();
    finish(s, xin, xout);
}

__device__ __forceinline__ unsigned sa(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// Each block streams share_bytes (a multiple of CH) through ST shared stages with cp.async.bulk.
template <int ST, int CH>
__global__ void bulk_read(const unsigned char* __restrict__ w, long share_bytes, const float* xin, float* xout,
                          int pre, int order) {
    extern __shared__ __align__(128) unsigned char ring[];
    __shared__ __align__(8) u64 bar[ST];
    const unsigned char* g = w + (long)blockIdx.x * share_bytes;
    const int nch = (int)(share_bytes / CH);
    if (threadIdx.x == 0) {
        for (int s = 0; s < ST; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(sa(&bar[s])));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();
    auto issue = [&](int c) {
        const int s = c % ST;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(sa(&bar[s])), "r"(CH) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(sa(ring + s * CH)), "l"(g + (long)c * CH), "r"(CH), "r"(sa(&bar[s])) : "memory");
    };
    if (pre && threadIdx.x == 0) for (int c = 0; c < ST && c < nch; ++c) issue(c);
    pdl_sync(order);
    if (!pre && threadIdx.x == 0) for (int c = 0; c < ST && c < nch; ++c) issue(c);
    unsigned s = 0;
    for (int c = 0; c < nch; ++c) {
        const int st = c % ST;
        const unsigned par = (c / ST) & 1;
        unsigned done = 0;
        while (!done)
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                         : "=r"(done) : "r"(sa(&bar[st])), "r"(par) : "memory");
        const uint4* src = reinterpret_cast<const uint4*>(ring + st * CH);
        for (int i = threadIdx.x; i < CH / 16; i += blockDim.x) s ^= mix(src[i]);
        __syncthreads();
        if (threadIdx.x == 0 && c + ST < nch) issue(c + ST);
    }
    finish(s, xin, xout);
}

// The attention stand-in: 32 blocks read 16 KiB each of a small cache after the wait.
__global__ void small_read(const uint4* __restrict__ w, const float* xin, float* xout, int order) {
    pdl_sync(order);
    const uint4* p = w + (long)blockIdx.x * 1024;
    unsigned s = 0;
    for (int i = threadIdx.x; i < 1024; i += blockDim.x) s ^= mix(p[i]);
    finish(s, xin, xout);
}
"""

def graph_us(stream: cp.cuda.Stream, launch_all) -> float:
    """launch_all's launches run once eagerly, then captured on ``stream`` and replayed 8 times: the
    median of the last 7 replays, in us (CUDA events)."""
    ev = [cp.cuda.Event() for _ in range(2)]
    with stream:
        launch_all()  # warm-up, eager
        stream.synchronize()
        stream.begin_capture()
        launch_all()
        graph = stream.end_capture()
        ts = []
        for _ in range(8):
            ev[0].record(stream)
            graph.launch(stream)
            ev[1].record(stream)
            ev[1].synchronize()
            ts.append(cp.cuda.get_elapsed_time(ev[0], ev[1]) * 1e3)
    return float(np.median(ts[1:]))


NAMES = ["ldg_read<4>", "ldg_read<2>", "ldg_read<1>", "bulk_read<4, 32768>", "bulk_read<6, 16384>", "small_read"]
LAYER_MB = (14.7, None, 9.4, 66.1, 40.6)  # QKV, attention, o-proj, GLU, down (bytes per layer, 8B)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    a = ap.parse_args()
    mod = cp.RawModule(code=SRC, options=("-std=c++17", "-arch=sm_90"), name_expressions=NAMES)
    fns = {n: mod.get_function(n) for n in NAMES}
    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    stream = cp.cuda.Stream(non_blocking=True)
    total = int(sum(mb for mb in LAYER_MB if mb) * 1e6 * a.layers * 1.05)
    weights = cp.random.randint(0, 2**31, size=total // 4, dtype=cp.int32).view(cp.uint8)
    cache = cp.ones(32 * 1024 * 4, cp.uint32)
    xs = [cp.ones(1025, cp.float32), cp.ones(1025, cp.float32)]

    def variant(kind: str, order: str, pre: int, skip: int = -1):
        """The launches of one layer chain (role ``skip`` left out); returns (launch_all, bytes)."""
        calls, off = [], 0
        for layer in range(a.layers):
            for role, mb in enumerate(LAYER_MB):
                if role == skip:
                    continue
                calls.append((mb, off))
                if mb:
                    off += int(mb * 1e6) // 4096 * 4096  # every region 4 KiB aligned
        bytes_read = 0
        plan = []
        for i, (mb, off) in enumerate(calls):
            xin, xout = xs[i % 2], xs[(i + 1) % 2]
            o = 1 if order == "go" else 0
            if mb is None:
                plan.append((fns["small_read"], (32,), (256,), (cache, xin, xout, np.int32(o)), 0))
                continue
            n = int(mb * 1e6) // 4096 * 4096
            if kind.startswith("blocks") or kind.startswith("persist"):
                # blocksU: U loads in flight per thread; a "/2" suffix pads shared memory to two
                # blocks of 512 per SM (the GLU matvec's occupancy); an "s" suffix adds the barrier
                sync = kind.endswith("s")
                base, _, per_sm = kind.rstrip("s").partition("/")
                u = int(base[-1])
                fn = fns[f"ldg_read<{u}>"]
                if kind.startswith("blocks"):
                    grid = max(1, n // 65536)
                else:
                    grid = 4 * sms
                share = n // 16 // grid
                bytes_read += share * 16 * grid
                pad = 100 * 1024 if per_sm == "2" else 0
                if pad:
                    fn.max_dynamic_shared_size_bytes = pad
                plan.append((fn, (grid,), (512,), (weights[off:], np.int64(share), xin, xout, np.int32(pre),
                                                    np.int32(o), np.int32(sync)), pad))
            else:
                st, ch, per_sm, thr = {"bulk4x32": (4, 32768, 1, 512), "bulk6x16": (6, 16384, 2, 256)}[kind]
                grid = per_sm * sms
                share = n // grid // ch * ch
                bytes_read += share * grid
                fn = fns[f"bulk_read<{st}, {ch}>"]
                fn.max_dynamic_shared_size_bytes = st * ch
                plan.append((fn, (grid,), (thr,), (weights[off:], np.int64(share), xin, xout, np.int32(pre),
                                                    np.int32(o)), st * ch))

        def launch_all():
            for fn, grid, block, args, smem in plan:
                if order == "plain":
                    fn(grid, block, args, shared_mem=smem)
                else:
                    pdl.launch(fn.kernel.ptr, grid, block, [pdl_arg(x) for x in args], smem, stream.ptr)
        return launch_all, bytes_read

    def pdl_arg(x):
        return np.uint64(x.data.ptr) if isinstance(x, cp.ndarray) else x

    rows = []
    for kind, order, pre in [("blocks4", "plain", 0), ("blocks4", "wait", 1), ("blocks2", "wait", 1),
                             ("persist4", "wait", 1), ("persist4", "go", 1), ("persist2", "wait", 1),
                             ("bulk4x32", "wait", 1), ("bulk4x32", "go", 1), ("bulk6x16", "wait", 1),
                             ("bulk4x32", "wait", 0)]:
        launch_all, nbytes = variant(kind, order, pre)
        t = graph_us(stream, launch_all)
        rows.append((kind, order, pre, t, nbytes))
        print(f"{kind:>9} {order:>5} pre={pre}: {t:9.1f} us for {a.layers} layers, {t / a.layers:6.2f} us/layer, "
              f"{nbytes / t / 1e6:5.2f} TB/s", flush=True)
    print("\n| reader | PDL | loads before wait | us per layer | TB/s over the chain |\n|---|---|---|---|---|")
    for kind, order, pre, t, nbytes in rows:
        print(f"| {kind} | {order} | {pre} | {t / a.layers:.2f} | {nbytes / t / 1e6:.2f} |")
    # each role's cost in the chain: the layer time less the layer time without it (as RESULTS row 54)
    names = ("QKV", "attention", "o-proj", "GLU", "down")
    print("\n| reader | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for kind in ("blocks4", "persist4", "blocks4/2", "blocks2/2", "blocks1/2", "blocks1/2s", "blocks2/2s"):
        times = []
        for skip in range(-1, len(LAYER_MB)):
            launch_all, _ = variant(kind, "wait", 1, skip)
            times.append(graph_us(stream, launch_all) / a.layers)
        print(f"| {kind} | " + " | ".join(f"{times[0] - t:.2f}" for t in times[1:]) + " |", flush=True)


if __name__ == "__main__":
    main()
