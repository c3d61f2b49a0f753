"""Sweep the matvec row-group shape (R rows per group, WG warps per group) on real model shapes.

For each matrix: random well-formed blocks, one token, every valid (R, WG); 30 launches queued
behind a spin kernel and timed with two events; GB/s of the weight bytes read. Each variant's
output is checked against the default configuration's. Usage (GPU machine):
    python bench/matvec_variants.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json

import cupy as cp
import numpy as np

from gguf_runtime.quant_kernels import launchers as L
from gguf_runtime.quant_kernels.formats import BY_NAME
from gguf_runtime.quant_kernels.reference import random_blocks
from gguf_runtime.quant_kernels.repack import repack

SHAPES = [  # name, type, rows, cols
    ("8B ffn_gate", "Q4_K", 14336, 4096), ("8B ffn_down", "Q6_K", 4096, 14336), ("8B ffn_down", "Q4_K", 4096, 14336),
    ("8B attn_output", "Q4_K", 4096, 4096), ("8B output", "Q6_K", 128256, 4096),
    ("SmolLM2 output", "Q8_0", 49152, 576), ("SmolLM2 ffn_down", "Q4_1", 576, 1536),
    ("Gemma-3 output", "Q8_0", 262144, 640), ("Gemma-3 ffn_down", "Q6_K", 640, 2048),
]
CONFIGS = [(r, wg) for wg in (1, 2, 4) for r in (1, 2, 4, 8)]
SPIN = cp.RawKernel(r"""
extern "C" __global__ void spin(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}""", "spin")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    k = L.Kernels()
    rng = np.random.default_rng(0)
    results = []
    for name, tname, rows, cols in SHAPES:
        t = BY_NAME[tname]
        p = repack(random_blocks(t, rows * cols, rng, scale=0.05), t, rows, cols)
        dev = cp.asarray(p.buffer)
        o = p.offsets
        b = dev.data.ptr
        m = L.Mat(t, rows, cols, b + o["qs"], b + o["qh"] if "qh" in o else 0, b + o["sc"] if "sc" in o else 0,
                  b + o["d"] if "d" in o else 0)
        x = cp.asarray(rng.standard_normal(cols).astype(np.float32))
        ref = cp.zeros(rows, cp.float32)
        L.mmv(k, [m], [(ref.data.ptr, rows)], [None], x.data.ptr, cols, 1, 0)
        default = L.mmv_config([m.struct], [rows], cols, 1)
        y = cp.zeros(rows, cp.float32)
        for r, wg in CONFIGS:
            if rows % (r * 4 // wg):
                continue
            run = lambda: L.mmv(k, [m], [(y.data.ptr, rows)], [None], x.data.ptr, cols, 1, 0, config=(r, wg))  # noqa
            run()
            cp.cuda.runtime.deviceSynchronize()
            err = float(cp.linalg.norm(y - ref) / cp.linalg.norm(ref))
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            SPIN((1,), (1,), (cp.int64(50_000_000),))
            e0.record()
            for _ in range(30):
                run()
            e1.record()
            e1.synchronize()
            us = cp.cuda.get_elapsed_time(e0, e1) * 1e3 / 30
            results.append({"matrix": name, "type": tname, "rows": rows, "cols": cols, "R": r, "WG": wg,
                            "us": us, "GBs": dev.nbytes / us / 1e3, "rel_err": err,
                            "default": (r, wg) == default})
        del dev
    best = {}
    for row in results:
        key = (row["matrix"], row["type"])
        if key not in best or row["us"] < best[key]["us"]:
            best[key] = row
    print(f"{'matrix':<18}{'type':<6}{'R':>3}{'WG':>4}{'us':>9}{'GB/s':>8}{'err':>9}")
    for row in results:
        mark = (" <- default" if row["default"] else "") + (" best" if best[(row["matrix"], row["type"])] is row
                                                          else "")
        print(f"{row['matrix']:<18}{row['type']:<6}{row['R']:>3}{row['WG']:>4}{row['us']:>9.1f}{row['GBs']:>8.0f}"
              f"{row['rel_err']:>9.1e}{mark}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
