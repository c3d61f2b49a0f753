"""Tokenizer.partition (llama.cpp's tokenizer_st_partition) against the algorithm it replaced.

``reference_partition`` is the earlier implementation, which follows llama.cpp's loop literally:
the special tokens one at a time by rank (longest UTF-8 text first, then id), each cutting its
leftmost non-overlapping occurrences out of every raw fragment left. It costs tokens times
fragments; Tokenizer.partition gets the same pieces from one pass over the text. The comparison runs
on random vocabularies built to collide (shared prefixes and suffixes, tokens inside tokens,
self-overlapping runs, duplicate texts, multi-byte characters that rank a shorter text first,
lstrip/rstrip) and on the real vocabularies' own special tokens.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from gguf_runtime.errors import UnsupportedModelError
from gguf_runtime.format.tokenizer import (_ASCII_WS, CONTROL, LSTRIP, MAX_SPECIAL_STATES, RSTRIP, UNKNOWN,
                                           Tokenizer, _prefix_count)

from test_tokenizer import SMOLLM2, VOCABS, _model_tok, gemma_path, vocab

NORMAL, CONTROL_T, USER_T, BYTE_T = 1, 3, 4, 6  # tokenizer.ggml.token_type values


def reference_partition(tok: Tokenizer, text: str, parse_special: bool) -> list[str | int]:
    ids = [i for i in tok._special_ids if parse_special or not tok._attrs[i] & (CONTROL | UNKNOWN)]
    by_text: dict[str, tuple[int, int]] = {}
    for rank, i in enumerate(ids):
        by_text.setdefault(tok.tokens[i], (rank, i))
    frags: list[str | int] = [text]
    for t in sorted((t for t in by_text if t in text), key=lambda t: by_text[t][0]):
        tid = by_text[t][1]
        lstrip, rstrip = tok._attrs[tid] & LSTRIP, tok._attrs[tid] & RSTRIP
        out: list[str | int] = []
        for f in frags:
            if isinstance(f, int) or t not in f:
                out.append(f)
                continue
            pos, end = 0, len(f)
            while (hit := f.find(t, pos)) >= 0:
                left = f[pos:hit].rstrip(_ASCII_WS) if lstrip else f[pos:hit]
                if left:
                    out.append(left)
                out.append(tid)
                pos = hit + len(t)
                while rstrip and pos < end and f[pos] in _ASCII_WS:
                    pos += 1
            if pos < end:
                out.append(f[pos:])
        frags = out
    return frags


def synthetic(specials: list[str], kinds: list[int]) -> Tokenizer:
    """A SentencePiece vocabulary: byte tokens, printable ASCII, then ``specials`` with token types
    ``kinds`` (CONTROL_T or USER_T)."""
    tokens = [f"<0x{b:02X}>" for b in range(256)] + [chr(c) for c in range(33, 127)] + specials
    types = [BYTE_T] * 256 + [NORMAL] * 94 + kinds
    return Tokenizer.from_metadata({
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": np.zeros(len(tokens), np.float32),
        "tokenizer.ggml.token_type": np.array(types, np.int32),
        "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 0,
        "tokenizer.ggml.unknown_token_id": 0})


ALPHABET = list("ab<|>") + [" ", "\n", "\t", "é", "€", "\U0001F999"]  # 1 to 4 UTF-8 bytes


def random_vocab(rng: np.random.Generator) -> Tokenizer:
    def word(lo: int, hi: int) -> str:
        return "".join(rng.choice(ALPHABET, int(rng.integers(lo, hi + 1))))

    specials: list[str] = []
    for _ in range(int(rng.integers(1, 40))):
        r = rng.random()
        if r < 0.3 or not specials:
            specials.append(word(1, 6))
        elif r < 0.5:  # an extension of another (shared prefix)
            specials.append(specials[int(rng.integers(len(specials)))] + word(1, 3))
        elif r < 0.65:  # another with something before it (shared suffix)
            specials.append(word(1, 3) + specials[int(rng.integers(len(specials)))])
        elif r < 0.75:  # a run that overlaps itself
            specials.append(rng.choice(ALPHABET[:5]) * int(rng.integers(2, 6)))
        elif r < 0.85:  # a piece of another
            t = specials[int(rng.integers(len(specials)))]
            a = int(rng.integers(len(t)))
            specials.append(t[a:int(rng.integers(a + 1, len(t) + 1))])
        elif r < 0.92:  # a duplicate text (llama.cpp keeps the first by rank)
            specials.append(specials[int(rng.integers(len(specials)))])
        else:  # a long one
            specials.append(word(20, 80))
    kinds = [CONTROL_T if rng.random() < 0.5 else USER_T for _ in specials]
    tok = synthetic(specials, kinds)
    for i in range(350, tok.n_vocab):  # lstrip/rstrip as llama.cpp sets them for some models
        tok._attrs[i] |= (LSTRIP if rng.random() < 0.25 else 0) | (RSTRIP if rng.random() < 0.25 else 0)
    return tok


def random_text(rng: np.random.Generator, tok: Tokenizer) -> str:
    specials = tok.tokens[350:]
    parts = []
    for _ in range(int(rng.integers(0, 60))):
        r = rng.random()
        t = specials[int(rng.integers(len(specials)))]
        if r < 0.35:
            parts.append(t)
        elif r < 0.55:
            parts.append(t[:int(rng.integers(0, len(t) + 1))])
        elif r < 0.7:
            parts.append(t[int(rng.integers(0, len(t) + 1)):])
        elif r < 0.85:
            parts.append("".join(rng.choice([" ", "\n", "\t", "\r"], int(rng.integers(1, 4)))))
        else:
            parts.append("".join(rng.choice(ALPHABET, int(rng.integers(1, 6)))))
    return "".join(parts)


def test_partition_matches_the_reference_on_random_vocabularies(rng) -> None:
    for _ in range(300):
        tok = random_vocab(rng)
        for _ in range(20):
            text = random_text(rng, tok)
            if not text:
                continue
            for parse_special in (False, True):
                want = reference_partition(tok, text, parse_special)
                got = tok.partition(text, parse_special)
                assert got == want, f"{text!r} (parse_special={parse_special})\n got {got}\nwant {want}"


def _real(name: str) -> Tokenizer:
    if name in VOCABS:
        return vocab(name)
    tok = _model_tok(gemma_path() if name == "gemma" else SMOLLM2)
    if tok is None:
        pytest.skip(f"model file not present: {name}")
    return tok


@pytest.mark.parametrize("name", VOCABS + ["gemma", "smollm2"])
def test_partition_matches_the_reference_on_real_vocabularies(name: str, rng) -> None:
    """Texts made of each vocabulary's special tokens, pieces of them and chat-like text."""
    tok = _real(name)
    specials = [tok.tokens[i] for i in tok._special_ids]
    filler = ["Hello", " world", "\n", "\n\n", "  ", "\t", " ", "<", "|", ">", "é", "[", "]", "<s>", "</s>"]
    for _ in range(100):
        parts = []
        for _ in range(int(rng.integers(1, 40))):
            t, r, cut = specials[int(rng.integers(len(specials)))], rng.random(), int(rng.integers(0, 50))
            parts.append(t if r < 0.4 else t[:cut] if r < 0.55 else t[cut:] if r < 0.6
                         else filler[int(rng.integers(len(filler)))])
        text = "".join(parts)
        for parse_special in (False, True):
            assert tok.partition(text, parse_special) == reference_partition(tok, text, parse_special), text


