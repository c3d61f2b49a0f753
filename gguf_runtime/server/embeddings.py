"""Embedding requests: the fields of Ollama's /api/embed and /api/embeddings and OpenAI's
/v1/embeddings, their tokenizing, and the vectors in their response bodies (no I/O here).

As Ollama's EmbedHandler: ``input`` a string or a list of strings (absent or "" or []: no
embeddings, the model just loads), ``truncate`` (default true: an input longer than the context is
cut to it; false: a 400), ``dimensions`` (each vector's first N values, normalized again),
``options.num_ctx`` (a smaller context for the cut); every vector L2-normalized. The legacy
/api/embeddings takes one ``prompt`` and answers {"embedding": [...]} (normalized too, as current
Ollama answers it for every model but its old raw BERT paths; no truncation). /v1/embeddings is
Ollama's OpenAI layer over /api/embed (inputs truncated) with OpenAI's input kinds: a string, strings,
token ids, lists of token ids; ``encoding_format`` "float" or "base64" (little-endian float32, as
OpenAI's client decodes it).
"""

from __future__ import annotations

import base64
from typing import Any, Callable

import numpy as np

from ..engine import embed as E
from . import schemas as S

MAX_INPUTS = 2048  # inputs a request (OpenAI's limit)


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def ollama_inputs(body: dict) -> list[str]:
    """/api/embed's ``input``: [] for none (the model loads), else the strings."""
    v = body.get("input")
    if v is None or v == "":
        return []
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise S.bad("input must be a string or a list of strings")
    _check_count(v)
    for i, s in enumerate(v):
        if not s:
            raise S.bad(f"input[{i}] is an empty string; give some text")
    return v


def openai_inputs(body: dict) -> list[str | list[int]]:
    """/v1/embeddings' ``input``: a string, a list of strings, a list of token ids or a list of
    such lists; none of them empty."""
    v = body.get("input")
    if isinstance(v, str):
        if not v:
            raise S.bad("input must not be empty")
        return [v]
    if not isinstance(v, list) or not v:
        raise S.bad("input must be a non-empty string, a list of strings, a list of token ids or a list of lists "
                    "of token ids")
    if _is_ids(v):
        return [v]
    _check_count(v)
    if all(isinstance(s, str) for s in v) or all(_is_ids(s) for s in v):
        for i, s in enumerate(v):
            if not s:
                raise S.bad(f"input[{i}] is empty")
        return v
    raise S.bad("input must be a string, a list of strings, a list of token ids or a list of lists of token ids "
                "(not a mix)")


def _check_count(v: list) -> None:
    if len(v) > MAX_INPUTS:
        raise S.bad(f"input holds {len(v)} items; at most {MAX_INPUTS} a request")


def limit(body: dict, n_ctx: int) -> int:
    """Tokens an input may have: the server's context, or Ollama's smaller options.num_ctx."""
    opts = body.get("options")
    if opts is None:
        return n_ctx
    if not isinstance(opts, dict):
        raise S.bad("options must be an object")
    num_ctx = S.get_int(opts, "num_ctx")
    if num_ctx is None:
        return n_ctx
    if num_ctx < 1:
        raise S.bad(f"options.num_ctx must be a positive number of tokens, got {num_ctx}")
    return min(num_ctx, n_ctx)


def dimensions(body: dict, n_embd: int) -> int | None:
    d = S.get_int(body, "dimensions")
    if d is not None and not 1 <= d <= n_embd:
        raise S.bad(f"dimensions must be from 1 to {n_embd} (the model's embedding size), got {d}")
    return d


def encoding_format(body: dict) -> str:
    f = body.get("encoding_format")
    if f is None:
        return "float"
    if not isinstance(f, str) or f.lower() not in ("float", "base64"):
        raise S.bad(f"encoding_format must be \"float\" or \"base64\", got {f!r}"[:200])
    return f.lower()


def encoder(engine, inputs: list, n: int, truncate: bool) -> Callable[[], list[list[int]]]:
    """The inputs' token ids, each fitted to n tokens (engine/embed.py), for run_embed's helper
    thread; a bad input is a 400 naming it (input, or input[i] of several)."""
    tok, n_vocab = engine.tokenizer, engine.cfg.n_vocab

    def encode() -> list[list[int]]:
        out = []
        for i, x in enumerate(inputs):
            what = "input" if len(inputs) == 1 else f"input[{i}]"
            out.append(E.text_ids(tok, x, n, truncate, what) if isinstance(x, str)
                       else E.token_ids(x, n_vocab, n, truncate, what))
        return out

    return encode


def floats(v: np.ndarray) -> list[float]:
    """A float32 vector as JSON numbers: each value's shortest float32 digits (as Go writes a
    []float32; float64 digits would be twice as long for nothing)."""
    return [float(str(x)) for x in np.asarray(v, np.float32)]


def base64_f32(v: np.ndarray) -> str:
    """OpenAI's base64 encoding: the little-endian float32 bytes."""
    return base64.b64encode(np.asarray(v, "<f4").tobytes()).decode("ascii")
