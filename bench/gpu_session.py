"""One GPU-machine session: build twins, run the GPU tests, compute-sanitizer, benchmarks.

The benchmarks are `gguf-run bench TWIN --batch ... --json` (one process per twin); each twin's
JSON (and plot, where matplotlib is installed) lands in $OUT beside bench.json, which holds them all.

Usage (on the device machine, from the repo root, after `source .device/env.sh`):
    [GGUF_RUN_COMMIT=abc1234] python bench/gpu_session.py [--skip-tests] [--skip-8b] [--only NAME] [--reps 5]
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
    """`gguf-run bench TWIN --json` per twin: a short first run (NVRTC compile, graph capture: its
    load time is the fresh-machine figure), then the recorded one; tables printed from the JSON."""
    from gguf_runtime.tools.bench_report import render_table

    batch = ["--batch", ",".join(map(str, batches))] if batches else []
    try:
        import matplotlib  # noqa: F401
        has_plot = True
    except ImportError:
        has_plot = False
    results = []
    for name in names:
        path = f"{TWINS}/{name}.gguf"
        base = [sys.executable, "-m", "gguf_runtime", "bench", path, "--json", "-q"]
        first = _bench_json(base + ["-p", "16", "-n", "4", "-r", "1", *batch], f"{TWINS}/bench-{name}-first.json")
        plot = ["--plot", os.path.join(OUT, f"bench-{name}.png")] if has_plot else []
        res = _bench_json(base + ["-r", str(reps), *batch, *plot], os.path.join(OUT, f"bench-{name}.json"))
        if res is None:
            continue
        res["twin"] = name
        res["first_load_s"] = first["load_s"] if first else None
        results.append(res)
        print(f"\n{name} (load {res['load_s']:.2f} s; first load on this machine "
              f"{res['first_load_s'] or float('nan'):.2f} s)\n{render_table(res)}", flush=True)
    return results


def _bench_json(cmd: list[str], out: str) -> dict | None:
    with open(out, "w") as fh, open(os.path.join(OUT, "bench.log"), "a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        t0 = time.time()
        try:
            rc = subprocess.run(cmd, stdout=fh, stderr=log, timeout=900).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    print(f"[{time.time() - t0:6.1f}s] rc={rc} {' '.join(cmd)[:110]}", flush=True)
    if rc != 0:
        tail("bench.log", 10)
        return None
    with open(out) as fh:
        return json.load(fh)


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
        results = bench(names, args.reps, [int(b) for b in args.batches.split(",") if b])
        with open(os.path.join(OUT, "bench.json"), "w") as fh:
            json.dump({"results": results, "summary": summary}, fh, indent=1)
        print(f"\n{'model':<12}{'test':<14}{'mode':<7}{'mean':>12}{'stdev':>10}{'median':>12}{'GB/s':>9}{'share':>7}")
        for res in results:
            for r in res["rows"]:
                gbs = f"{r['gbs']:9.1f}{100 * r['share']:6.1f}%" if r["gbs"] and r["share"] else ""
                print(f"{res['twin']:<12}{r['test']:<14}{r['mode']:<7}{r['mean']:>12.2f}{r['stdev']:>10.2f}"
                      f"{r['median']:>12.2f}{gbs}")
    print("summary:", summary)


if __name__ == "__main__":
    main()
