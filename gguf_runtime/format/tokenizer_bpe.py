"""Byte-level BPE (``tokenizer.ggml.model == "gpt2"``) as llama.cpp's ``llm_tokenizer_bpe`` does it.

A text fragment is split into words by the pre-tokenizer regexes of ``tokenizer.ggml.pre`` (each
regex splits every piece left by the previous one and keeps both matches and the text between
them), every word is mapped byte by byte to GPT-2's printable "byte-level" characters, and the
word is merged pair by pair: always the adjacent pair of lowest merge rank, the leftmost one on a
tie (llama.cpp's priority queue order). Results are cached per word, which makes English text
cheap: most words repeat.

The regexes are llama.cpp's (``llama-vocab.cpp``). ``\\s`` is spelled out as llama.cpp's whitespace
set (Unicode White_Space, which its hand-written splitters and its std::regex fallback both use;
``re``'s ``\\s`` would add U+001C..U+001F), and ``\\p{..}`` classes follow llama.cpp's Unicode 15.1
tables (see ``_AFTER_15_1``). Checked against llama.cpp itself on the test vocabularies, SmolLM2
and Gemma-3 with tens of thousands of random multilingual strings.
"""

from __future__ import annotations

import functools
import heapq

import regex

# ---------------------------------------------------------------------------------------------
# GPT-2 byte <-> printable character map (unicode.cpp: unicode_byte_to_utf8_map)


def _byte_map() -> list[str]:
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return [table[b] for b in range(256)]


BYTE_TO_CHAR: list[str] = _byte_map()
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in enumerate(BYTE_TO_CHAR)}
_LATIN1_TO_CHAR = {b: c for b, c in enumerate(BYTE_TO_CHAR)}  # str.translate table


def byte_encode(text: str) -> str:
    """A word's UTF-8 bytes as byte-level characters ("Ġ" for a space...)."""
    return text.encode("utf-8", "surrogatepass").decode("latin-1").translate(_LATIN1_TO_CHAR)


def byte_decode(text: str) -> bytes:
    """llama.cpp's llama_decode_text: byte-level characters back to bytes; a character outside
    the map becomes ``[UNK_BYTE_0x..<token>]`` as in llama.cpp."""
    out = bytearray()
    for ch in text:
        b = CHAR_TO_BYTE.get(ch)
        if b is not None:
            out.append(b)
        else:
            out += b"[UNK_BYTE_0x" + ch.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
    return bytes(out)


# ---------------------------------------------------------------------------------------------
# Pre-tokenizer regexes (llama-vocab.cpp: llm_tokenizer_bpe), in Python `regex` syntax

_WS = r"\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_S, _NS = f"[{_WS}]", f"[^{_WS}]"
_CONTR = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

GPT2 = rf"'s|'t|'re|'ve|'m|'ll|'d| ?\p{{L}}+| ?\p{{N}}+| ?[^{_WS}\p{{L}}\p{{N}}]+|{_S}+(?!{_NS})"
_TAIL = rf"| ?[^{_WS}\p{{L}}\p{{N}}]+[\r\n]*|{_S}*[\r\n]+|{_S}+(?!{_NS})|{_S}+"
LLAMA3 = rf"{_CONTR}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}{{1,3}}" + _TAIL
QWEN2 = rf"{_CONTR}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}" + _TAIL
QWEN35 = (rf"{_CONTR}|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}\p{{M}}]+|\p{{N}}| ?[^{_WS}\p{{L}}\p{{M}}\p{{N}}]+[\r\n]*"
          rf"|{_S}*[\r\n]+|{_S}+(?!{_NS})|{_S}+")
SEED_CODER = (rf"{_CONTR}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}| ?[^{_WS}\p{{L}}\p{{N}}\r\n]+"
              rf"|{_S}*[\r\n]+|{_S}+(?!{_NS})|{_S}+")
_UP, _LO = r"(?:(?=\p{L})[^a-z])", r"(?:(?=\p{L})[^A-Z])"  # llama.cpp's collapsed-regex reading
_TAIL_SLASH = rf"| ?[^{_WS}\p{{L}}\p{{N}}]+[\r\n/]*|{_S}*[\r\n]+|{_S}+(?!{_NS})|{_S}+"
GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UP}*{_LO}+{_CONTR}?|[^\r\n\p{{L}}\p{{N}}]?{_UP}+{_LO}*{_CONTR}?"
         r"|\p{N}{1,3}" + _TAIL_SLASH)
