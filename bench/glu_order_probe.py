"""Why does the 8B's GLU take 29 us a layer where a bare reader of its bytes takes 22? (H100 probe)

bench/chain_probe.py (RESULTS row 70) showed the gap inside a PDL-chained graph of the 8B's layer.
This probe keeps that chain (QKV, attention, o-proj and down as bare readers, chain_probe.SRC) and
puts in the GLU's place, in turn:

- ``bare``: chain_probe's reader of the same bytes (64 KiB blocks, 4 loads in flight per thread);
- ``loads``: the GLU's grid, warps and addresses (each warp one gate and one up row of K = 4,096,
  4 rounds of a 16-byte quant load and a 16-byte scale load per row), bytes only xor-ed;
- ``decode``: the same with TQ4_K::load's scale decode;
- ``dp4a``: the GLU's inner loop (mmv_block_q8: int8 x loads, dp4a, scales) and SiLU, no epilogue;
- ``real``: the product's kernel, mmv_glu<TQ4_K, 1, 2, 1, 0, 3> (q8 epilogue included; the 8B's
  GLU shape before b4812ab, which runs mmv_glu<TQ4_K, 1, 4, 2, 0, 3>);
- ``fixed``: ``dp4a`` with K = 4,096 compiled in, its 4 rounds unrolled (mmv_q8_fixed);
- ``loadsq``: ``loads`` without the scale loads (the quant bytes only);
- ``gu``: ``dp4a`` with gate and up rows alternating in one matrix (a warp reads two adjacent rows);
- ``shfl``: ``dp4a`` with each row's scales loaded once (a lane a superblock), shuffled per round;
- ``nosc``: ``dp4a`` with no scales at all (constants);
- ``smem``: ``dp4a`` with each warp's scale bytes copied to shared memory once (cp.async);

each with the repacked planes' order (``row``: a row's quants contiguous, rows 2,048 bytes apart),
a block-contiguous order (``blk``: a block's 16 rows of one round adjacent, 8 KiB of quants and
1 KiB of scales per matrix and round; TQ4_KP), or the row order with the 12 scale bytes transposed
so a unit's scales take two byte permutes to decode (``S``: TQ4_KS), or the GGUF file's own order,
each superblock's 16 scale bytes then its 128 quant bytes in one plane (``I``: TQ4_KI). The
stand-ins, types and kernels named here are in glu_order_probe.cu. ``/2`` pads shared memory to
two blocks per SM (the real kernel's occupancy at 55 registers). The GLU's cost is the chain's
layer time less the layer time without it. Medians of 7 replays, each variant measured twice.

    python3 bench/glu_order_probe.py [--layers 32] [--variants bare/2,loads-row/2,real-row,real-I]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cupy as cp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from chain_probe import SRC as BARE_SRC, graph_us  # noqa: E402
from gguf_runtime.quant_kernels import pdl  # noqa: E402
from gguf_runtime.quant_kernels.sources import SRC_DIR  # noqa: E402

GLU_SRC = (Path(__file__).with_suffix(".cu")).read_text()  # the stand-ins (glu_order_probe.cu)
BARE_NAMES = ["ldg_read<4>", "small_read"]
N, K = 14336, 4096  # the 8B's GLU: 14,336 gate and 14,336 up rows of 4,096 columns (Q4_K)
OTHER_MB = {"QKV": 14.7, "o-proj": 9.4, "down": 40.6}


ORDERS = {"row": "TQ4_K", "blk": "TQ4_KP", "S": "TQ4_KS", "I": "TQ4_KI"}
MODES = ["loads", "decode", "dp4a", "fixed", "loadsq", "gu", "shfl", "nosc", "smem"]
VARIANTS = ("bare,bare/2,loads-row,loads-row/2,decode-row/2,dp4a-row/2,real-row,loads-blk,loads-blk/2,decode-blk/2,"
            "dp4a-blk/2,real-blk,dp4a-S/2,real-S,fixed-row/2,fixed-S/2")


def kernel_of(variant: str) -> str | None:
    """The GLU stand-in's kernel name (None: the bare reader)."""
    kind = variant.partition("/")[0]
    if kind == "bare":
        return None
    mode, order = kind.split("-")
    t = ORDERS[order]
    return f"mmv_glu<{t}, 1, 2, 1, 0, 3>" if mode == "real" else f"glu_like<{t}, {MODES.index(mode)}>"


