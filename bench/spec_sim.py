"""speculative_loop's policy replayed over a model's greedy answer with measured step costs (no GPU).

Greedy speculation keeps the target's text, so what each verification keeps is fixed by that text:
the real loop (engine/speculative.py) runs against a stand-in backend whose eval_argmax answers
from the text and whose plain runs yield it, and each verification of r rows and each plainly
decoded token is charged its measured cost. For tuning the policy (k, fall-back runs) between GPU
calls; the costs come from `bench/profile_step.py --verify` (eval_argmax, host included) and the
plain tg rate.

  python3 bench/spec_sim.py MODEL.gguf --costs 1:452,2:495,4:627,8:930 --plain-us 424 [--k 3,7]
      [--start-us 200] [--n 256] [--propose zero] [--text answer.json]   (the answer: made with the numpy backend
      from spec_decode.py's prompt, and saved there, when the file is missing)
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from gguf_runtime.engine import decode_loop as DL
from gguf_runtime.engine.speculative import speculative_loop
from spec_decode import GREEDY, PROMPT


class TextBackend:
    """Verification rows answered from the text; costs in microseconds accumulated in ``us``."""

    verify_rows = 8  # the GPU's: proposals of 1, 3, 7

    def __init__(self, text: list[int], done: int, costs: dict[int, float]) -> None:
        self.text, self.costs, self.n_past, self.us = text, costs, done, 0.0
        self.last_logits = np.eye(max(text) + 1, dtype=np.float32)[text[done]][None]

    def truncate(self, n: int) -> None:
        self.n_past = n

    def eval_argmax(self, tokens: list[int]) -> list[int]:
        p, r = self.n_past, len(tokens)
        self.us += self.costs[r]
        self.n_past += r
        return [self.text[min(p + 1 + i, len(self.text) - 1)] for i in range(r)]

    def start_single(self) -> None:  # (marks a device-decoding backend: fall-back runs happen)
        pass


def plain_run(plain_us: float, start_us: float, depth: int):
    """decode_loop.sample_loop's stand-in: the text after ``given``, a run's start plus plain_us a
    token; hold() stops it after the steps in flight (depth - 1)."""
    def loop(be, n, params, hist, stop, constraint=None, given=None, hold=None):
        pos, held = len(hist) + 1, None
        be.n_past, be.us = len(hist), be.us + start_us
        for i in range(min(n, len(be.text) - pos)):
            if held is not None and i >= held + depth - 1:
                return
            be.us += plain_us
            be.n_past = pos + i
            yield be.text[pos + i]
            if hold is not None and held is None and hold():
                held = i
    return loop


def answer(model: str, n: int, path: str | None) -> tuple[list[int], list[int]]:
    if path and os.path.exists(path):
        d = json.load(open(path))
        return d["prompt"], d["out"]
    from gguf_runtime.engine.engine import Engine
    eng = Engine(model, backend="numpy", n_ctx=1024)
    ids = eng.encode_chat([{"role": "user", "content": PROMPT}])
    stop = frozenset(eng.tokenizer.eog_ids)
    eng.backend.prefill(ids)
    out = []
    for tok in DL.sample_loop(eng.backend, n, GREEDY, list(ids), stop):
        if tok in stop:
            break
        out.append(tok)
    if path:
        json.dump({"prompt": ids, "out": out}, open(path, "w"))
    return ids, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--costs", required=True, help="rows:us of a verification step, e.g. 1:452,2:495,4:627,8:930")
    ap.add_argument("--plain-us", type=float, required=True, help="a plainly decoded token's us (1e6 / plain t/s)")
    ap.add_argument("--start-us", type=float, default=200.0, help="a fall-back run's start (first token's wait)")
    ap.add_argument("--k", default="3,7")
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--text", help="the greedy answer (JSON: prompt, out); made and saved when missing")
    ap.add_argument("--propose", default="ngram", choices=("ngram", "zero"),
                    help="zero: proposals that are always wrong (bench --spec zero: the mechanism's cost)")
    a = ap.parse_args()
    ids, out = answer(a.model, a.n, a.text)
    out = out[:a.n]
    pts = dict(tuple(map(float, c.split(":"))) for c in a.costs.split(","))
    xs = sorted(pts)
    costs = {r: float(np.interp(r, xs, [pts[x] for x in xs])) for r in range(1, 9)}
    DL.sample_loop = plain_run(a.plain_us, a.start_us, 4)  # (speculative_loop imports it at call time)
    text = ids + out
    print(f"{len(out)} tokens after a {len(ids)}-token prompt; plain {1e6 / a.plain_us:,.1f} t/s")
    for k in (int(x) for x in a.k.split(",")):
        be, st = TextBackend(text, len(ids), costs), {}
        zero = lambda hist, kk: [(text[min(len(hist), len(text) - 1)] + 1) % (max(text) + 1)] * kk  # noqa: E731
        got = list(speculative_loop(be, len(out), GREEDY, list(ids), frozenset(), k=k, stats=st,
                                    **({"propose": zero} if a.propose == "zero" else {})))
        assert got == out, "the replay parted from the text"
        rate = len(got) / (be.us * 1e-6)
        print(f"k={k}: {rate:,.1f} t/s ({rate * a.plain_us / 1e6:.2f}x), {st['steps']} verifications, "
              f"{st['accepted']}/{st['proposed']} kept, {st['plain'] / len(got):.0%} decoded plainly")


if __name__ == "__main__":
    main()