def hostile_vocab(rng: np.random.Generator) -> tuple[Tokenizer, list[str]]:
    """4,096 special tokens, one of them 20,000 characters long."""
    long_tok = "<|" + "".join(rng.choice(list("abcdefghij<|>"), 19_996)) + "|>"
    specials = ["<|im_start|>", "<|im_end|>"] + [f"<|r{i}|>" for i in range(4093)] + [long_tok]
    return synthetic(specials, [CONTROL_T] * len(specials)), specials


def hostile_text(rng: np.random.Generator, specials: list[str], size: int) -> str:
    """A chat-like text thick with special tokens and near misses (prefixes of the long token)."""
    long_tok, parts, n = specials[-1], [], 0
    while n < size:
        r = rng.random()
        if r < 0.3:
            s = "<|im_start|>user\n" + "hello world " * int(rng.integers(0, 4)) + "<|im_end|>\n"
        elif r < 0.7:
            s = specials[int(rng.integers(len(specials) - 1))]
        elif r < 0.8:
            s = long_tok[:int(rng.integers(1, 100))]
        elif r < 0.802:
            s = long_tok[:int(rng.integers(1, 20_000))]
        elif r < 0.803:
            s = long_tok
        else:
            s = specials[int(rng.integers(2, len(specials) - 1))][:-1]
        parts.append(s)
        n += len(s)
    return "".join(parts)