TEKKEN = rf"[^\r\n\p{{L}}\p{{N}}]?{_UP}*{_LO}+|[^\r\n\p{{L}}\p{{N}}]?{_UP}+{_LO}*|\p{{N}}" + _TAIL_SLASH
_BLOOM = rf" ?[^(\s|.,!?…。，、।۔،)]+".replace(r"\s", _WS)
# llama.cpp's "[一-龥ࠀ-一가-퟿]+"; its std::wregex sees non-ASCII whitespace as \v, so U+0800..U+4E00
# skips the spaces in it
_CJK = ("[一-龥\u0800-\u167f\u1681-\u1fff\u200b-\u2027\u202a-\u202e\u2030-\u205e\u2060-\u2fff"
        "\u3001-\u4e00가-퟿]+")

# Code points that got a category after Unicode 15.1, the version of llama.cpp's unicode tables: it
# treats them as unassigned (matched by [^\s\p{L}\p{N}] only), so they are taken out of every
# \p{..} below; the `regex` module knows a newer Unicode.
_AFTER_15_1 = """
558 58B-58C 5C8-5C9 88F 897 B53-B54 C5C CDC 1ACF-1AF0 1B4E-1B4F 1B7F 1C89-1C8A 208F 209D-209F
20C1-20C4 2427-2429 2B96 2E60-2E63 31E4-31E5 A7CB-A7CF A7D2 A7D4 A7DA-A7DD A7E2 A7F1 AB6C-AB6D
FBC3-FBD2 FD90-FD91 FDC8-FDCE 105C0-105F3 107BB-107BF 10940-10959 10D40-10D65 10D69-10D85
10D8E-10D8F 10EC2-10EC7 10EC9-10EEE 10EF0-10EFC 11380-11389 1138B 1138E 11390-113B5 113B7-113C0
113C2 113C5 113C7-113CA 113CC-113D5 113D7-113D8 113E1-113E2 116D0-116E3 11B0A 11B60-11B67
11BC0-11BE1 11BF0-11BF9 11DB0-11DDB 11DE0-11DE9 11DF0-11DF1 11F5A 1246F 12475-1247F 12550-12686
13460-143FA 16100-16139 16D40-16D79 16EA0-16EB8 16EBB-16ED3 16FF2-16FF6 187F8-187FF 18CD6-18CDA
18CFF 18D09-18D20 18D80-18DF2 18E00-19191 191A0-191D2 1B123-1B128 1B168 1CC00-1CCFC 1CD00-1CEB3
1CEBA-1CED0 1CED2-1CED4 1CEDD-1CEFD 1D127-1D128 1D1EB-1D1FF 1D250-1D281 1D6A6 1DB00-1DB1C
1DF1F-1DF24 1DF2B-1DF81 1DF90-1DF96 1DFCD-1DFFF 1E5D0-1E5FA 1E5FF 1E6C0-1E6DE 1E6E0-1E6F5
1E6FE-1E6FF 1F1AE 1F6D8-1F6D9 1F777-1F77A 1F7DA-1F7DB 1F7F1-1F7FF 1F8B2-1F8BB 1F8C0-1F8C1
1F8D0-1F8D8 1FA54-1FA57 1FA89-1FA8F 1FABE 1FAC6 1FAC8 1FACC-1FACD 1FADC-1FADD 1FADF 1FAE9-1FAEB
1FAEF 1FAF9-1FAFA 1FBCB-1FBEF 1FBFA 2B73A-2B73F 2B81E 2CEA2-2CEAD 323B0-33479 3D000-3FC3F"""
_NEW = "[" + "".join("-".join(f"\\U{int(x, 16):08x}" for x in r.split("-"))
                     for r in _AFTER_15_1.split()) + "]"


