"""Where the time goes: per-kernel GPU time of one decode step, with CUDA events.

A spin kernel holds the GPU while the host enqueues one eager step with an event before and after
every kernel, so the kernels then run back to back and each event pair times one kernel without
host launch gaps (events recorded inside a captured graph cannot be timed). Kernels are grouped
by name and printed beside the time per step of the replayed graph.
Usage (GPU machine): python bench/profile_step.py TWIN.gguf [--batch 1 --batch 64] [--json OUT]
--verify: each --batch is the rows of a speculative verification step of one sequence
(prefill._verify_rows, as eval_argmax runs it), also timed whole from the host (staging, graph,
argmax, readback).
--packed: each --batch is the prompts (of --prompt tokens) the server admits in one packed forward
(seq_prefill_many: prefill._packed_rows' kernels and graph; the whole admission, its finiteness
check and first tokens included, timed from the host).
--shard W: rank 0's part of the model split over W GPUs (format/shard.py), alone on this GPU with
its sums and the logits' gather left out: a split rank's own kernels, on a machine of one GPU.
--kdir DIR (repeatable): each batch step also with DIR's kernels (a copy of quant_kernels/, e.g. an
older tree's), in this process, the trees alternating over two rounds: us a call per kernel side by
side, and each tree's graph step.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from collections import defaultdict

import cupy as cp
import numpy as np

from gguf_runtime.backends.cuda.backend import CudaBackend
from gguf_runtime.format.gguf_file import open_gguf
from gguf_runtime.format.model_config import config_from_gguf
from gguf_runtime.format.shard import ShardedFile, check_split
from gguf_runtime.quant_kernels.sources import SRC_DIR
from gguf_runtime.sampling import SamplingParams

SPIN = cp.RawKernel(r"""
extern "C" __global__ void spin(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}""", "spin")


class OneRank:
    """The collectives of rank 0 of ``world`` with no other rank: no sums, no gather (the rank's
    kernels run and are timed; its logits are not the model's)."""

    def __init__(self, world: int) -> None:
        self.world, self.rank = world, 0
        self.oneshot_floats = self.norm_rows = 0

    def setup(self, kernels, logits_rows: int, vocab_part: int, *args, **kwargs) -> None:
        self.part = cp.zeros((logits_rows, vocab_part), cp.float32)

    def all_reduce(self, x) -> None:
        pass

    def gather_logits(self, t: int, out) -> None:
        pass

    def agree_min(self, n: int) -> int:
        return n

    def sums_in_norm(self, t: int) -> bool:
        return False

    def abort(self) -> None:
        pass


def kernel_group(name: str) -> str:
    return re.sub(r"<.*>", "<...>", name) if not name.startswith(("mmv", "mma")) else name


def _timeline(be: CudaBackend, run) -> tuple[int, float, list]:
    """run() eager behind the spin kernel, every kernel between two events: (kernels, ms, by name)."""
    be.kernels.timeline = []
    with be.stream:
        SPIN((1,), (1,), (cp.int64(200_000_000),))  # ~0.1 s: the whole step is queued behind it
        run()
    be.stream.synchronize()
    tl, be.kernels.timeline = be.kernels.timeline, None
    per = defaultdict(lambda: [0, 0.0])
    total = 0.0
    for name, a, b in tl:
        ms = cp.cuda.get_elapsed_time(a, b)
        per[kernel_group(name)][0] += 1
        per[kernel_group(name)][1] += ms
        total += ms
    return len(tl), total, sorted(([k, v[0], v[1]] for k, v in per.items()), key=lambda r: -r[2])


def _replay_ms(be: CudaBackend, key, n: int = 20) -> float:
    ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
    be.graphs.replay(key)
    ev0.record(be.stream)
    for _ in range(n):
        be.graphs.replay(key)
    ev1.record(be.stream)
    ev1.synchronize()
    return cp.cuda.get_elapsed_time(ev0, ev1) / n


def profile(be: CudaBackend, rows: int, prompt: int = 64) -> dict:
    greedy = SamplingParams(temperature=0.0)
    for s in range(rows):
        be.seq_add(s, list(range(1, prompt + 1)), greedy, 64)
    mode, deep = (False, True), be._deep(rows)  # (deep: the batch step's attention at depth, as batch_step)
    be.stream.synchronize()
    with be.stream:
        be._step(rows, mode, deep)  # warm
    be.stream.synchronize()
    be._save_state()
    n_k, total, by = _timeline(be, lambda: (be._step(rows, mode, deep), be._restore_state()))
    graph_ms = _replay_ms(be, be._graph_for(rows, mode, deep))
    for s in range(rows):
        be.seq_release(s)
    return {"rows": rows, "kernels": n_k, "kernel_ms": total, "graph_step_ms": graph_ms, "by_kernel": by}


def profile_verify(be: CudaBackend, rows: int, prompt: int) -> dict:
    """A verification step of ``rows`` tokens at depth ``prompt`` of slot 0 (the single-sequence
    path): kernels eager, its captured graph replayed, and eval_argmax timed whole from the host."""
    rng = np.random.default_rng(rows)
    ids = [int(t) for t in rng.integers(0, be.cfg.n_vocab, prompt + rows)]
    be.truncate(0)
    be.prefill(ids[:prompt])
    chunk = ids[prompt:]
    for _ in range(3):  # the second run captures the graph
        be.truncate(prompt)
        be.eval_argmax(chunk)
    be.stream.synchronize()
    be.truncate(prompt)
    with be.stream:
        be._stage(0, np.asarray(chunk, np.int32), prompt, be.ws.logits.shape[0])
    n_k, total, by = _timeline(be, lambda: be._verify_rows(rows))
    graph_ms = _replay_ms(be, ("verify", rows))
    n = 50
    be.stream.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        be.truncate(prompt)
        be.eval_argmax(chunk)
    host_ms = (time.perf_counter() - t0) / n * 1e3
    be.truncate(0)
    return {"rows": rows, "verify": True, "kernels": n_k, "kernel_ms": total, "graph_step_ms": graph_ms,
            "eval_argmax_ms": host_ms, "by_kernel": by}


def profile_packed(be: CudaBackend, n: int, prompt: int) -> dict:
    """n prompts of ``prompt`` tokens admitted together (seq_start each, then seq_prefill_many with
    their first tokens), as the server admits them: the packed forward's kernels eager, its graph
    replayed, and whole admissions timed from the host (each with its release)."""
    greedy = SamplingParams(temperature=0.0)
    rng = np.random.default_rng(n * 7919 + prompt)
    prompts = [[int(x) for x in rng.integers(10, be.cfg.n_vocab, prompt)] for _ in range(n)]
    seen: list[int] = []
    packed = be._packed_rows
    be._packed_rows = lambda rows: (seen.append(rows), packed(rows))[1]  # (its row count: the graph's key)

    def admit() -> None:
        for s, p in enumerate(prompts):
            be.seq_start(s, p, greedy, 16)
        be.seq_prefill_many([(s, p, (p, greedy, 0, False)) for s, p in enumerate(prompts)])

    def release() -> None:
        be.stream.synchronize()
        for s in range(n):
            be.seq_release(s)

    for _ in range(3):  # this size's eager run, then its capture (the wrapper sees those two)
        admit()
        release()
    admit()  # (its ids stay staged for the eager run below)
    be.stream.synchronize()
    be._packed_rows = packed
    rows = seen[-1] if seen else 0
    n_k, total, by = _timeline(be, lambda: packed(rows))
    graph_ms = _replay_ms(be, ("packed", rows)) if ("packed", rows) in getattr(be.graphs, "graphs", {}) else 0.0
    release()
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        admit()
        be.stream.synchronize()
        times.append(time.perf_counter() - t0)
        release()
    return {"rows": rows, "prompts": n, "kernels": n_k, "kernel_ms": total, "graph_step_ms": graph_ms,
            "admit_ms": float(np.median(times)) * 1e3, "by_kernel": by}


def compare(be: CudaBackend, rows: int, prompt: int, trees: list[tuple[str, str]], rounds: int = 2) -> None:
    """profile() of a batch step under each tree's kernels (use_sources), alternating: per-kernel us a
    call (mean over the rounds) side by side."""
    per: dict[str, dict[str, list[float]]] = {}
    graph: dict[str, list[float]] = {}
    for rnd in range(rounds):
        for name, d in trees if rnd % 2 == 0 else trees[::-1]:
            be.kernels.use_sources(d)
            be.retune(be.tune)  # (drops the graphs captured with the other tree's kernels)
            r = profile(be, rows, prompt)
            graph.setdefault(name, []).append(r["graph_step_ms"])
            for k, n, ms in r["by_kernel"]:
                per.setdefault(k, {}).setdefault(name, []).append(ms / n)
    names = [n for n, _ in trees]

    def mean(v: list[float] | None) -> float:
        return 1e3 * sum(v) / len(v) if v else float("nan")
    print(f"\nB={rows} (context {prompt}), us a call, {rounds} rounds")
    print(f"  {'kernel':<62}" + "".join(f"{n[:12]:>13}" for n in names))
    first = sorted(per, key=lambda k: -mean(per[k].get(names[0])))
    for k in first[:14]:
        print(f"  {k[:62]:<62}" + "".join(f"{mean(per[k].get(n)):>13.2f}" for n in names))
    print(f"  {'graph step':<62}" + "".join(f"{mean(graph[n]):>13.1f}" for n in names))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, action="append")
    ap.add_argument("--prompt", type=int, default=64, help="tokens per sequence before the step (its context)")
    ap.add_argument("--verify", action="store_true", help="--batch values are verification rows")
    ap.add_argument("--packed", action="store_true", help="--batch values are prompts admitted in one forward")
    ap.add_argument("--shard", type=int, default=1, metavar="W", help="rank 0's part of a split over W GPUs, alone")
    ap.add_argument("--kdir", action="append", default=[], metavar="DIR",
                    help="also DIR's kernels (a copy of quant_kernels/), alternating in this process")
    ap.add_argument("--json")
    args = ap.parse_args()
    f = open_gguf(args.model)
    cfg = config_from_gguf(f)
    batches = args.batch or [1]
    n_ctx, max_batch = max(512, args.prompt + 64), 1 if args.verify else max(batches)
    if args.shard > 1:
        check_split(f, cfg, args.shard)
        part = ShardedFile(f, cfg, 0, args.shard)
        be = CudaBackend(part, part.config, n_ctx, max_batch=max_batch,
                         comm=OneRank(args.shard))
    else:
        be = CudaBackend(f, cfg, n_ctx, max_batch=max_batch)
    weight_bytes = be.weights.nbytes if args.shard > 1 else sum(t.nbytes for t in f.tensors.values())
    if args.kdir:
        if args.verify or args.packed:
            raise SystemExit("--kdir compares batch steps only")
        trees = [("this tree", SRC_DIR)]
        trees += [(os.path.basename(os.path.normpath(d)), os.path.abspath(d)) for d in args.kdir]
        for rows in batches:
            compare(be, rows, args.prompt, trees)
        return
    out = []
    for rows in batches:
        r = profile_verify(be, rows, args.prompt) if args.verify else \
            profile_packed(be, rows, args.prompt) if args.packed else profile(be, rows, args.prompt)
        out.append(r)
        what = f"verify {rows} rows (eval_argmax {r['eval_argmax_ms'] * 1e3:.0f} us)" if args.verify else \
            f"{rows} prompts packed in {r['rows']} rows (admission {r['admit_ms'] * 1e3:.0f} us)" if args.packed \
            else f"B={rows}"
        if args.shard > 1:
            what += f", rank 0 of {args.shard} alone"
        print(f"\n{args.model} {what} (context {args.prompt}): {r['kernels']} kernels, {r['kernel_ms'] * 1e3:.0f} us of kernel time, "
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
