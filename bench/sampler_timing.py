"""How long the numpy Sampler takes per token over a 262,144-token vocabulary (Gemma-3's), with
and without top-k: the timing that used to be an assertion in tests/test_sampling.py.

Usage: python3 bench/sampler_timing.py [--reps 20]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from gguf_runtime.sampling import Sampler, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(262144) * 2).astype(np.float32)
    x[:5] += 12.0  # a realistic peaked distribution
    hist = rng.integers(0, 262144, 64).tolist()
    for label, params in (("top-k 40, penalty 1.1", SamplingParams(repeat_penalty=1.1, seed=0)),
                          ("no top-k (nucleus search)", SamplingParams(top_k=0, seed=0))):
        s = Sampler(params)
        s.sample(x, hist)
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            s.sample(x, hist)
            times.append(time.perf_counter() - t0)
        print(f"{label:28s} median {1e3 * float(np.median(times)):.2f} ms  (min {1e3 * min(times):.2f})")


if __name__ == "__main__":
    main()