def joined(tok: Tokenizer, frags: list[str | int]) -> str:
    return "".join(f if isinstance(f, str) else tok.tokens[f] for f in frags)


def test_hostile_special_tokens_partition_quickly(rng) -> None:
    """A 4 MB text with about 100,000 special tokens of 4,096 kinds: the reference's work is kinds
    times fragments, the partition's goes with the text (the bound is generous, the gap wide)."""
    tok, specials = hostile_vocab(rng)
    small = hostile_text(rng, specials, 100_000)
    assert tok.partition(small, True) == reference_partition(tok, small, True)
    text = hostile_text(rng, specials, 4_000_000)
    t0 = time.perf_counter()
    frags = tok.partition(text, True)
    assert time.perf_counter() - t0 < 8
    assert joined(tok, frags) == text
    assert specials[-1] in text and tok.token_to_id[specials[-1]] in frags


def test_nested_runs_partition_quickly() -> None:
    """Tokens "a", "aa", ... "a" * 1500 (each a suffix of the next) over long runs of "a": every
    position ends 1500 of them. A run is cut into the longest, and what is left at its end goes to
    the longest that fits, found by halving along the chain of suffixes; a 2-byte "é" run token
    ranks ahead of ASCII ones with more characters."""
    specials = ["a" * k for k in range(1, 1501)] + ["é" * k for k in (3, 700, 900)]
    tok = synthetic(specials, [CONTROL_T] * len(specials))
    text = "".join("a" * n + "é" * m + "b" for n, m in ((3000, 2), (1777, 901), (2, 3), (4500, 1400)) * 3)
    assert tok.partition(text, True) == reference_partition(tok, text, True)
    text = "a" * 2_000_000 + "é" * 1000 + "a" * 1499
    t0 = time.perf_counter()
    frags = tok.partition(text, True)
    assert time.perf_counter() - t0 < 8
    assert joined(tok, frags) == text and frags.count(tok.token_to_id["a" * 1500]) == 1333


def test_too_many_special_token_prefixes_is_one_clear_error(rng) -> None:
    texts = ["".join(rng.choice(list("abcdefghij"), 20_000)) for _ in range(MAX_SPECIAL_STATES // 20_000 + 2)]
    assert _prefix_count(set(texts)) > MAX_SPECIAL_STATES
    with pytest.raises(UnsupportedModelError) as e:
        synthetic(texts, [USER_T] * len(texts))
    assert "distinct prefixes" in str(e.value) and "\n" not in str(e.value)
    # shared prefixes count once: as many characters, a few states each
    shared = ["x" * 19_990 + f"{i:08d}" for i in range(len(texts))]
    assert _prefix_count(set(shared)) < 20_000 + 8 * len(shared)
    synthetic(shared, [USER_T] * len(shared))
