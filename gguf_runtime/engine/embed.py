"""Embeddings: a text's tokens, their final hidden states pooled into one vector, normalized.

As llama.cpp's embedding path: the text is tokenized as a prompt (BOS / EOS as the file asks,
special-token text parsed), run as a sequence of its own, and the final hidden states (after the
output RMSNorm: the lm_head's input) pooled as the file's ``{arch}.pooling_type`` says: 1 mean over
the tokens, 2 the first token (CLS), 3 the last; a decoder LLM has none (or 0) and gets its last
token. Then, as Ollama's /api/embed: L2-normalized, and with ``dimensions`` cut to the first N
values and normalized again (Matryoshka truncation).

Too long an input is cut to the context (``truncate``, Ollama's default) keeping a BOS it starts
with and an EOS it ends with, or refused.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import ContextOverflowError, GGUFError, GGUFRunError, UnsupportedModelError

POOLING_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}  # llama.cpp's enum llama_pooling_type


def pooling_of(cfg) -> str:
    """"mean", "cls" or "last" for the model's pooling_type (none, or no key: a decoder's last token);
    a reranker's rank pooling (a classification head) is refused."""
    p = cfg.pooling_type
    if p == 4:
        raise UnsupportedModelError(f"{cfg.name} is a reranker (pooling_type rank: a classification head over the "
                                    "hidden states); its scores are not computed, so it gives no embeddings")
    return {1: "mean", 2: "cls"}.get(p, "last")


def pool(hidden: np.ndarray, pooling: str) -> np.ndarray:
    """One vector from a sequence's final hidden states [T, n_embd] (float32)."""
    if pooling == "mean":
        return hidden.astype(np.float64).mean(axis=0).astype(np.float32)
    if pooling == "cls":
        return np.array(hidden[0], np.float32)
    if pooling == "last":
        return np.array(hidden[-1], np.float32)
    raise ValueError(f"unknown pooling {pooling!r}")


def normalize(v: np.ndarray) -> np.ndarray:
    """v / |v| (Ollama's normalize: the norm at least 1e-12); NaN or Inf values are an error."""
    if not np.isfinite(v).all():
        raise GGUFError("the embedding contains NaN or Inf values; the model's weights may be damaged")
    norm = float(np.sqrt(np.square(v, dtype=np.float64).sum()))
    return (v / max(norm, 1e-12)).astype(np.float32)


def finish(v: np.ndarray, dimensions: int | None = None) -> np.ndarray:
    """A pooled vector as /api/embed returns it: normalized; with ``dimensions`` below its size, its
    first ``dimensions`` values normalized again."""
    v = normalize(v)
    if dimensions is not None and 0 < dimensions < v.shape[0]:
        v = normalize(v[:dimensions])
    return v


def check_dimensions(dimensions: int | None, n_embd: int, what: str = "dimensions") -> None:
    if dimensions is None:
        return
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= n_embd:
        raise GGUFRunError(f"{what} must be an integer from 1 to {n_embd} (the model's embedding size), got "
                           f"{dimensions!r}"[:300])


def fit(ids: Sequence[int], limit: int, truncate: bool, bos: int | None, eos: int | None,
        what: str = "the input") -> list[int]:
    """ids cut to ``limit`` tokens where ``truncate`` (a leading BOS and a trailing EOS kept, as
    Ollama leaves room for them), else refused when longer."""
    ids = list(ids)
    if len(ids) <= limit:
        return ids
    if not truncate:
        raise ContextOverflowError(f"{what} is {len(ids)} tokens but the context holds {limit}; shorten it or "
                                   "turn truncation on")
    head = 1 if bos is not None and ids[0] == bos else 0
    tail = 1 if eos is not None and len(ids) > head and ids[-1] == eos else 0
    if limit - head - tail < 1:
        raise ContextOverflowError(f"a context of {limit} tokens leaves no room for {what} after its special tokens")
    return ids[:limit - tail] + ids[len(ids) - tail:]


def text_ids(tokenizer, text: str, limit: int, truncate: bool, what: str = "the input") -> list[int]:
    """A text's tokens for an embedding (a prompt's: BOS / EOS as the file asks, special-token text
    parsed, as llama.cpp's embedding tools tokenize), fitted to ``limit`` tokens."""
    if not isinstance(text, str):
        raise GGUFRunError(f"{what} must be a string")
    if not text:
        raise GGUFRunError(f"{what} is empty; give some text")
    # no token covers more bytes than the longest one (characters <= bytes): a text of more bytes
    # than that many tokens can hold is refused untokenized, or (truncate) cut to twice that many
    # characters first, still more tokens than the limit (a 1 MB word costs no minute of BPE)
    most = tokenizer.max_token_bytes * limit
    if len(text) > most:
        if not truncate and len(text.encode("utf-8", "surrogatepass")) > most:
            raise ContextOverflowError(f"{what} is {len(text):,} characters, more than a context of {limit} tokens "
                                       "can hold; shorten it or turn truncation on")
        if truncate:
            text = text[:2 * most]
    ids = tokenizer.encode(text, add_special=True, parse_special=True)
    if not ids:
        raise GGUFRunError(f"{what} is empty after tokenization; give some text")
    return fit(ids, limit, truncate, tokenizer.bos_id if tokenizer.add_bos else None,
               tokenizer.eos_id if tokenizer.add_eos else None, what)


def token_ids(ids: Sequence[int], n_vocab: int, limit: int, truncate: bool, what: str = "the input") -> list[int]:
    """Token ids given as the input (OpenAI's [int] input): checked, fitted, used as they are."""
    if not isinstance(ids, (list, tuple)) or not ids:
        raise GGUFRunError(f"{what} must be a non-empty list of token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < n_vocab for t in ids):
        raise GGUFRunError(f"{what} must hold token ids from 0 to {n_vocab - 1}")
    return fit(ids, limit, truncate, None, None, what)
