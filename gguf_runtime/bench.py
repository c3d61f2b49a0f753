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
