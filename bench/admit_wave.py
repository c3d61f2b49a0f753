"""The CUDA adapter's host cost of admitting a wave of prompts, without HTTP (the server's scheduler
calls, in its order): ``add`` for every prompt, the step that evaluates them (packed forwards and
their first tokens), then decode steps until each has its tokens, then ``release``.

    python bench/admit_wave.py MODEL.gguf [--prompts 64] [--prompt-len 45] [--tokens 128] [--waves 5]
                                         [--profile]

Prints the median (and min) over the waves of: add (all prompts), evaluate (host time of the step's
prompt part; the device may still run after it), decode (until the last token is read), step (one
decode step, steady state), release, and the whole cycle; --profile adds a cProfile of one more
wave's add and evaluate. A wave's evaluate + add is host time that delays every first token of
the wave (bench/RESULTS.md rows 142-144)."""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gguf_runtime.engine.engine import Engine  # noqa: E402
from gguf_runtime.sampling import SamplingParams  # noqa: E402
from gguf_runtime.server.adapters import make_adapter  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=45)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--waves", type=int, default=5)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    eng = Engine(a.model, backend="cuda", n_ctx=a.ctx, max_batch=a.prompts)
    ad = make_adapter(eng, depth=2, prefix_cache=True)
    be, rng = ad.be, np.random.default_rng(0)
    params = SamplingParams(temperature=0.8, top_k=40)

    def wave(prof=None) -> dict[str, float]:
        prompts = [rng.integers(100, 30000, a.prompt_len).tolist() for _ in range(a.prompts)]
        be.stream.synchronize()
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        for s in range(a.prompts):
            ad.add(s, prompts[s], params, a.tokens)
        t1 = time.perf_counter()
        ad._evaluate()
        t2 = time.perf_counter()
        if prof:
            prof.disable()
        got, steps, ts = dict.fromkeys(range(a.prompts), 0), 0, t2
        while any(v < a.tokens for v in got.values()):
            out = ad.loop.step()
            steps += 1
            if steps == 8:
                ts = time.perf_counter()
            for s, toks in out.items():
                got[s] += len(toks)
        t3 = time.perf_counter()
        for s in range(a.prompts):
            ad.release(s)
        be.stream.synchronize()
        t4 = time.perf_counter()
        return {"add": t1 - t0, "evaluate": t2 - t1, "decode": t3 - t2, "step": (t3 - ts) / max(steps - 8, 1),
                "release": t4 - t3, "cycle": t4 - t0}

    for _ in range(3):  # warm-up: graphs of the packed sizes are captured on their second run
        wave()
    rows = [wave() for _ in range(a.waves)]
    print(f"{a.prompts} prompts of {a.prompt_len} tokens, {a.tokens} tokens each, {a.waves} waves")
    for k in rows[0]:
        v = [r[k] for r in rows]
        print(f"{k:10s} median {1e3 * float(np.median(v)):9.3f} ms  (min {1e3 * min(v):.3f})")
    if a.profile:
        pr = cProfile.Profile()
        wave(pr)
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
        print(s.getvalue())


if __name__ == "__main__":
    main()
