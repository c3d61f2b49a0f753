"""tg128 of one twin under several knob variants in ONE process (the model loads once), alternating
over rounds: a variant is a comma-joined list of GGUF_RUN_* pairs ("NONE" = the defaults) that
CudaBlocks.read_knobs reads; between variants the captured graphs are dropped and recaptured.
One pseudo-pair, KDIR=PATH, compiles the kernels from another copy of quant_kernels/ (e.g. an older
tree's: .old_tree/gguf_runtime/quant_kernels) for that variant: kernel sources A/B in one process.

  python3 bench/inproc_variants.py /tmp/twins/llama3-8b.gguf --rounds 3 \
      NONE GGUF_RUN_MMV_O=4:2 GGUF_RUN_BENCH_SKIP=glu [--json $OUT/inproc.json]

Prints one line per measurement as it goes and a table of medians (t/s, and us per token against
the first variant) last. Only knobs that CudaBlocks.read_knobs reads take effect here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from gguf_runtime.backend_cuda import CudaBackend
from gguf_runtime.bench import decode_rate
from gguf_runtime.gguf_file import open_gguf
from gguf_runtime.model_config import config_from_gguf
from gguf_runtime.quant_kernels.sources import SRC_DIR


def apply(variant: str, base: dict[str, str | None]) -> str:
    """Set the variant's environment; returns the kernel source folder it names (KDIR) or ""."""
    kdir = ""
    for k, v in base.items():  # back to the process's own environment
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    if variant != "NONE":
        for pair in variant.split(","):
            k, v = pair.split("=", 1)
            if k == "KDIR":
                kdir = os.path.abspath(v)
            else:
                os.environ[k] = v
    return kdir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    keys = {p.split("=", 1)[0] for v in a.variants if v != "NONE" for p in v.split(",")} - {"KDIR"}
    base = {k: os.environ.get(k) for k in keys}
    f = open_gguf(a.model)
    be = CudaBackend(f, config_from_gguf(f), 512)
    res: dict[str, list[float]] = {v: [] for v in a.variants}
    for r in range(a.rounds):
        for v in a.variants:
            kdir = apply(v, base)
            be.kernels.use_sources(kdir or SRC_DIR)
            be.blocks.read_knobs()
            be.graphs.clear()
            t0 = time.perf_counter()
            rate = decode_rate(be, a.n, a.reps, graph=True)
            res[v].append(rate.median)
            print(f"round {r} {v:<44} {rate.median:8.1f} t/s  ({time.perf_counter() - t0:.1f} s)", flush=True)
    apply("NONE", base)
    ref = statistics.median(res[a.variants[0]])
    print(f"\n{'variant':<44} {'median t/s':>10} {'rounds':>22} {'us/token vs first':>18}")
    for v, xs in res.items():
        m = statistics.median(xs)
        print(f"{v:<44} {m:10.1f} {' / '.join(f'{x:.0f}' for x in xs):>22} {1e6 / m - 1e6 / ref:18.1f}")
    if a.json:
        json.dump({"model": a.model, "commit": os.environ.get("GGUF_RUN_COMMIT"), "tg": a.n, "reps": a.reps,
                   "results": res}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())
