"""Where a prefill's time goes: host enqueue time, GPU busy time and wall time of one eager
512-token prefill, kernel launches and cuBLAS calls per prefill, and the host functions that cost
most (cProfile). For SmolLM2's pp512, which swings between processes (bench/RESULTS.md).
Usage (GPU machine): python bench/prefill_profile.py TWIN.gguf [--tokens 512] [--reps 5] [--top 18]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import cupy as cp
import numpy as np

from gguf_runtime.backends.cuda.backend import CudaBackend
from gguf_runtime.format.gguf_file import open_gguf
from gguf_runtime.format.model_config import config_from_gguf
from profile_step import SPIN  # bench/: this script's folder is on sys.path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--top", type=int, default=18)
    a = ap.parse_args()
    f = open_gguf(a.model)
    cfg = config_from_gguf(f)
    be = CudaBackend(f, cfg, 2 * a.tokens)
    ids = np.random.default_rng(0).integers(10, cfg.n_vocab, a.tokens).tolist()
    s, ev0, ev1 = be.stream, cp.cuda.Event(), cp.cuda.Event()

    def once() -> tuple[float, float, float]:
        be.truncate(0)
        s.synchronize()
        t0 = time.perf_counter()
        ev0.record(s)
        be.prefill(ids)
        ev1.record(s)
        t1 = time.perf_counter()
        s.synchronize()
        t2 = time.perf_counter()
        return (t1 - t0) * 1e3, cp.cuda.get_elapsed_time(ev0, ev1), (t2 - t0) * 1e3

    once()
    n0 = be.kernels.launches
    once()
    launches = be.kernels.launches - n0
    runs = [once() for _ in range(a.reps)]
    host, gpu, wall = (statistics.median(r[i] for r in runs) for i in range(3))
    pr = cProfile.Profile()
    be.truncate(0)
    s.synchronize()
    pr.enable()
    be.prefill(ids)
    s.synchronize()
    pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(a.top)
    print(out.getvalue())
    # GPU time alone: the same prefill queued behind a spin, so no host gap shows
    be.truncate(0)
    s.synchronize()
    with s:
        SPIN((1,), (1,), (cp.int64(400_000_000),))
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    e0.record(s)
    be.prefill(ids)
    e1.record(s)
    e1.synchronize()
    gpu_only = cp.cuda.get_elapsed_time(e0, e1)
    print(f"{a.model} prefill {a.tokens}: {launches} kernel launches (RawKernel); medians of {a.reps}: "
          f"host enqueue {host:.2f} ms, events {gpu:.2f} ms, wall {wall:.2f} ms "
          f"({a.tokens / wall * 1e3:,.0f} t/s); GPU alone (queued behind a spin) {gpu_only:.2f} ms")
    print("runs (host, events, wall ms):", [tuple(round(x, 2) for x in r) for r in runs])


if __name__ == "__main__":
    main()
