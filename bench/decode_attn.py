"""Decode attention alone (flash_decode.cu) at depth: one layer's launch for one row, timed with
CUDA events over launches back to back, for KV-cache types, ring shapes, split counts and copies of
the kernel sources (``--src DIR``: another tree's gguf_runtime/quant_kernels, compiled in the same
process, so two versions of a kernel compare in one run; they share this tree's launchers, so a
kernel whose shared-memory layout changed traps at launch: compare those as whole trees in separate
processes). Reports microseconds a launch and the
cache bytes read over that time; the outputs of every variant are compared with the first one's.

  python3 bench/decode_attn.py --shape 8b --depth 4096,16384 --kv f16,q8_0 \
      [--config 8:16:2,4:16:3] [--splits 16,32] [--src .work/old/gguf_runtime/quant_kernels] [--json F]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics

import cupy as cp
import numpy as np

from gguf_runtime.backends.cuda.tuning import Tuning
from gguf_runtime.quant_kernels import kv_layout as KL
from gguf_runtime.quant_kernels import launch_attention as LA
from gguf_runtime.quant_kernels import launchers as L
from gguf_runtime.quant_kernels.sources import SRC_DIR

SHAPES = {"8b": (32, 8, 128), "smollm2": (9, 3, 64), "gemma3": (4, 1, 256), "qwen3moe": (32, 4, 128),
          "gptoss": (64, 8, 64)}  # (heads, KV heads, head dim)
PAGE = 16


def make_cache(rng, depth: int, hkv: int, d: int, kv: str):
    """A cache holding keys 0 .. depth of one sequence in shuffled pages (packed as type kv)."""
    n_pages = depth // PAGE + 1
    table = rng.permutation(n_pages).astype(np.int32)
    pages = []
    for lo in range(0, n_pages, 256):  # packed in slices: the quantizers' temporaries stay small
        x = rng.standard_normal((min(256, n_pages - lo), hkv, PAGE, d)).astype(np.float32)
        pages.append(KL.pack(x, kv))
    raw = np.concatenate(pages)
    return cp.asarray(raw), cp.asarray(raw[rng.permutation(n_pages)]), cp.asarray(table[None, :]), n_pages


def time_one(k, args: dict, reps: int, rounds: int) -> float:
    """Median over rounds of a CUDA graph of ``reps`` launches back to back, per launch (microseconds;
    launched from Python they would time the host's launch rate)."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        LA.flash_decode(k, **args)  # compiles, sets the shared-memory size
        stream.synchronize()
        stream.begin_capture()
        for _ in range(reps):
            LA.flash_decode(k, **args)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        out = []
        for _ in range(rounds):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(stream)
            graph.launch(stream)
            b.record(stream)
            b.synchronize()
            out.append(cp.cuda.get_elapsed_time(a, b) * 1e3 / reps)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--depth", default="16384")
    ap.add_argument("--kv", default="f16,q8_0")
    ap.add_argument("--config", default="rule", help="NW:KT:ST list ('rule': decode_config's)")
    ap.add_argument("--splits", default="rule", help="split counts ('rule': SMs over KV heads)")
    ap.add_argument("--src", action="append", default=[], help="another copy of quant_kernels (repeatable)")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    hq, hkv, d = SHAPES[a.shape]
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    rng = np.random.default_rng(0)
    srcs = [SRC_DIR] + a.src
    kern = L.Kernels(Tuning().knobs())
    rows = []
    for depth, kv in itertools.product([int(x) for x in a.depth.split(",")], a.kv.split(",")):
        kc, vc, table, n_pages = make_cache(rng, depth, hkv, d, kv)
        q = cp.asarray(rng.standard_normal((1, hq * d)).astype(np.float32))
        pos, seq = cp.asarray(np.array([depth], np.int32)), cp.asarray(np.zeros(1, np.int32))
        vb, sb = KL.row_bytes(kv, d)
        nbytes = 2 * (depth + 1) * hkv * (vb + sb)
        configs = [None] if a.config == "rule" else [tuple(int(v) for v in c.split(":")) for c in a.config.split(",")]
        splits = [max(1, min(32, sms // hkv)) if s == "rule" else int(s) for s in a.splits.split(",")]
        first = None
        for src, config, ns in itertools.product(srcs, configs, splits):
            if config and LA.decode_smem(d, config, kv) > LA.DECODE_SMEM_MAX:
                print(f"skip {config}: {LA.decode_smem(d, config, kv)} bytes of shared memory", flush=True)
                continue
            kern.use_sources(src)
            out = cp.zeros((1, hq * d), cp.float32)
            part_o = cp.zeros(hq * ns * d, cp.float32)
            part_ml = cp.zeros(hq * ns * 2, cp.float32)
            counter = cp.zeros(hkv, cp.uint32)
            args = dict(q=q.data.ptr, ldq=hq * d, rows=1, kcache=kc.data.ptr, vcache=vc.data.ptr, pos=pos.data.ptr,
                        seq=seq.data.ptr, table=table.data.ptr, max_pages=n_pages, page_size=PAGE, n_head=hq,
                        n_head_kv=hkv, head_dim=d, scale=1 / math.sqrt(d), cap=0.0, window=0, n_split=ns,
                        part_o=part_o.data.ptr, part_ml=part_ml.data.ptr, counter=counter.data.ptr,
                        out=out.data.ptr, ldo=hq * d, kv=kv, config=config)
            us = time_one(kern, args, a.reps, a.rounds)
            cfg = config or LA.decode_config(d, kv, kern.knobs.decode)
            fn = kern.fn("flash_decode.cu", LA.decode_kernel_name(d, hq // hkv, cfg, kv))
            regs = fn.kernel.attributes["num_regs"]
            res = out.get()
            if first is None:
                first = res
            diff = float(np.linalg.norm(res - first) / np.linalg.norm(first))
            row = dict(shape=a.shape, depth=depth, kv=kv, src=src, config=":".join(map(str, cfg)), splits=ns,
                       us=round(us, 2), tbs=round(nbytes / us / 1e6, 3), regs=regs,
                       smem=LA.decode_smem(d, cfg, kv), diff=diff)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del kc, vc
    print(f"\n| depth | kv | src | NW:KT:ST | splits | us | TB/s | regs | smem | diff |\n|{'---|' * 10}")
    for r in rows:
        src = "this" if r["src"] == SRC_DIR else r["src"].split("/")[-3] if r["src"].count("/") > 2 else r["src"]
        print(f"| {r['depth']} | {r['kv']} | {src} | {r['config']} | {r['splits']} | {r['us']} | {r['tbs']} | "
              f"{r['regs']} | {r['smem']} | {r['diff']:.1e} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