def u64(x) -> np.uint64:
    return np.uint64(x.data.ptr) if isinstance(x, cp.ndarray) else np.uint64(x)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--variants", default=VARIANTS, help="comma-separated (default: the seventeenth session's)")
    a = ap.parse_args()
    L = a.layers
    variants = a.variants.split(",")
    GLU_NAMES = sorted({k for k in map(kernel_of, variants) if k})
    bare = cp.RawModule(code=BARE_SRC, options=("-std=c++17", "-arch=sm_90"), name_expressions=BARE_NAMES)
    glu = cp.RawModule(code=GLU_SRC, options=("-std=c++17", "-arch=sm_90", f"-I{SRC_DIR}"),
                       name_expressions=GLU_NAMES)
    fns = {n: bare.get_function(n) for n in BARE_NAMES} | {n: glu.get_function(n) for n in GLU_NAMES}
    for n in GLU_NAMES:
        print(f"{n}: {fns[n].num_regs} registers", flush=True)
    stream = cp.cuda.Stream(non_blocking=True)
    other = int(sum(OTHER_MB.values()) * 1e6 * L * 1.02)
    w_other = cp.random.randint(0, 2**31, size=other // 4, dtype=cp.int32).view(cp.uint8)
    qs_b, sc_b = N * K // 2, N * K // 16  # per matrix
    # scales as real ones: d, dmin small f16, 12 bytes of 6-bit scales (random is fine for timing)
    w_glu = cp.random.randint(0, 2**31, size=L * 2 * (qs_b + sc_b) // 4, dtype=cp.int32).view(cp.uint8)
    cache = cp.ones(32 * 1024 * 4, cp.uint32)
    xs = [cp.ones(1025, cp.float32), cp.ones(1025, cp.float32)]
    xq = cp.random.randint(-127, 128, size=K, dtype=cp.int8).view(cp.uint8)
    xsc = cp.ones((K // 16, 4), cp.float32) * cp.asarray([0.01, 0.5, 1.0, 0.0], cp.float32)
    y = cp.zeros(N + 1024, cp.float32)
    oq, osc = cp.zeros(N, cp.uint8), cp.zeros((N // 16, 4), cp.float32)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    for n in GLU_NAMES:
        fns[n].max_dynamic_shared_size_bytes = 100 * 1024
    fns["ldg_read<4>"].max_dynamic_shared_size_bytes = 100 * 1024

    def glu_planes(layer: int, which: int):
        base = (layer * 2 + which) * (qs_b + sc_b)
        return w_glu[base:], w_glu[base + qs_b:]

    def plan(variant: str | None):
        """One chain of L layers; variant None leaves the GLU out."""
        launches, off, i = [], 0, 0
        for layer in range(L):
            for role in ("QKV", "attention", "o-proj", "GLU", "down"):
                xin, xout = xs[i % 2], xs[(i + 1) % 2]
                if role == "attention":
                    launches.append((fns["small_read"], 32, 256, (cache, xin, xout, np.int32(0)), 0))
                elif role == "GLU":
                    if variant is None:
                        continue
                    (gq, gs), (uq, us) = glu_planes(layer, 0), glu_planes(layer, 1)
                    kind, _, occ = variant.partition("/")
                    smem = 100 * 1024 if occ == "2" else 0
                    if kind == "bare":  # the same bytes, contiguous, as chain_probe's blocks4
                        n = 2 * (qs_b + sc_b) // 4096 * 4096
                        grid = n // 65536
                        launches.append((fns["ldg_read<4>"], grid, 512, (gq, np.int64(n // 16 // grid), xin, xout,
                                                                            np.int32(1), np.int32(0), np.int32(0)), smem))
                    else:
                        name = kernel_of(variant)
                        if name.startswith("mmv_glu"):
                            args = (gq, 0, gs, 0, uq, 0, us, 0, np.int32(N), 0, np.int32(K), np.int32(K), y,
                                    np.int32(N), 0, np.float32(0), xq, np.int32(K), xsc, np.int32(K // 16),
                                    np.int32(0), np.float32(0), oq, np.int32(N), osc, np.int32(N // 16), 0)
                        else:
                            args = (gq, gs, uq, us, np.int32(K), xq, xsc, y)
                        launches.append((fns[name], N // 16, 512, args, smem))
                    i += 1
                    continue
                else:
                    n = int(OTHER_MB[role] * 1e6) // 4096 * 4096
                    grid = n // 65536
                    launches.append((fns["ldg_read<4>"], grid, 512, (w_other[off:], np.int64(n // 16 // grid), xin,
                                                                        xout, np.int32(1), np.int32(0), np.int32(0)), 0))
                    off += n
                i += 1

        def launch_all():
            for fn, grid, block, args, smem in launches:
                pdl.launch(fn.kernel.ptr, (grid,), (block,), [u64(x) if not isinstance(x, np.generic) else x
                                                              for x in args], smem, stream.ptr)
        return launch_all

    def graph_time(variant) -> float:
        return graph_us(stream, plan(variant)) / L

    res: dict[str, list[float]] = {v: [] for v in variants}
    base = []
    for rnd in range(2):
        base.append(graph_time(None))
        for v in variants:
            res[v].append(graph_time(v) - base[-1])
            print(f"round {rnd}: {v:>13}: GLU {res[v][-1]:6.2f} us a layer (rest {base[-1]:.2f})", flush=True)
    gb = 2 * (qs_b + sc_b) / 1e9
    print(f"\n{sms} SMs; layer without the GLU: {' / '.join(f'{b:.2f}' for b in base)} us")
    print("\n| GLU stand-in | us a layer (two rounds) | TB/s |\n|---|---|---|")
    for v in variants:
        t = min(res[v])
        print(f"| {v} | {' / '.join(f'{x:.2f}' for x in res[v])} | {gb / t * 1e3:.2f} |")


if __name__ == "__main__":
    main()
