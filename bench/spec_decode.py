"""Speculative decoding against plain decoding in one process (issue 36's rows): greedy tokens a
second after the prompt, for the plain launch-ahead loop and for speculative_loop with
  ngram   prompt lookup (engine/speculative.ngram_propose),
  oracle  proposals replaying the speculative path's own greedy output (every one kept: the
          mechanism's bound; it equals the plain run's but where a near tie parts them),
  zero    proposals that are always wrong (none kept: the mechanism's cost),
  draft   a draft model's greedy continuation (--draft FILE, engine/draft.py),
at each --k. Every variant's text must equal the plain run's (greedy). Tokens a step count the
verification steps (the fall-back's plain decoding apart: its share of the tokens is its own
column). Prints a line per run as it goes and a table of medians last.

  python3 bench/spec_decode.py MODEL.gguf [--prompt-file F | --prompt TEXT] [--n 256] [--k 2,4,8]
      [--variants ngram,oracle,zero[,draft]] [--draft FILE] [--reps 3] [--raw] [--json F] [--save-text F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from gguf_runtime.engine.decode_loop import sample_loop
from gguf_runtime.engine.engine import Engine
from gguf_runtime.engine.speculative import ngram_propose, speculative_loop
from gguf_runtime.sampling import SamplingParams

# a code-editing request (issue 36): a function given in the prompt, asked back with one change
CODE = '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
'''
PROMPT = ("Here is a Python function:\n\n" + CODE + "\nRewrite it with the parameter `window` renamed to "
          "`size`, changing nothing else. Answer with the whole function only.\n")
GREEDY = SamplingParams(temperature=0.0, repeat_penalty=1.0)


def timed(eng: Engine, ids: list[int], n: int, loop) -> tuple[list[int], float]:
    """The prompt evaluated afresh, then ``loop(backend, history)``'s tokens (up to n or a stop);
    (tokens, seconds after the prompt)."""
    be = eng.backend
    be.truncate(0)
    be.prefill(ids)
    if hasattr(be, "stream"):
        be.stream.synchronize()
    t0 = time.perf_counter()
    out = []
    for tok in loop(be, list(ids)):
        if tok in eng.tokenizer.eog_ids:
            break
        out.append(tok)
    if hasattr(be, "stream"):
        be.stream.synchronize()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--prompt")
    ap.add_argument("--prompt-file")
    ap.add_argument("--raw", action="store_true", help="no chat template")
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--k", default="4")
    ap.add_argument("--variants", default="ngram,oracle,zero")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--draft", help="the draft model of the draft variant")
    ap.add_argument("--json")
    ap.add_argument("--save-text", help="the plain greedy answer as JSON (prompt, out): spec_sim.py --text")
    a = ap.parse_args()
    text = open(a.prompt_file).read() if a.prompt_file else a.prompt or PROMPT
    eng = Engine(a.model, backend=a.backend, n_ctx=4096, draft=a.draft)
    ids = eng.encode_raw(text) if a.raw or not eng.has_template else \
        eng.encode_chat([{"role": "user", "content": text}])
    stop = frozenset(eng.tokenizer.eog_ids)
    n_vocab = eng.cfg.n_vocab
    plain_loop = lambda be, hist: sample_loop(be, a.n, GREEDY, hist, stop)  # noqa: E731
    ref, _ = timed(eng, ids, a.n, plain_loop)  # (also the warm-up: graphs captured)
    if hasattr(eng.backend, "capture_verify"):  # (speculative_loop's start does it: timed here once)
        t0 = time.perf_counter()
        eng.backend.capture_verify()
        print(f"verification graphs captured in {1e3 * (time.perf_counter() - t0):.0f} ms", flush=True)
    if a.save_text:
        with open(a.save_text, "w") as fh:
            json.dump({"prompt": ids, "out": ref}, fh)
    rows = []
    # the oracle replays the speculative path's own greedy output: a multi-row evaluation may part
    # from the plain run's at a near tie (float32 order), and proposals of the plain run's text would
    # all be rejected past that token. One untimed run per k proposing the plain text gives it.
    own: dict[int, list[int]] = {}
    if "oracle" in a.variants.split(","):
        for k in (int(x) for x in a.k.split(",")):
            done = len(ids)
            prop = lambda hist, kk: ref[len(hist) - done:len(hist) - done + kk]  # noqa: E731
            own[k], _ = timed(eng, ids, a.n, lambda be, hist: speculative_loop(be, a.n, GREEDY, hist, stop, k=k,
                                                                                 propose=prop))
            if own[k] != ref:
                i = next((i for i, (x, y) in enumerate(zip(own[k], ref)) if x != y), min(len(own[k]), len(ref)))
                print(f"oracle k={k}: the speculative text parts from the plain one at token {i} of {len(ref)}")
    for rep in range(a.reps):
        toks, s = timed(eng, ids, a.n, plain_loop)
        assert toks == ref, "the plain loop is not deterministic"
        rows.append(dict(variant="plain", k=0, rep=rep, tokens=len(toks), s=s, tok_s=len(toks) / s, steps=len(toks),
                         accepted=0, proposed=0))
        print(json.dumps(rows[-1]), flush=True)
        for variant in a.variants.split(","):
            for k in (int(x) for x in a.k.split(",")):
                done = len(ids)
                if variant == "ngram":
                    propose = ngram_propose
                elif variant == "draft":
                    propose = eng.draft
                elif variant == "oracle":
                    propose = lambda hist, kk, t=own[k]: t[len(hist) - done:len(hist) - done + kk]  # noqa: E731
                else:  # always wrong: the next reference token plus one
                    propose = lambda hist, kk: [(ref[min(len(hist) - done, len(ref) - 1)] + 1) % n_vocab] * kk  # noqa: E731
                st: dict = {}
                loop = lambda be, hist: speculative_loop(be, a.n, GREEDY, hist, stop, k=k, propose=propose,  # noqa: E731
                                                         stats=st)
                toks, s = timed(eng, ids, a.n, loop)
                rows.append(dict(variant=variant, k=k, rep=rep, tokens=len(toks), s=s, tok_s=len(toks) / s,
                                 steps=st.get("steps", 0), accepted=st.get("accepted", 0),
                                 proposed=st.get("proposed", 0), plain=st.get("plain", 0), plain_s=st.get("plain_s", 0.0),
                                 propose_s=st.get("propose_s", 0.0), verify_s=st.get("verify_s", 0.0),
                                 runs=st.get("runs", 0), same=toks == ref))
                print(json.dumps(rows[-1]), flush=True)
    print(f"\n{len(ref)} tokens a run, prompt {len(ids)} tokens\n")
    print("| variant | k | tok/s (median) | x plain | tokens/step | acceptance | decoded plainly | same text "
          "| us a verification | us a proposal | plain runs | us of a run's token | rest of the time |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    base = statistics.median(r["tok_s"] for r in rows if r["variant"] == "plain")
    keys = sorted({(r["variant"], r["k"]) for r in rows}, key=lambda t: (t[0] != "plain", t))
    for v, k in keys:
        rs = [r for r in rows if (r["variant"], r["k"]) == (v, k)]
        med = statistics.median(r["tok_s"] for r in rs)
        steps = sum(r["steps"] for r in rs)
        prop = sum(r["proposed"] for r in rs)
        acc = sum(r["accepted"] for r in rs)
        per_step = (acc + steps) / steps if v != "plain" and steps else 1.0
        plain_share = sum(r.get("plain", 0) for r in rs) / max(sum(r["tokens"] for r in rs), 1)
        # where a run's time went: verifications, proposals, plain runs, and the rest (host work between them)
        ver_s, prop_s, pl_s = (sum(r.get(f, 0.0) for r in rs) for f in ("verify_s", "propose_s", "plain_s"))
        calls = steps + sum(r.get("runs", 0) for r in rs)
        rest = sum(r["s"] for r in rs) - ver_s - prop_s - pl_s if v != "plain" else 0.0
        plain_toks = sum(r.get("plain", 0) for r in rs)
        print(f"| {v} | {k} | {med:,.1f} | {med / base:.2f} | {per_step:.2f} | {acc / prop if prop else 0:.1%} | "
              f"{plain_share:.0%} | {all(r.get('same', True) for r in rs)} | "
              f"{ver_s / steps * 1e6 if steps else 0:,.0f} | {prop_s / max(calls, 1) * 1e6:,.0f} | "
              f"{sum(r.get('runs', 0) for r in rs)} | {pl_s / plain_toks * 1e6 if plain_toks else 0:,.0f} | "
              f"{rest / max(sum(r['s'] for r in rs), 1e-9):.0%} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
