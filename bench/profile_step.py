"""Where the time goes: per-kernel GPU time of one decode step, with CUDA events.

A spin kernel holds the GPU while the host enqueues one eager step with an event before and after
every kernel, so the kernels then run back to back and each event pair times one kernel without
host launch gaps (events recorded inside a captured graph cannot be timed). Kernels are grouped
by name and printed beside the time per step of the replayed graph.
Usage (GPU machine): python bench/profile_step.py TWIN.gguf [--batch 1 --batch 64] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict

import cupy as cp

from gguf_runtime.backends.cuda.backend import CudaBackend
from gguf_runtime.format.gguf_file import open_gguf
from gguf_runtime.format.model_config import config_from_gguf
from gguf_runtime.sampling import SamplingParams

SPIN = cp.RawKernel(r"""
extern "C" __global__ void spin(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}""", "spin")


def kernel_group(name: str) -> str:
    return re.sub(r"<.*>", "<...>", name) if not name.startswith(("mmv", "mma")) else name


def profile(be: CudaBackend, rows: int, prompt: int = 64) -> dict:
    greedy = SamplingParams(temperature=0.0)
    for s in range(rows):
        be.seq_add(s, list(range(1, prompt + 1)), greedy, 64)
    mode = (False, True)
    be.stream.synchronize()
    with be.stream:
        be._step(rows, mode)  # warm
    be.stream.synchronize()
    be._save_state()
    be.kernels.timeline = []
    with be.stream:
        SPIN((1,), (1,), (cp.int64(200_000_000),))  # ~0.1 s: the whole step is queued behind it
        be._step(rows, mode)
        be._restore_state()
    be.stream.synchronize()
    tl, be.kernels.timeline = be.kernels.timeline, None
    per = defaultdict(lambda: [0, 0.0])
    total = 0.0
    for name, a, b in tl:
        ms = cp.cuda.get_elapsed_time(a, b)
        per[kernel_group(name)][0] += 1
        per[kernel_group(name)][1] += ms
        total += ms
    key = be._graph_for(rows, mode)
    ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
    be.graphs.replay(key)
    ev0.record(be.stream)
    for _ in range(20):
        be.graphs.replay(key)
    ev1.record(be.stream)
    ev1.synchronize()
    graph_ms = cp.cuda.get_elapsed_time(ev0, ev1) / 20
    for s in range(rows):
        be.seq_release(s)
    return {"rows": rows, "kernels": len(tl), "kernel_ms": total, "graph_step_ms": graph_ms,
            "by_kernel": sorted(([k, v[0], v[1]] for k, v in per.items()), key=lambda r: -r[2])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, action="append")
    ap.add_argument("--prompt", type=int, default=64, help="tokens per sequence before the step (its context)")
    ap.add_argument("--json")
    args = ap.parse_args()
    f = open_gguf(args.model)
    cfg = config_from_gguf(f)
    batches = args.batch or [1]
    be = CudaBackend(f, cfg, max(512, args.prompt + 64), max_batch=max(batches))
    weight_bytes = sum(t.nbytes for t in f.tensors.values())
    out = []
    for rows in batches:
        r = profile(be, rows, args.prompt)
        out.append(r)
        print(f"\n{args.model} B={rows} (context {args.prompt}): {r['kernels']} kernels, {r['kernel_ms'] * 1e3:.0f} us of kernel time, "
              f"graph replay {r['graph_step_ms'] * 1e3:.0f} us/step "
              f"(weights {weight_bytes / 1e9:.2f} GB -> {weight_bytes / r['graph_step_ms'] / 1e6:.0f} GB/s)")
        print(f"  {'kernel':<62}{'calls':>6}{'us':>10}{'us/call':>9}{'share':>7}")
        for name, n, ms in r["by_kernel"][:14]:
            print(f"  {name[:62]:<62}{n:>6}{ms * 1e3:>10.1f}{ms * 1e3 / n:>9.2f}{100 * ms / r['kernel_ms']:>6.1f}%")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