def _as_llama_cpp(p: str) -> str:
    """Rewrite a pattern's \\p{..} uses for llama.cpp's Unicode 15.1 (regex V1 set syntax):
    positive classes lose the newer code points, negated ones gain them."""
    out, i = [], 0
    while i < len(p):
        if p.startswith("\\p{", i):
            j = p.index("}", i) + 1
            out.append(f"[{p[i:j]}--{_NEW}]")
        elif p[i] == "\\":
            j = i + 2
            out.append(p[i:j])
        elif p[i] == "[":
            j = i + 1
            while p[j] != "]":
                j += 2 if p[j] == "\\" else 1
            j += 1
            cls = p[i:j]
            if "\\p{" in cls:
                cls = f"[{cls}{_NEW}]" if cls.startswith("[^") else f"[{cls}--{_NEW}]"
            out.append(cls)
        else:
            j = i + 1
            out.append(p[i])
        i = j
    return "".join(out)


PRE_REGEXES: dict[str, list[str]] = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "gpt2": [GPT2],
    "llama3": [LLAMA3],
    "qwen2": [QWEN2],
    "qwen35": [QWEN35],
    "starcoder": [r"\p{N}", GPT2],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"],
    "deepseek-coder": ["[\r\n]", rf"{_S}?\p{{L}}+", rf"{_S}?\p{{P}}+", _CJK, r"\p{N}"],
    "gpt4o": [GPT4O],
    "tekken": [TEKKEN],
    "bloom": [_BLOOM],
    "viking": [_BLOOM, r"\p{N}"],
    "seed-coder": [SEED_CODER],
}

# tokenizer.ggml.pre -> (regex set, ignore_merges, add_bos default); from llama_vocab::impl::load
_NAMES: dict[str, tuple[str, bool, bool]] = {"default": ("default", False, False)}
for _names, _spec in (
    ("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
     ("llama3", True, True)),
    ("dbrx smaug-bpe chatglm-bpe", ("llama3", False, False)),
    ("glm4 glm5", ("llama3", True, False)),
    ("gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert "
     "jina-v1-en jina-v2-code roberta-bpe mpt olmo jais trillion granite-docling exaone4",
     ("gpt2", False, False)),
    ("qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open",
     ("qwen2", False, False)),
    ("qwen35", ("qwen35", False, False)),
    ("starcoder refact command-r smollm codeshell exaone minerva-7b mellum2",
     ("starcoder", False, False)),
    ("falcon", ("falcon", False, False)),
    ("deepseek-coder", ("deepseek-coder", False, False)),
    ("gpt-4o llama4 kanana2 talkie minimax-m2", ("gpt4o", False, False)),
    ("tekken", ("tekken", True, True)),
    ("bloom poro-chat gpt3-finnish", ("bloom", False, False)),
    ("viking", ("viking", False, False)),
    ("seed-coder", ("seed-coder", False, False)),
):
    for _n in _names.split():
        _NAMES[_n] = _spec
SUPPORTED_PRE = tuple(sorted(_NAMES))


def pre_tokenizer_spec(pre: str) -> tuple[str, bool, bool] | None:
    """(regex set, ignore_merges, default add_bos) for a ``tokenizer.ggml.pre`` value (``""``
    means llama.cpp's 'default'), or None when unsupported."""
    return _NAMES.get(pre or "default")


_NEW_SET = frozenset(chr(c) for r in _AFTER_15_1.split()
                     for c in range(int(r.split("-")[0], 16), int(r.split("-")[-1], 16) + 1))


# Words are cached, up to CACHED_WORDS of up to CACHED_WORD_CHARS characters each (about 15 MB
# at most): a longer "word" (a run of one letter, base64) is merged afresh, so no prompt can grow
# the cache by its own size.
CACHED_WORDS = 1 << 15
CACHED_WORD_CHARS = 64


@functools.lru_cache(maxsize=None)
def _compiled(kind: str, exact: bool) -> tuple[regex.Pattern, ...]:
    if exact:  # set operations make these about 3x slower: used only when a newer character occurs
        return tuple(regex.compile(f"({_as_llama_cpp(p)})", regex.V1) for p in PRE_REGEXES[kind])
    return tuple(regex.compile(f"({p})") for p in PRE_REGEXES[kind])


