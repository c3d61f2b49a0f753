"""One GPU-machine session: build twins, run the GPU tests, compute-sanitizer, benchmarks.

Usage (on the device machine, from the repo root, after `source .device/env.sh`):
    python bench/gpu_session.py [--skip-tests] [--skip-8b] [--only NAME] [--reps 5]
Logs go to $OUT; the table is printed last. Twin headers come from twins/*.hdr.gguf (made here
with `gguf-run synth --like REAL --header-only`); the 8B twin is built from its preset.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

OUT = os.environ.get("OUT", "/tmp/out")
TWINS = "/tmp/twins"
MODELS = [("smollm2", "twins/smollm2.hdr.gguf"), ("gemma3", "twins/gemma3.hdr.gguf"), ("llama3-8b", None)]


def sh(cmd: list[str], log: str, timeout: int = 600, env: dict | None = None) -> int:
    t0 = time.time()
    with open(os.path.join(OUT, log), "a") as fh:
        fh.write(f"$ {' '.join(cmd)}\n")
        fh.flush()
        try:
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout,
                                env={**os.environ, **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    print(f"[{time.time() - t0:6.1f}s] rc={rc} {' '.join(cmd)[:110]}", flush=True)
    return rc


def tail(log: str, n: int = 25) -> None:
    with open(os.path.join(OUT, log)) as fh:
        lines = fh.read().splitlines()
    print("\n".join(lines[-n:]))


def make_twins(skip_8b: bool, only: str | None) -> list[str]:
    os.makedirs(TWINS, exist_ok=True)
    made = []
    for name, hdr in MODELS:
        if (only and name != only) or (skip_8b and name == "llama3-8b"):
            continue
        src = ["--fill", hdr] if hdr else ["--preset", "llama3-8b-q4_k_m"]
        rc = sh([sys.executable, "-m", "gguf_runtime", "synth", *src, "-o", f"{TWINS}/{name}.gguf", "-q"],
                "twins.log")
        if rc == 0:
            made.append(name)
    return made


def bench(names: list[str], reps: int, batches: list[int]) -> list[dict]:
    import cupy as cp

    from gguf_runtime.backend_cuda import CudaBackend
    from gguf_runtime.bench import batch_rate, decode_rate, prefill_rate
    from gguf_runtime.gguf_file import open_gguf
    from gguf_runtime.model_config import config_from_gguf

    rows = []
    # device copy bandwidth (bytes read + written), the ceiling for decode
    a = cp.empty(1 << 30, cp.uint8)
    b = cp.empty_like(a)
    cp.copyto(b, a)
    cp.cuda.runtime.deviceSynchronize()
    ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
    ev0.record()
    for _ in range(10):
        cp.copyto(b, a)
    ev1.record()
    ev1.synchronize()
    bw = 2 * 10 * a.nbytes / (cp.cuda.get_elapsed_time(ev0, ev1) / 1e3) / 1e9
    del a, b
    cp.get_default_memory_pool().free_all_blocks()
    rows.append({"model": "copy", "test": "d2d GB/s", "mode": "", "median": bw, "stdev": 0.0})
    for name in names:
        path = f"{TWINS}/{name}.gguf"
        f = open_gguf(path)
        cfg = config_from_gguf(f)
        t0 = time.perf_counter()
        be = CudaBackend(f, cfg, 1024)
        first = time.perf_counter() - t0
        del be
        cp.get_default_memory_pool().free_all_blocks()
        t0 = time.perf_counter()
        be = CudaBackend(f, cfg, 1024)
        cp.cuda.runtime.deviceSynchronize()
        load = time.perf_counter() - t0
        rows.append({"model": name, "test": "load s (first, with compile)", "mode": "", "median": first, "stdev": 0})
        rows.append({"model": name, "test": "load s (cached kernels)", "mode": "", "median": load, "stdev": 0})
        for r in (prefill_rate(be, 512, reps), decode_rate(be, 128, reps, graph=False),
                  decode_rate(be, 128, reps, graph=True)):
            rows.append({"model": name, "test": r.test, "mode": r.mode, "median": r.median, "stdev": r.stdev,
                         "runs": r.runs})
        del be
        cp.get_default_memory_pool().free_all_blocks()
        if batches:
            be = CudaBackend(f, cfg, 512, max_batch=max(batches))
            be.capture_buckets()
            for b in batches:
                r = batch_rate(be, b, reps=max(2, reps // 2))
                rows.append({"model": name, "test": r.test, "mode": r.mode, "median": r.median, "stdev": r.stdev,
                             "runs": r.runs})
            del be
        print(f"{name}: " + ", ".join(f"{x['test']} {x['mode']} {x['median']:.1f}" for x in rows
                                      if x["model"] == name), flush=True)
        f.close()
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-8b", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--only")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batches", default="1,8,32,64", help="batch sizes for batched generation ('' = none)")
    ap.add_argument("--tests", default="tests/test_gpu_kernels.py tests/test_gpu_backend.py tests/test_gpu_graphs.py "
                                       "tests/test_gpu_batch.py")
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    sh(["nvidia-smi"], "env.log")
    sh([sys.executable, "-c", "import cupy, numpy; print(cupy.__version__, numpy.__version__)"], "env.log")
    names = make_twins(args.skip_8b, args.only)
    summary = {}
    if not args.skip_tests:
        rc = sh([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-ra", "-p", "no:cacheprovider",
                 *args.tests.split()], "pytest.log", timeout=900, env={"GGUF_TWIN_DIR": TWINS})
        summary["pytest_rc"] = rc
        tail("pytest.log", 40)
        if "smollm2" in names:
            rc = sh(["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "3", sys.executable,
                     "bench/one_step.py", f"{TWINS}/smollm2.gguf"], "sanitizer.log", timeout=600)
            summary["memcheck_rc"] = rc
            tail("sanitizer.log", 6)
    if not args.skip_bench:
        rows = bench(names, args.reps, [int(b) for b in args.batches.split(",") if b])
        with open(os.path.join(OUT, "bench.json"), "w") as fh:
            json.dump({"rows": rows, "summary": summary}, fh, indent=1)
        print(f"\n{'model':<12}{'test':<30}{'mode':<7}{'median':>12}{'stdev':>10}")
        for r in rows:
            print(f"{r['model']:<12}{r['test']:<30}{r['mode']:<7}{r['median']:>12.2f}{r['stdev']:>10.2f}")
    print("summary:", summary)


if __name__ == "__main__":
    main()
