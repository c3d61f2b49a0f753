"""Throughput measurements: prompt processing (pp) and token generation (tg).

Times are taken around synchronized device work (time.perf_counter after a stream sync), after a
warm-up run; each figure is the median of ``reps`` runs, with its standard deviation.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from .sampling import SamplingParams


@dataclass
class Rate:
    test: str  # "pp512", "tg128"
    mode: str  # "eager" or "graph"
    tokens: int
    runs: list[float]  # tokens per second, one per repetition

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    @property
    def stdev(self) -> float:
        return statistics.stdev(self.runs) if len(self.runs) > 1 else 0.0


def _sync(backend) -> None:
    stream = getattr(backend, "stream", None)
    if stream is not None:
        stream.synchronize()


def prefill_rate(backend, n: int = 512, reps: int = 5, seed: int = 0) -> Rate:
    rng = np.random.default_rng(seed)
    ids = rng.integers(10, backend.cfg.n_vocab, n).tolist()
    runs = []
    for r in range(reps + 1):
        backend.truncate(0)
        _sync(backend)
        t0 = time.perf_counter()
        backend.prefill(ids)
        _sync(backend)
        if r:  # the first run warms up
            runs.append(n / (time.perf_counter() - t0))
    return Rate(f"pp{n}", "eager", n, runs)


def decode_rate(backend, n: int = 128, reps: int = 5, graph: bool = False) -> Rate:
    """Greedy generation of n tokens after a one-token prompt, sampling on the device."""
    params = SamplingParams(temperature=0.0)
    runs = []
    for r in range(reps + 1):
        backend.start_decode([1], params)
        _sync(backend)
        t0 = time.perf_counter()
        backend.run_steps(n, params, graph=graph)
        _sync(backend)
        if r:
            runs.append(n / (time.perf_counter() - t0))
    return Rate(f"tg{n}", "graph" if graph else "eager", n, runs)


def batch_rate(backend, batch: int, prompt: int = 128, gen: int = 128, reps: int = 3, seed: int = 0) -> Rate:
    """Generated tokens per second over all sequences, as llama-batched-bench's S_TG: ``batch``
    sequences of ``prompt`` random tokens are admitted (prefill, not timed), then ``gen`` batch
    decode steps are timed (graph replay when the backend uses graphs)."""
    from .backend_cuda import RING

    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0)
    runs = []
    for r in range(reps + 1):
        prompts = [rng.integers(10, backend.cfg.n_vocab, prompt).tolist() for _ in range(batch)]
        for s, p in enumerate(prompts):
            backend.seq_add(s, p, params, gen + 1)
        _sync(backend)
        t0 = time.perf_counter()
        for i in range(gen):
            backend.batch_step(batch)
            if i % (RING // 2) == RING // 2 - 1:  # keep the ring from lapping (as a server would read it)
                _sync(backend)
        _sync(backend)
        dt = time.perf_counter() - t0
        for s in range(batch):
            backend.seq_release(s)
        if r:
            runs.append(batch * gen / dt)
    return Rate(f"B={batch} tg{gen}", "graph" if backend.use_graph else "eager", batch * gen, runs)
