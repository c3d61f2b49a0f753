"""Whether prompt forwards can run beside decode steps on one GPU (issue 34: while serving SmolLM2 at 64
clients the prompt forwards ran serially with the decode steps and took a fifth of their time: RESULTS 209).

    python bench/overlap_probe.py MODEL.gguf [--rows 128] [--every 0,8] [--seconds 3]

Two backends of the same model in one process, each with its own weights, workspace, stream and
graphs: A decodes 64 sequences (its B=64 bucket graph, 128 steps a round, then new sequences), B
evaluates a prompt chunk of ``--rows`` tokens again and again (graphed from its second run). First
each alone, then both at once from two threads: B free-running (--every 0) or one chunk each time A
has made that many more steps (as a server admits a few prompts every few steps). Prints each one's
time a step / chunk alone and together, and for the free-running pair how much of the serial time
the overlap saved (the work both did, at their lone rates, over the wall time: 1.0 = none, 2.0 = all).
A second stream for the server's prompt forwards pays where "A together" stays near "A alone"
(RESULTS 211: on SmolLM2 it does; 212: a server built on that did not serve faster end to end).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gguf_runtime.backends.cuda.backend import CudaBackend  # noqa: E402
from gguf_runtime.format.gguf_file import open_gguf  # noqa: E402
from gguf_runtime.format.model_config import config_from_gguf  # noqa: E402
from gguf_runtime.sampling import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
BATCH, GEN, PROMPT = 64, 128, 32


class Decoder:
    """A: rounds of BATCH sequences x GEN steps; only the steps are timed."""

    def __init__(self, be, seed: int = 0) -> None:
        self.be, self.rng = be, np.random.default_rng(seed)
        self.steps, self.busy = 0, 0.0

    def round(self, stop: threading.Event | None = None) -> None:
        be = self.be
        for s in range(BATCH):
            be.seq_add(s, self.rng.integers(10, be.cfg.n_vocab, PROMPT).tolist(), GREEDY, GEN + 1)
        be.stream.synchronize()
        t0 = time.perf_counter()
        for i in range(GEN):
            be.batch_step(BATCH)
            self.steps += 1
            if i % 32 == 31:  # (the pinned ring holds 64 tokens a slot)
                be.stream.synchronize()
            if stop is not None and stop.is_set():
                break
        be.stream.synchronize()
        self.busy += time.perf_counter() - t0
        for s in range(BATCH):
            be.seq_release(s)


class Prompter:
    """B: a chunk of ``rows`` tokens at positions 0.., again and again."""

    def __init__(self, be, rows: int, seed: int = 1) -> None:
        self.be, self.chunks = be, 0
        self.ids = np.random.default_rng(seed).integers(10, be.cfg.n_vocab, rows).tolist()

    def chunk(self) -> None:
        self.be.truncate(0)
        self.be.prefill(self.ids)
        self.chunks += 1


def alone_decode(d: Decoder, seconds: float) -> tuple[float, float]:
    """(ms a step, steps a wall second with the rounds' admissions)."""
    d.steps, d.busy = 0, 0.0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        d.round()
    return 1e3 * d.busy / d.steps, d.steps / (time.perf_counter() - t0)


def alone_prompt(p: Prompter, seconds: float) -> float:
    p.be.stream.synchronize()
    p.chunks, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(8):
            p.chunk()
        p.be.stream.synchronize()
    return 1e3 * (time.perf_counter() - t0) / p.chunks


def together(d: Decoder, p: Prompter, seconds: float, every: int) -> tuple[float, float, float]:
    """Both at once; (A's ms a step, B's ms a chunk, wall seconds)."""
    d.steps, d.busy, p.chunks = 0, 0.0, 0
    stop = threading.Event()
    p_busy = [0.0]

    def prompts() -> None:
        t0 = time.perf_counter()
        while not stop.is_set():
            if every:
                while not stop.is_set() and d.steps < (p.chunks + 1) * every:
                    time.sleep(0.0001)
                if stop.is_set():
                    break
            p.chunk()
            if not every and p.chunks % 8 == 0:
                p.be.stream.synchronize()
        p.be.stream.synchronize()
        p_busy[0] = time.perf_counter() - t0

    th = threading.Thread(target=prompts)
    t0 = time.perf_counter()
    th.start()
    while time.perf_counter() - t0 < seconds:
        d.round()
    stop.set()
    th.join()
    wall = time.perf_counter() - t0
    return 1e3 * d.busy / max(d.steps, 1), 1e3 * p_busy[0] / max(p.chunks, 1), wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, default=128, help="B's prompt chunk (tokens)")
    ap.add_argument("--every", default="0,8", help="B's pace: 0 free-running, K a chunk every K of A's steps")
    ap.add_argument("--seconds", type=float, default=3.0)
    a = ap.parse_args()
    f = open_gguf(a.model)
    cfg = config_from_gguf(f)
    d = Decoder(CudaBackend(f, cfg, PROMPT + GEN + 32, max_batch=BATCH))
    p = Prompter(CudaBackend(f, cfg, a.rows + 16), a.rows)
    d.round()  # warm-up: the bucket's graph
    for _ in range(3):  # warm-up: the chunk's eager run, its capture, a replay
        p.chunk()
    p.be.stream.synchronize()
    step, a_rate = alone_decode(d, a.seconds)
    chunk = alone_prompt(p, a.seconds)
    print(f"alone: A {step:.3f} ms a B={BATCH} step, B {chunk:.3f} ms a {a.rows}-token chunk")
    for every in (int(x) for x in a.every.split(",")):
        s2, c2, wall = together(d, p, a.seconds, every)
        used = d.steps / wall / a_rate + p.chunks / wall / (1e3 / chunk)  # (each one's share of its lone rate)
        line = (f"together (B {'free' if not every else f'every {every} steps'}): A {s2:.3f} ms a step "
                f"({100 * (s2 / step - 1):+.1f}%), B {c2:.3f} ms a chunk; {d.steps} steps, {p.chunks} chunks")
        if every:
            line += f"; serial would add {chunk / every:.3f} ms a step, together added {s2 - step:.3f}"
        else:
            line += f"; the work at lone rates over the wall: {used:.2f}x"
        print(line, flush=True)
    print(f"alone again: A {alone_decode(d, a.seconds)[0]:.3f} ms a step")


if __name__ == "__main__":
    main()
