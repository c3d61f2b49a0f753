"""Perplexity of a model over a text, as llama.cpp's llama-perplexity computes it.

The text's tokens are cut into chunks of ``n_ctx`` tokens, each evaluated from an empty cache with
the vocabulary's BOS in place of its first token (when the file asks for BOS); the second half of
each chunk is scored (every token there has at least n_ctx / 2 of context), so figures compare with
llama-perplexity's at the same context. Two paths through the backend: ``prefill`` evaluates each
chunk as prompt rows (every row's logits); ``decode`` one token per call, as generation does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ..errors import GGUFRunError

ALL_LOGITS_ROWS = 64  # rows per call that return every row's logits (the CUDA workspace holds 64)
PATHS = ("prefill", "decode")


@dataclass
class Perplexity:
    n_ctx: int
    path: str
    chunks: int = 0
    scored: int = 0
    nll: list[float] = field(default_factory=list)  # per scored token, natural log

    @property
    def value(self) -> float:
        return math.exp(float(np.mean(self.nll)))

    @property
    def error(self) -> float:
        """llama-perplexity's estimate: the standard error of the mean NLL, carried through exp."""
        x = np.asarray(self.nll)
        if x.size < 2:
            return 0.0
        return self.value * float(np.std(x, ddof=1)) / math.sqrt(x.size)

    def as_dict(self) -> dict:
        return {"ppl": self.value, "ppl_error": self.error, "n_ctx": self.n_ctx, "path": self.path,
                "chunks": self.chunks, "tokens_scored": self.scored}


def chunks_of(ids: Sequence[int], n_ctx: int, bos: int | None, limit: int = 0) -> list[list[int]]:
    """Whole chunks of n_ctx tokens (the first of each replaced by BOS where there is one)."""
    if n_ctx < 16 or n_ctx % 2:
        raise GGUFRunError(f"a perplexity context of {n_ctx} tokens: give an even number of at least 16")
    n = len(ids) // n_ctx
    if limit:
        n = min(n, limit)
    if n == 0:
        raise GGUFRunError(f"the text is {len(ids):,} tokens: perplexity needs at least one chunk of "
                           f"{n_ctx:,} (use a longer text or a smaller --ctx-size)")
    out = []
    for c in range(n):
        chunk = list(ids[c * n_ctx:(c + 1) * n_ctx])
        if bos is not None:
            chunk[0] = bos
        out.append(chunk)
    return out


def _nll(logits: np.ndarray, targets: Sequence[int]) -> np.ndarray:
    """-log softmax(logits)[target] per row, in float64."""
    x = logits.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(x - m).sum(axis=1))
    if not np.isfinite(lse).all():
        raise GGUFRunError("the model's logits are not finite (NaN or infinity): the file's weights are damaged")
    return lse - x[np.arange(len(targets)), np.asarray(targets)]


def chunk_logits(backend, chunk: Sequence[int], path: str) -> np.ndarray:
    """Logits after each token of the chunk (rows 0..n-2 predict tokens 1..n-1), from an empty cache."""
    backend.truncate(0)
    n = len(chunk) - 1
    if path == "prefill":
        parts = [backend.eval(list(chunk[s:min(s + ALL_LOGITS_ROWS, n)]), all_logits=True)
                 for s in range(0, n, ALL_LOGITS_ROWS)]
        return np.concatenate(parts)
    return np.stack([np.asarray(backend.eval([t])).reshape(-1) for t in chunk[:n]])


def perplexity(backend, ids: Sequence[int], n_ctx: int, bos: int | None, path: str = "prefill",
               limit: int = 0, progress: Callable[[Perplexity], None] | None = None) -> Perplexity:
    if path not in PATHS:
        raise GGUFRunError(f"unknown path {path!r}; choose {' or '.join(PATHS)}")
    res = Perplexity(n_ctx, path)
    first = n_ctx // 2  # the scored tokens: n_ctx/2 .. n_ctx-1
    for chunk in chunks_of(ids, n_ctx, bos, limit):
        logits = chunk_logits(backend, chunk, path)
        res.nll += _nll(logits[first - 1:], chunk[first:]).tolist()
        res.chunks += 1
        res.scored = len(res.nll)
        if progress:
            progress(res)
    return res
