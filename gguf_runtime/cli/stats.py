"""The timing lines `gguf-run run` and `chat` print with --verbose, as `ollama run --verbose` does."""

from __future__ import annotations

import sys

from ..engine.engine import GenerationStats


def fmt_duration(s: float) -> str:
    """Like Go's time.Duration as `ollama run --verbose` prints it."""
    if s >= 1:
        return f"{s:.6f}".rstrip("0").rstrip(".") + "s"
    if s >= 1e-3:
        return f"{s * 1e3:.6f}".rstrip("0").rstrip(".") + "ms"
    return f"{s * 1e6:.3f}".rstrip("0").rstrip(".") + "µs"


def print_stats(st: GenerationStats, out=sys.stderr) -> None:
    rows = [
        ("total duration", fmt_duration(st.total_s)),
        ("load duration", fmt_duration(st.load_s)),
        ("prompt eval count", f"{st.prompt_tokens} token(s)"),
        ("prompt eval duration", fmt_duration(st.prompt_s)),
        ("prompt eval rate", f"{st.prompt_rate:.2f} tokens/s"),
        ("eval count", f"{st.eval_tokens} token(s)"),
        ("eval duration", fmt_duration(st.eval_s)),
        ("eval rate", f"{st.eval_rate:.2f} tokens/s"),
    ]
    if st.spec_steps or st.spec_plain:  # speculative decoding (--spec), as llama.cpp's examples report it
        rows += [("draft acceptance", f"{st.spec_accepted / max(st.spec_proposed, 1):.1%} "
                                      f"({st.spec_accepted} of {st.spec_proposed} proposed)"),
                 ("tokens per step", f"{(st.spec_accepted + st.spec_steps) / max(st.spec_steps, 1):.2f} "
                                     f"({st.spec_steps} steps; {st.spec_plain} tokens decoded plainly)")]
    for k, v in rows:
        print(f"{k + ':':<22}{v}", file=out)
