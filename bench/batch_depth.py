"""Batch decode at depth under tuning variants, in ONE process: S_TG (tokens/s over all rows) of
GEN decode steps for batches whose rows sit at even or uneven depths (each row its own sequence).

A variant is a ';'-joined GGUF_RUN_TUNE string ("NONE": the table's own choices); variants must
size nothing (they switch with CudaBackend.retune). A part KDIR=PATH compiles the kernels from
another copy of quant_kernels/ (an older tree's: kernel sources A/B in one process, as
bench/inproc_variants.py's). Rounds alternate the variants on the same
admitted rows, forward in even rounds and backward in odd ones: every measurement moves the rows
GEN tokens deeper, so a fixed order would measure the later variants deeper (slower); with an even
number of rounds each variant's mean depth is the same. (KDIR swaps the kernel sources only, as
in bench/inproc_variants.py: the launchers stay this tree's.)

  python3 bench/batch_depth.py /tmp/twins/llama3-8b.gguf "flash_decode_batch=0" NONE \
      --case 4x4096 --case 16384+7x256 [--gen 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import cupy as cp
import numpy as np

from gguf_runtime.backends.cuda import tuning
from gguf_runtime.backends.cuda.backend import CudaBackend
from gguf_runtime.format.gguf_file import open_gguf
from gguf_runtime.format.model_config import config_from_gguf
from gguf_runtime.quant_kernels.sources import SRC_DIR
from gguf_runtime.sampling import SamplingParams

DEFAULT_CASES = ["4x4096", "8x4096", "16x4096", "16384+7x256", "16384+15x256"]


def lengths(case: str) -> list[int]:
    """'16384+7x256' -> [16384, 256, ... (7 times)]."""
    out = []
    for part in case.split("+"):
        n, _, depth = part.rpartition("x")
        out += [int(depth)] * (int(n) if n else 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--case", action="append")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--size", default="", help="overrides the backend is built with (sizing fields: glu_split, "
                    "mma_max_split; default: the first variant's)")
    a = ap.parse_args()
    cases = [(c, lengths(c)) for c in (a.case or DEFAULT_CASES)]
    f = open_gguf(a.model)
    cfg = config_from_gguf(f)
    batch = max(len(ls) for _, ls in cases)
    max_batch = next(b for b in (1, 2, 4, 8, 16, 32, 64) if b >= batch)
    weight_bytes = sum(t.nbytes for t in f.tensors.values())
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]

    def split(v: str) -> tuple[str, str]:  # (overrides, kernel source folder or "")
        parts = [] if v == "NONE" else v.split(";")
        kdirs = [p.split("=", 1)[1] for p in parts if p.startswith("KDIR=")]
        return ";".join(p for p in parts if not p.startswith("KDIR=")), os.path.abspath(kdirs[0]) if kdirs else ""

    def tune(v: str) -> tuning.Tuning:
        return tuning.choose(weight_bytes, max_batch=max_batch, overrides=split(v)[0],
                             n_head_kv=cfg.n_head_kv, sm_count=sms, head_dim=cfg.head_dim)
    steps = (a.rounds * len(a.variants) + 1) * (a.gen + 1)  # every row's tokens to generate at most
    n_ctx = max(max(ls) for _, ls in cases) + steps + 16
    be = CudaBackend(f, cfg, n_ctx, max_batch=max_batch, tune=tune(a.size or a.variants[0]))
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0)
    sync = be.stream.synchronize
    for name, lens in cases:
        rows = len(lens)
        for s, n in enumerate(lens):
            be.seq_add(s, rng.integers(10, cfg.n_vocab, n).tolist(), params, steps)
        res: dict[str, list[float]] = {v: [] for v in a.variants}
        for r in range(a.rounds):
            for v in (a.variants if r % 2 == 0 else a.variants[::-1]):
                be.kernels.use_sources(split(v)[1] or SRC_DIR)
                be.retune(tune(v))
                be.batch_step(rows)  # the graph's capture and a warm step, untimed
                sync()
                t0 = time.perf_counter()
                for i in range(a.gen):
                    be.batch_step(rows)
                    if i % 32 == 31:  # keep the pinned token ring from lapping
                        sync()
                sync()
                res[v].append(rows * a.gen / (time.perf_counter() - t0))
        for s in range(rows):
            be.seq_release(s)
        sync()
        print(f"{name:<18} " + "  ".join(f"{v}: {statistics.median(r):9.1f}" for v, r in res.items()), flush=True)


if __name__ == "__main__":
    main()
