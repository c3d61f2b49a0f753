"""tg128 of one twin under several variants in ONE process (the model loads once), alternating
over rounds: a variant is a comma-joined list of tuning-table overrides (field=value, as
GGUF_RUN_TUNE spells them; "NONE" = the table's own choices), applied with CudaBackend.retune;
between variants the captured graphs are dropped and recaptured. Two pseudo-pairs: KDIR=PATH
compiles the kernels from another copy of quant_kernels/ (e.g. an older tree's:
.old_tree/gguf_runtime/quant_kernels), for kernel sources A/B in one process (only the sources:
the launchers stay this tree's, so where the two trees' launch code differs, e.g. the shared
memory a kernel is given, compare whole trees in separate processes instead); skip=attn+o leaves
those roles' kernels out (bench/skip_roles.py: where the step's time goes).

  python3 bench/inproc_variants.py /tmp/twins/llama3-8b.gguf --rounds 3 \
      NONE mmv.O=4:2 skip=glu kstage=none,post_q8=0 [--json $OUT/inproc.json]

Prints one line per measurement as it goes and a table of medians (t/s, and us per token against
the first variant) last. Only fields that size nothing take effect here (not q8, kv_type,
prefill_chunk, attn_parts: those need a new backend).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import cupy as cp
from skip_roles import skip

from gguf_runtime.backends.cuda import tuning
from gguf_runtime.backends.cuda.backend import CudaBackend
from gguf_runtime.tools.bench import decode_rate, fill_depth
from gguf_runtime.format.gguf_file import open_gguf
from gguf_runtime.format.model_config import config_from_gguf
from gguf_runtime.quant_kernels.sources import SRC_DIR


def parse(variant: str) -> tuple[dict[str, str], str, set[str]]:
    """(tuning overrides, kernel source folder or "", roles to skip)."""
    over, kdir, roles = {}, "", set()
    if variant != "NONE":
        for pair in variant.split(","):
            k, v = pair.split("=", 1)
            if k == "KDIR":
                kdir = os.path.abspath(v)
            elif k == "skip":
                roles = set(filter(None, v.split("+")))
            else:
                over[k] = v
    return over, kdir, roles


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--depth", type=int, default=0, help="tokens in the cache before each tg run (bench -d)")
    ap.add_argument("--json")
    a = ap.parse_args()
    f = open_gguf(a.model)
    be = CudaBackend(f, config_from_gguf(f), max(512, a.depth + a.n + 16))
    weight_bytes = sum(t.nbytes for t in f.tensors.values())
    res: dict[str, list[float]] = {v: [] for v in a.variants}
    for r in range(a.rounds):
        for v in a.variants:
            over, kdir, roles = parse(v)
            be.kernels.use_sources(kdir or SRC_DIR)
            be.retune(tuning.choose(weight_bytes, overrides=over, n_head_kv=be.cfg.n_head_kv,
                                    sm_count=cp.cuda.Device().attributes["MultiProcessorCount"],
                                    head_dim=be.cfg.head_dim, arch=be.cfg.arch, moe=be.cfg.n_expert > 0))
            skip(be, roles)
            t0 = time.perf_counter()
            fill_depth(be, a.depth)
            rate = decode_rate(be, a.n, a.reps, graph=True, depth=a.depth)
            res[v].append(rate.median)
            print(f"round {r} {v:<44} {rate.median:8.1f} t/s  ({time.perf_counter() - t0:.1f} s)", flush=True)
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
