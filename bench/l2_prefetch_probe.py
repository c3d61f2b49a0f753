"""How fast the L2 prefetch instructions bring weights in, and what a reader gains (H100 probe).

For each way of prefetching (``cp.async.bulk.prefetch.L2`` in 4 KiB or 64 KiB pieces, or
``prefetch.global.L2`` per 128-byte line) and each grid size: the prefetch kernel's own time, and
the time of a reader of the same bytes (16-byte loads over the whole GPU) run right after it, or
after a 10 us idle kernel (as the decode step's attention would give it), against the reader on a
cold L2 (a 256 MiB read in between) and on a warm one. Event pairs around each kernel, medians of 7.

    python3 bench/l2_prefetch_probe.py [--mib 9 24]
"""

from __future__ import annotations

import argparse

import cupy as cp
import numpy as np

SRC = r"""
extern "C" __global__ void pf_bulk(const char* p, long long n, int chunk) {
    const long long nt = (long long)gridDim.x * blockDim.x, id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (long long off = id * chunk; off < n; off += nt * chunk) {
        const unsigned sz = (unsigned)(n - off < chunk ? n - off : chunk);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p + off), "r"(sz) : "memory");
    }
}
extern "C" __global__ void pf_line(const char* p, long long n, int chunk) {
    const long long nt = (long long)gridDim.x * blockDim.x, id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (long long off = id * 128; off < n; off += nt * 128) asm volatile("prefetch.global.L2 [%0];" :: "l"(p + off));
}
extern "C" __global__ void reader(const uint4* p, long long n16, unsigned* out) {
    const long long nt = (long long)gridDim.x * blockDim.x, id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned s = 0;
    for (long long i = id; i < n16; i += nt) { const uint4 v = __ldg(p + i); s ^= v.x ^ v.y ^ v.z ^ v.w; }
    if (s == 0x12345678u) out[0] = s;
}
extern "C" __global__ void idle(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, nargs="+", default=[9.0, 24.0])
    a = ap.parse_args()
    mod = cp.RawModule(code=SRC, options=("-std=c++17",))
    k = {n: mod.get_function(n) for n in ("pf_bulk", "pf_line", "reader", "idle")}
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    clock_khz = cp.cuda.runtime.getDeviceProperties(0)["clockRate"]
    flush = cp.ones(256 << 20 >> 2, cp.float32)
    out = cp.zeros(1, cp.uint32)
    ev = [cp.cuda.Event() for _ in range(4)]

    def read(buf):
        n16 = buf.nbytes // 16
        k["reader"]((sms * 8,), (256,), (buf, np.int64(n16), out))

    def cold():
        k["reader"]((sms * 8,), (256,), (flush, np.int64(flush.nbytes // 16), out))

    def timed(setup, first, idle_us, second):
        ts = []
        for _ in range(7):
            setup()
            ev[0].record()
            first()
            ev[1].record()
            if idle_us:
                k["idle"]((1,), (32,), (np.int64(int(idle_us * clock_khz / 1e3)),))
            ev[2].record()
            second()
            ev[3].record()
            ev[3].synchronize()
            ts.append((cp.cuda.get_elapsed_time(ev[0], ev[1]) * 1e3, cp.cuda.get_elapsed_time(ev[2], ev[3]) * 1e3))
        return np.median(np.array(ts), axis=0)

    print(f"{sms} SMs, clock {clock_khz / 1e3:.0f} MHz")
    for mib in a.mib:
        buf = cp.ones(int(mib * (1 << 20)) // 4, cp.float32)
        n = buf.nbytes
        base = timed(cold, lambda: None, 0, lambda: read(buf))[1]
        warm = timed(lambda: read(buf), lambda: None, 0, lambda: read(buf))[1]
        print(f"\n{mib:g} MiB: reader cold L2 {base:.1f} us ({n / base / 1e3:.0f} GB/s), "
              f"warm L2 {warm:.1f} us ({n / warm / 1e3:.0f} GB/s)")
        print(f"{'prefetch':<14} {'grid':>5} {'pf us':>7} {'GB/s':>6} {'reader after':>13} {'after 10 us idle':>17}")
        for name, chunk in (("pf_bulk", 4096), ("pf_bulk", 65536), ("pf_line", 128)):
            for grid in (24, 128, sms * 4):
                def pf(name=name, chunk=chunk, grid=grid):
                    k[name]((grid,), (128,), (buf, np.int64(n), np.int32(chunk)))
                t_pf, t_rd = timed(cold, pf, 0, lambda: read(buf))
                _, t_rd_idle = timed(cold, pf, 10, lambda: read(buf))
                label = f"{name[3:]} {chunk // 1024 or chunk}{'K' if chunk >= 1024 else 'B'}"
                print(f"{label:<14} {grid:>5} {t_pf:>7.1f} {n / t_pf / 1e3:>6.0f} {t_rd:>13.1f} {t_rd_idle:>17.1f}")


if __name__ == "__main__":
    main()
