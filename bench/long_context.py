"""Long prompts and decoding at depth for one twin, under several tuning variants in ONE process,
alternating over rounds (issue 32's rows: pp4096, pp16384, tg128 at depth 4096 / 16384).

A variant is a comma-joined list of tuning-table overrides (field=value, as GGUF_RUN_TUNE spells
them; "NONE" = the table's own choices). Variants that size nothing (flash, decode_splits, ...)
share one backend and switch with CudaBackend.retune; a variant that sets a sizing field
(prefill_chunk, kv_type) gets a backend of its own, built when its turn comes and freed after.

  python3 bench/long_context.py /tmp/twins/llama3-8b.gguf --pp 4096,16384 --tg-depth 4096,16384 \
      NONE flash=0 prefill_chunk=2048 [--rounds 2] [--reps 3] [--json $OUT/long.json]

Prints one line per measurement as it goes and a table of medians last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import cupy as cp

from gguf_runtime.backends.cuda import tuning
from gguf_runtime.backends.cuda.backend import CudaBackend
from gguf_runtime.format.gguf_file import open_gguf
from gguf_runtime.format.model_config import config_from_gguf
from gguf_runtime.tools.bench import decode_rate, fill_depth, prefill_rate

SIZING = {"prefill_chunk", "kv_type", "q8", "q8_res", "attn_parts"}


def parse(variant: str) -> dict[str, str]:
    return {} if variant == "NONE" else dict(p.split("=", 1) for p in variant.split(","))


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--pp", type=ints, default=[4096])
    ap.add_argument("--tg-depth", type=ints, default=[])
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-pp-old", type=int, default=1 << 30,
                    help="skip pp rows longer than this for variants with flash=0 (the split kernel is slow)")
    ap.add_argument("--json")
    a = ap.parse_args()
    f = open_gguf(a.model)
    cfg = config_from_gguf(f)
    n_ctx = max(a.pp + [d + a.n + 16 for d in a.tg_depth] + [512]) + 64
    weight_bytes = sum(t.nbytes for t in f.tensors.values())
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    shared: CudaBackend | None = None
    res: dict[str, dict[str, list[float]]] = {v: {} for v in a.variants}
    for r in range(a.rounds):
        for v in a.variants:
            over = parse(v)
            sizing = {k: x for k, x in over.items() if k in SIZING}
            tune = tuning.choose(weight_bytes, overrides=over, n_head_kv=cfg.n_head_kv, sm_count=sms,
                                 head_dim=cfg.head_dim)
            if sizing:
                be = CudaBackend(f, cfg, n_ctx, tune=tune)
            else:
                if shared is None:
                    shared = CudaBackend(f, cfg, n_ctx, tune=tune)
                be = shared
                be.retune(tune)
            t0 = time.perf_counter()
            for n in a.pp:
                if over.get("flash") == "0" and n > a.max_pp_old:
                    continue
                rate = prefill_rate(be, n, a.reps, graph=True)
                res[v].setdefault(f"pp{n}", []).append(rate.median)
                print(f"round {r} {v:<40} pp{n:<6} {rate.median:10.1f} t/s  runs {[round(x) for x in rate.runs]}",
                      flush=True)
            for d in a.tg_depth:
                fill_depth(be, d)
                rate = decode_rate(be, a.n, a.reps, graph=True, depth=d)
                res[v].setdefault(f"tg{a.n}@d{d}", []).append(rate.median)
                print(f"round {r} {v:<40} tg{a.n}@d{d:<6} {rate.median:8.1f} t/s", flush=True)
            print(f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
            if sizing:
                del be
                gc.collect()
                cp.get_default_memory_pool().free_all_blocks()
    tests = sorted({t for rows in res.values() for t in rows}, key=lambda t: (t[:2], int(t[2:].split("@")[0]), t))
    print(f"\n{'variant':<40} " + " ".join(f"{t:>14}" for t in tests))
    for v, rows in res.items():
        print(f"{v:<40} " + " ".join(f"{statistics.median(rows[t]) if t in rows else float('nan'):14.1f}"
                                     for t in tests))
    if a.json:
        json.dump({"model": a.model, "commit": os.environ.get("GGUF_RUN_COMMIT"), "reps": a.reps, "results": res},
                  open(a.json, "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())