# The regex module lets other threads run while it matches a str, and then waits for the GIL again:
# behind a busy thread (a server's scheduler) up to the switch interval per call. Pieces up to this
# many characters are matched holding it (a few microseconds); longer ones let go of it, so a huge
# prompt's split does not stall the other threads (bench/RESULTS.md row 215).
GIL_FREE_CHARS = 4096


def pre_tokenize(text: str, kind: str) -> list[str]:
    """Split as llama.cpp's unicode_regex_split: each regex applies within every piece left by the
    previous one (so look-aheads stop at piece ends); unmatched text stays as its own piece."""
    pieces = [text]
    for rx in _compiled(kind, not text.isascii() and not _NEW_SET.isdisjoint(text)):
        out: list[str] = []
        for piece in pieces:
            out.extend(p for p in rx.split(piece, concurrent=len(piece) > GIL_FREE_CHARS) if p)
        pieces = out
    return pieces


# ---------------------------------------------------------------------------------------------


class BPE:
    """Byte-level BPE over one vocabulary: ``encode(text)`` for one raw-text fragment."""

    SHORT = 48  # words up to this many characters use the quadratic loop, longer ones a heap

    def __init__(self, token_to_id: dict[str, int], merges: list[str], kind: str,
                 ignore_merges: bool):
        self.token_to_id = token_to_id
        self.kind = kind
        self.ignore_merges = ignore_merges
        keys = []
        for m in merges:
            pos = m.find(" ", 1)
            keys.append((m[:pos], m[pos + 1:]) if pos >= 0 else ("", ""))
        # first occurrence wins, as std::unordered_map::emplace
        self.ranks: dict[tuple[str, str], int] = dict(zip(reversed(keys), range(len(keys) - 1, -1, -1)))
        self._word = functools.lru_cache(maxsize=CACHED_WORDS)(self._encode_word)

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        cached, fresh = self._word, self._encode_word
        for piece in pre_tokenize(text, self.kind):
            out.extend(cached(piece) if len(piece) <= CACHED_WORD_CHARS else fresh(piece))
        return out

    def _encode_word(self, piece: str) -> tuple[int, ...]:
        w = byte_encode(piece)
        t2i = self.token_to_id
        if self.ignore_merges and w in t2i:
            return (t2i[w],)
        parts = self.merge(w) if len(w) <= self.SHORT else self.merge_heap(w)
        out: list[int] = []
        for p in parts:
            tid = t2i.get(p)
            if tid is not None:
                out.append(tid)
            else:  # llama.cpp: each byte of the unknown symbol as a one-byte token, if any
                out.extend(t2i[chr(b)] for b in p.encode("utf-8") if b < 0x80 and chr(b) in t2i)
        return tuple(out)

    def merge(self, w: str) -> list[str]:
        """Merge the lowest-rank adjacent pair, leftmost on ties, until none has a rank."""
        parts = list(w)
        get = self.ranks.get
        while len(parts) > 1:
            best, at = None, -1
            for i in range(len(parts) - 1):
                r = get((parts[i], parts[i + 1]))
                if r is not None and (best is None or r < best):
                    best, at = r, i
            if best is None:
                break
            parts[at:at + 2] = [parts[at] + parts[at + 1]]
        return parts

    def merge_heap(self, w: str) -> list[str]:
        """The same merge order with llama.cpp's priority queue (rank, left index); linearithmic
        for long words (a 10,000-letter run would be quadratic in ``merge``)."""
        sym = list(w)
        n = len(sym)
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        heap: list[tuple[int, int, int, str]] = []
        get = self.ranks.get

        def push(left: int, right: int) -> None:
            if left >= 0 and right >= 0:
                r = get((sym[left], sym[right]))
                if r is not None:
                    heapq.heappush(heap, (r, left, right, sym[left] + sym[right]))

        for i in range(1, n):
            push(i - 1, i)
        while heap:
            _, left, right, text = heapq.heappop(heap)
            if not sym[left] or not sym[right] or sym[left] + sym[right] != text:
                continue  # outdated
            sym[left], sym[right] = text, ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            push(prev[left], left)
            push(left, nxt[left])
        return [s for s in sym if s]
