"""Tokenizer from GGUF metadata alone, matching llama.cpp (src/llama-vocab.cpp) id for id.

Encoding follows ``llama_vocab::impl::tokenize``: special tokens are cut out first (user-defined
always, control/unknown only with ``parse_special``; longest text first, each taking its leftmost
non-overlapping occurrences in what is left), then each text fragment goes through ``tokenizer_bpe``
(``gpt2``) or ``tokenizer_spm`` (``llama``; with ``add_space_prefix`` a space goes before the first
fragment and before every fragment that follows a special token). Token attributes and EOG ids get
llama.cpp's text-based fix-ups. Decoding is ``token_to_piece`` per token, i.e. ``llama_detokenize``
without its ``clean_spaces`` pass, so text round-trips.
"""

from __future__ import annotations

import bisect
import codecs
import heapq
import re
import threading
from array import array
from collections import OrderedDict
from typing import Any, Iterable

import numpy as np

from ..errors import GGUFError, UnsupportedModelError
from .tokenizer_bpe import BPE, SUPPORTED_PRE, byte_decode, pre_tokenizer_spec
from .tokenizer_spm import SPACE, SPM

# llama_token_attr bits
UNKNOWN, UNUSED, NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 2, 4, 8, 16, 32
LSTRIP, RSTRIP = 128, 256
_TYPE_ATTR = np.array([0, NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE], np.int64)

K = "tokenizer.ggml."
_EOT = ("<|eot_id|> <|im_end|> <|end|> <end_of_turn> <|endoftext|> <|end_of_text|> <EOT> _<EOT> "
        "[EOT] <｜end▁of▁sentence｜> <end_of_utterance>")
_FIM = {  # key prefix -> texts llama.cpp recognises when the id key is absent
    "fim_pre": "<|fim_prefix|> <fim-prefix> <fim_prefix> <｜fim▁begin｜> <PRE> ▁<PRE> <|code_prefix|> "
               "<|prefix|>",
    "fim_suf": "<|fim_suffix|> <fim-suffix> <fim_suffix> <｜fim▁hole｜> <SUF> ▁<SUF> <|code_suffix|> "
               "<|suffix|>",
    "fim_mid": "<|fim_middle|> <fim-middle> <fim_middle> <｜fim▁end｜> <MID> ▁<MID> <|code_middle|> "
               "<|middle|>",
    "fim_pad": "<|fim_pad|> <fim-pad> <fim_pad> <PAD> [PAD]",
    "fim_rep": "<|fim_repo|> <|repo_name|> <fim-repo> <REPO> <reponame>",
    "fim_sep": "<|file_sep|>",
}
_EOG = ("<|eot_id|> <|im_end|> <|end|> <|return|> <|call|> <|flush|> <|calls|> <end_of_turn> "
        "<|endoftext|> </s> <|eom_id|> <EOT> _<EOT> [EOT] [EOS] <|end_of_text|> <end_of_utterance> "
        "<eos> <turn|> <|tool_response> <｜end▁of▁sentence｜> [e~[").split()
_ASCII_WS = " \t\n\v\f\r"
# distinct prefixes of the special tokens' texts a vocabulary may have: each is a _SpecialMatcher
# state, a few array entries and a step of its construction (Gemma-3's 6,414 special tokens have
# 12,899; a 65,536-token audio codebook "<|s_0|>"... 196,612)
MAX_SPECIAL_STATES = 1 << 21
MODELS = "supported tokenizers: llama (SentencePiece), gpt2 (byte-level BPE)"
_bad = UnsupportedModelError


def _damaged(key: str, value: Any, expected: str) -> GGUFError:
    return GGUFError(f"metadata '{K}{key}' = {_show(value)} is not {expected}; the file is damaged")


def _show(value: Any) -> str:
    """A short, printable rendering of a metadata value (control characters escaped)."""
    text = repr(value if not isinstance(value, np.ndarray) else value.tolist())
    return (text[:60] + "...") if len(text) > 63 else text


def _checked(meta: dict[str, Any]) -> None:
    """Type (and, for ids, integrality) of every tokenizer field read below, before any is used."""
    v = meta.get(K + "pre")
    if v is not None and not isinstance(v, str):
        raise _damaged("pre", v, "a string")
    for key, kinds, what in (("token_type", "iu", "an integer array"), ("scores", "iuf", "a number array")):
        v = meta.get(K + key)
        if v is None:
            continue
        if not isinstance(v, np.ndarray) or v.dtype.kind not in kinds:
            raise _damaged(key, v, what)
        if v.dtype.kind == "f" and not np.isfinite(v).all():
            raise _damaged(key, v[~np.isfinite(v)][:3], "finite")
    merges = meta.get(K + "merges")
    if merges is not None and not (isinstance(merges, list) and all(isinstance(m, str) for m in merges)):
        raise _damaged("merges", merges, "an array of strings")
    for key, v in meta.items():
        if not key.startswith(K):
            continue
        name = key[len(K):]
        if name.endswith("_token_id") and (isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer))):
            raise _damaged(name, v, "an integer token id")
        if name.startswith("add_") and not isinstance(v, (bool, int, np.bool_, np.integer)):
            raise _damaged(name, v, "a boolean")


def _trie_pattern(words: set[str]) -> str:
    """A regex matching wherever one of ``words`` starts (a trie, so re skips fast)."""
    trie: dict = {}
    for w in words:
        node = trie
        for ch in w:
            if node.get("") is True:
                break  # a shorter word already matches here
            node = node.setdefault(ch, {})
        node.clear()
        node[""] = True

    def build(node: dict) -> str:
        alts = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch]
        return alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")" if alts else ""

    return build(trie)


def _prefix_count(texts: set[str]) -> int:
    """The number of distinct non-empty prefixes of ``texts`` (the states of a trie holding them)."""
    total, prev = 0, ""
    for t in sorted(texts):  # each text adds what it does not share with the one before it
        lo, hi = 0, min(len(prev), len(t))
        while lo < hi:  # the longest common prefix, by halving
            mid = (lo + hi + 1) // 2
            if t.startswith(prev[:mid]):
                lo = mid
            else:
                hi = mid - 1
        total += len(t) - lo
        prev = t
    return total


class _SpecialMatcher:
    """Every occurrence of the special tokens in one pass over the text, whatever the tokens are.

    An Aho-Corasick automaton over the token texts: the state after a character is the longest
    suffix of the text so far that begins some token, and its output the longest token that is a
    suffix of it, i.e. the longest token ending at that character. The others ending there are
    that token's suffixes among the tokens (``shorter``). Where the state is the root, a regex over
    the tokens' first (up to) 8 characters skips to the next place one begins. ``texts`` are
    distinct, in rank order; a token is known by its rank."""

    def __init__(self, texts: list[str]):
        # a state's transitions: its one child (code point, state) in one_c/one_n, or, with several
        # (one_c == -2), a dict in many; one_c == -1: none
        one_c, one_n, many = array("i", [-1]), array("i", [0]), {}
        out = array("i", [-1])  # the longest token that is a suffix of the state's string
        parent, code = array("i", [0]), array("i", [0])
        by_depth: list[array] = []  # states at each depth, for the breadth-first pass
        ends = []
        for r, t in enumerate(texts):
            node = 0
            for d, ch in enumerate(t):
                c, oc = ord(ch), one_c[node]
                nxt = one_n[node] if oc == c else many[node].get(c) if oc == -2 else None
                if nxt is None:
                    nxt = len(out)
                    if oc == -1:
                        one_c[node], one_n[node] = c, nxt
                    elif oc == -2:
                        many[node][c] = nxt
                    else:
                        many[node] = {oc: one_n[node], c: nxt}
                        one_c[node] = -2
                    one_c.append(-1)
                    one_n.append(0)
                    out.append(-1)
                    parent.append(node)
                    code.append(c)
                    if d == len(by_depth):
                        by_depth.append(array("i"))
                    by_depth[d].append(nxt)
                node = nxt
            out[node] = r
            ends.append(node)
        fail = array("i", bytes(4 * len(out)))
        for level in by_depth[1:]:  # breadth first: a state's fail is shallower, so already known
            for node in level:
                f, c = fail[parent[node]], code[node]
                while True:
                    oc = one_c[f]
                    nxt = one_n[f] if oc == c else many[f].get(c) if oc == -2 else None
                    if nxt is not None or not f:
                        break
                    f = fail[f]
                fail[node] = f = nxt or 0
                if out[node] < 0:
                    out[node] = out[f]
        self.one_c, self.one_n, self.many, self.fail, self.out = one_c, one_n, many, fail, out
        self.skip = re.compile(_trie_pattern({t[:8] for t in texts}))
        self.size = [len(t) for t in texts]
        # the tokens that are suffixes of a token, longest first, by following suffix links; the
        # 2^k-th one along in up[k], so that the first short enough is found in log steps
        link = [out[fail[node]] for node in ends]
        depth = [0] * len(texts)
        for r in range(len(texts) - 1, -1, -1):  # a suffix is shorter, so ranked after
            if link[r] >= 0:
                depth[r] = depth[link[r]] + 1
        self.up = [link]
        while 1 << len(self.up) <= max(depth):
            prev = self.up[-1]
            self.up.append([prev[a] if a >= 0 else -1 for a in prev])

    def shorter(self, r: int, room: int) -> int:
        """The longest token that is a proper suffix of token ``r`` and at most ``room`` characters
        long (-1 if none)."""
        size, q = self.size, self.up[0][r]
        if q < 0 or size[q] <= room:
            return q
        for up in reversed(self.up):  # the last one longer than room, then one step on
            a = up[q]
            if a >= 0 and size[a] > room:
                q = a
        return self.up[0][q]

    def longest_ending(self, text: str) -> dict[int, array]:
        """For each token rank, the ends (exclusive) of the places where it is the longest token
        ending there, in increasing order."""
        one_c, one_n, many, fail, out = self.one_c, self.one_n, self.many, self.fail, self.out
        search = self.skip.search
        found: dict[int, array] = {}
        state, j, n = 0, 0, len(text)
        while j < n:
            if not state:
                m = search(text, j)
                if m is None:
                    break
                j = m.start()
            c = ord(text[j])
            while True:
                oc = one_c[state]
                nxt = one_n[state] if oc == c else many[state].get(c) if oc == -2 else None
                if nxt is not None or not state:
                    break
                state = fail[state]
            state = nxt or 0
            j += 1
            r = out[state]
            if r >= 0:
                ends = found.get(r)
                if ends is None:
                    ends = found[r] = array("q")
                ends.append(j)
        return found


class FragmentCache:
    """Token ids of recent text pieces of at least MIN_CHARS characters, least recently used out
    past MAX_CHARS characters in all (8 M characters, and about as many bytes of int32 ids); thread-safe
    (the server tokenizes on several threads)."""

    MIN_CHARS, MAX_CHARS = 64, 1 << 23

    def __init__(self) -> None:
        self._ids: OrderedDict[str, array] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def encode(self, piece: str, fn) -> list[int]:
        if not self.MIN_CHARS <= len(piece) <= self.MAX_CHARS // 8:
            return fn(piece)
        with self._lock:
            ids = self._ids.get(piece)
            if ids is not None:
                self._ids.move_to_end(piece)
                return ids.tolist()
        ids = array("i", fn(piece))
        with self._lock:
            if piece not in self._ids:
                self._ids[piece] = ids
                self._chars += len(piece)
                while self._chars > self.MAX_CHARS:
                    self._chars -= len(self._ids.popitem(last=False)[0])
        return ids.tolist()


class Tokenizer:
    """A GGUF vocabulary: ``model`` is ``"llama"`` (SPM) or ``"gpt2"`` (BPE)."""

    def __init__(self, meta: dict[str, Any]):
        model = meta.get(K + "model")
        if model is not None and not isinstance(model, str):
            raise _damaged("model", model, "a string")
        if model not in ("llama", "gpt2"):
            what = "has no tokenizer.ggml.model" if model is None else f"uses tokenizer {model!r}"
            raise _bad(f"this model {what}; {MODELS}")
        tokens = meta.get(K + "tokens")
        if not isinstance(tokens, list) or not tokens or not isinstance(tokens[0], str):
            raise _bad(f"the GGUF has no tokenizer.ggml.tokens string array ({MODELS}, each needs it)")
        if not all(isinstance(t, str) for t in tokens):
            raise _damaged("tokens", tokens, "an array of strings")
        _checked(meta)
        self.model = model
        self._fragments = FragmentCache()
        n = len(tokens)
        self.tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self.token_to_id: dict[str, int] = dict(zip(reversed(self.tokens), range(n - 1, -1, -1)))

        types, scores = meta.get(K + "token_type"), meta.get(K + "scores")
        t = np.asarray(types[:n] if types is not None and len(types) >= n else [1] * n, np.int64)
        attrs = np.where((t >= 0) & (t < 7), _TYPE_ATTR[np.clip(t, 0, 6)], 0)

        self.pre = meta.get(K + "pre") or ""
        if model == "gpt2":
            merges = meta.get(K + "merges")
            if not isinstance(merges, list):
                raise _bad("this gpt2 (BPE) vocabulary lacks tokenizer.ggml.merges; re-convert the model")
            spec = pre_tokenizer_spec(self.pre)
            if spec is None:
                raise _bad(f"unknown pre-tokenizer tokenizer.ggml.pre={self.pre!r}; supported: "
                           + ", ".join(SUPPORTED_PRE))
            kind, ignore_merges, add_bos = spec
            glm = self.pre in ("glm4", "glm5", "chatglm-bpe")
            prefix, defaults = False, [None if glm else 11, 11, None]
            self._impl: BPE | SPM = BPE(self.token_to_id, merges, kind, ignore_merges)
        else:
            add_bos, prefix, defaults = True, True, [1, 2, 0]
        self.add_space_prefix = bool(meta.get(K + "add_space_prefix", prefix))
        self.add_bos = bool(meta.get(K + "add_bos_token", add_bos))
        self.add_eos = bool(meta.get(K + "add_eos_token", False))

        def sid(key: str, default: int | None = None) -> int | None:
            if default is not None and not 0 <= default < n:
                default = None
            v = meta.get(K + key)
            if v is None:
                return default
            v = int(v)
            return v if 0 <= v < n else default

        self.bos_id, self.eos_id, self.unk_id = (sid(k + "_token_id", d) for k, d in
                                                 zip(("bos", "eos", "unknown"), defaults))
        self.pad_id, self.eot_id, self.eom_id = (sid(k + "_token_id") for k in ("padding", "eot", "eom"))
        for flag, what in ((self.add_bos, "bos"), (self.add_eos, "eos")):
            if flag and getattr(self, what + "_id") is None:
                raise _bad(f"tokenizer.ggml.add_{what}_token is true but the {what} token id is missing")
        fim = {k: sid(k + "_token_id") for k in _FIM}
        for k, old in (("fim_pre", "prefix"), ("fim_suf", "suffix"), ("fim_mid", "middle")):
            fim[k] = sid(old + "_token_id", fim[k])

        self._attrs = attrs.tolist()
        self._fixups(meta, fim)
        if model == "llama":
            ok = scores is not None and len(scores) >= n
            score = np.asarray(scores[:n], np.float64).tolist() if ok else [0.0] * n
            self._impl = SPM(self.tokens, self.token_to_id, score, self.unk_id)
        self._pieces: dict[int, bytes] = {}
        self._special: dict[bool, tuple] = {}
        self._max_token_bytes: int | None = None

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> "Tokenizer":
        return cls(meta)

    @classmethod
    def from_gguf(cls, path: str) -> "Tokenizer":
        """From a GGUF file's header (a header-only file or first chunk will do)."""
        from .gguf_file import open_gguf

        return cls(open_gguf(path, check_data=False).metadata)

    def _fixups(self, meta: dict[str, Any], fim: dict[str, int | None]) -> None:
        """llama.cpp's load-time fix-ups of token attributes and end-of-generation ids."""
        a, t2i = self._attrs, self.token_to_id
        found = {"eot": self.eot_id, "eom": self.eom_id, **fim}
        for k, texts in {"eot": _EOT, "eom": "<|eom_id|>", **_FIM}.items():
            if found[k] is None:  # llama.cpp takes the first in hash order; we, in list order
                found[k] = next((t2i[t] for t in texts.split() if t in t2i), None)
                if found[k] is not None:
                    a[found[k]] |= CONTROL
        self.eot_id, self.eom_id = found["eot"], found["eom"]
        for i, attr in enumerate(a):
            if attr & CONTROL and "unused" in self.tokens[i]:
                a[i] |= UNUSED
        eog = {found[k] for k in ("fim_pad", "fim_rep", "fim_sep") if found[k] is not None}
        for text in _EOG:
            if text in t2i:
                eog.add(t2i[text])
                a[t2i[text]] |= CONTROL
        for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):  # gpt-oss
            if text in t2i:
                a[t2i[text]] = USER_DEFINED
        eog |= {i for i in (self.eos_id, self.eot_id, self.eom_id) if i is not None}
        texts = {self.tokens[i] for i in eog}
        if "<|end|>" in texts and ({"<|return|>", "<|call|>"} <= texts
                                   or {"<|calls|>", "<|flush|>"} <= texts):
            eog.discard(t2i["<|end|>"])
            a[t2i["<|end|>"]] = USER_DEFINED
        if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            eog.discard(t2i["</s>"])
            a[t2i["</s>"]] = NORMAL
        self.eog_ids: frozenset[int] = frozenset(eog)
        special = sorted((i for i, x in enumerate(a) if x & (CONTROL | USER_DEFINED | UNKNOWN)),
                         key=lambda i: -len(self.tokens[i].encode("utf-8")))
        self._special_ids = special
        texts = {self.tokens[i] for i in special}
        if sum(map(len, texts)) > MAX_SPECIAL_STATES and (n := _prefix_count(texts)) > MAX_SPECIAL_STATES:
            raise _bad(f"the vocabulary's {len(texts):,} special tokens have {n:,} distinct prefixes "
                       f"(at most {MAX_SPECIAL_STATES:,}): too many to search text for")
        # per-model attributes llama.cpp sets by name (they are not in GGUF)
        name = str(meta.get("general.name", "")).lower()
        arch = str(meta.get("general.architecture", ""))
        if (any(s in self.pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code"))
                or arch in ("nomic-bert-moe", "jina-bert-v3")) and "<mask>" in t2i:
            a[t2i["<mask>"]] |= LSTRIP
        elif "phi-3" in name or "phi3" in name:
            for i in special + [t2i["</s>"]] * ("</s>" in t2i):
                a[i] |= RSTRIP
            for i in (t2i[t] for t in ("<unk>", "<s>", "<|endoftext|>") if t in t2i):
                a[i] &= ~RSTRIP
        elif "modern-bert" in name and "[MASK]" in t2i:
            a[t2i["[MASK]"]] |= LSTRIP

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    @property
    def max_token_bytes(self) -> int:
        """The UTF-8 length of the longest token's text: no token stands for more bytes of input."""
        if self._max_token_bytes is None:
            self._max_token_bytes = max(len(t.encode("utf-8", "surrogatepass")) for t in self.tokens)
        return self._max_token_bytes

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """llama_tokenize(text, add_special, parse_special). Text pieces between special tokens are
        tokenized independently, so long ones are kept (FragmentCache): a chat history resent with
        one more message costs only that message (the server's prefix-cache case)."""
        frags = self.partition(text, parse_special) if text else []
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)
        prefix = self.add_space_prefix and self.model == "llama"
        prev_special = True  # SPM: prefix a space to each text fragment after a special token
        for f in frags:
            if isinstance(f, int):
                out.append(f)
            else:
                out.extend(self._fragments.encode(" " + f if prefix and prev_special else f, self._impl.encode))
            prev_special = isinstance(f, int)
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return out

    def _special_set(self, parse_special: bool) -> tuple:
        got = self._special.get(parse_special)
        if got is None:
            texts: list[str] = []  # distinct texts in llama.cpp's order: by rank
            tids: list[int] = []
            seen: set[str] = set()
            for i in self._special_ids:
                if (parse_special or not self._attrs[i] & (CONTROL | UNKNOWN)) and self.tokens[i] not in seen:
                    seen.add(self.tokens[i])
                    texts.append(self.tokens[i])
                    tids.append(i)
            got = self._special[parse_special] = (texts, tids, _SpecialMatcher(texts) if texts else None)
        return got

    def partition(self, text: str, parse_special: bool = False) -> list[str | int]:
        """tokenizer_st_partition: the text as raw-text pieces (str) and special-token ids (int).

        llama.cpp takes the special tokens one after another by rank (longest UTF-8 text first) and
        cuts each one's leftmost non-overlapping occurrences out of the raw text left, stripping
        the whitespace next to it for tokens with lstrip/rstrip. The same comes from the occurrences
        alone: _SpecialMatcher lists the longest token ending at each place, and these candidates
        are taken by rank, and within a rank left to right, each cut where its span is still whole
        raw text, else handed on to the longest shorter token ending at the same place that starts
        after the last cut character in the span (any longer one would overlap it). The work goes
        with the occurrences and cuts, not with tokens times fragments."""
        texts, tids, matcher = self._special_set(parse_special)
        if matcher is None:
            return [text]
        buckets = matcher.longest_ending(text)
        if not buckets:
            return [text]
        ranks = list(buckets)
        heapq.heapify(ranks)
        shorter, attrs, n = matcher.shorter, self._attrs, len(text)
        cut = bytearray(n)  # 1: inside a cut token or the whitespace it stripped
        starts = bytearray(n)  # 1: a cut token starts here, its id in ids_at
        ids_at = array("i", bytes(4 * n))
        unsorted: set[int] = set()  # ranks whose ends were not all added in increasing order
        while ranks:
            r = heapq.heappop(ranks)
            ends = buckets.pop(r)
            if r in unsorted:
                ends = array("q", sorted(ends))
            size, tid = len(texts[r]), tids[r]
            lstrip, rstrip = attrs[tid] & LSTRIP, attrs[tid] & RSTRIP
            whole = b"\x01" * size
            rejected = array("q")
            i, k = 0, len(ends)
            while i < k:
                e = ends[i]
                i += 1
                if cut[e - 1]:
                    continue  # no token ends here any more
                s = e - size
                if cut.find(1, s, e) >= 0:
                    rejected.append(e)
                    continue
                cut[s:e] = whole
                starts[s] = 1
                ids_at[s] = tid
                if lstrip:
                    j = s
                    while j and not cut[j - 1] and text[j - 1] in _ASCII_WS:
                        j -= 1
                    cut[j:s] = b"\x01" * (s - j)
                if rstrip:
                    j = e
                    while j < n and not cut[j] and text[j] in _ASCII_WS:
                        j += 1
                    cut[e:j] = b"\x01" * (j - e)
                j = bisect.bisect_left(ends, e + size, i)
                rejected += ends[i:j]  # the occurrences overlapping this one
                i = j
            # the rejected go on to their longest suffix that begins after the last cut, once the
            # pass has made its cuts (a longer one would overlap that cut: it could only be rejected)
            for e in rejected:
                if not cut[e - 1]:
                    q = shorter(r, e - 1 - cut.rfind(1, e - size, e))
                    if q >= 0:
                        more = buckets.get(q)
                        if more is None:
                            more = buckets[q] = array("q")
                            heapq.heappush(ranks, q)
                        elif more[-1] > e:
                            unsorted.add(q)
                        more.append(e)
        frags: list[str | int] = []
        prev, s = 0, starts.find(1)
        while s >= 0:
            self._raw(text, cut, prev, s, frags)
            tid = ids_at[s]
            frags.append(tid)
            prev = s + len(self.tokens[tid])
            s = starts.find(1, prev)
        self._raw(text, cut, prev, n, frags)
        return frags

    @staticmethod
    def _raw(text: str, cut: bytearray, a: int, b: int, frags: list) -> None:
        """The raw text between two cut tokens, less the whitespace they stripped (which lies
        against them), if any is left."""
        first = cut.find(0, a, b)
        if first >= 0:
            frags.append(text[first:cut.rfind(0, a, b) + 1])

    def token_attr(self, tid: int) -> int:
        return self._attrs[tid]

    def is_control(self, tid: int) -> bool:
        return bool(self._attrs[tid] & CONTROL)

    def is_eog(self, tid: int) -> bool:
        return tid in self.eog_ids

    def token_to_bytes(self, tid: int, special: bool = True) -> bytes:
        """llama_token_to_piece(tid, lstrip=0, special): the token's bytes."""
        if not 0 <= tid < len(self.tokens):
            raise ValueError(f"token id {tid} is outside the vocabulary (0..{len(self.tokens) - 1})")
        attr = self._attrs[tid]
        if not special and attr & (UNKNOWN | CONTROL):
            return b""
        piece = self._pieces.get(tid)
        if piece is None:
            text = self.tokens[tid]
            if attr & (UNKNOWN | CONTROL | USER_DEFINED):
                piece = text.encode("utf-8")
            elif attr & NORMAL:
                piece = (text.replace(SPACE, " ").encode("utf-8") if self.model == "llama"
                         else byte_decode(text))
            elif attr & BYTE:
                try:
                    piece = bytes([int(text[3:5], 16)])
                except ValueError:
                    piece = b""
            else:
                piece = b""  # unused/undefined tokens render as nothing
            self._pieces[tid] = piece
        return piece

    def token_to_piece(self, tid: int, special: bool = True) -> str:
        return self.token_to_bytes(tid, special).decode("utf-8", "replace")

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        """llama_detokenize(ids, remove_special=skip_special, unparse_special=not skip_special)
        without clean_spaces: the leading space of the first piece goes when add_space_prefix."""
        ids = [int(i) for i in ids]
        remove_space = self.add_space_prefix
        if skip_special and self.add_bos and ids and ids[0] == self.bos_id:
            remove_space, ids = False, ids[1:]
        if skip_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        parts = [self.token_to_bytes(i, not skip_special) for i in ids]
        if remove_space and parts and parts[0][:1] == b" ":
            parts[0] = parts[0][1:]
        return b"".join(parts)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self.decode_bytes(ids, skip_special).decode("utf-8", "replace")

    def stream(self, skip_special: bool = False, remove_space: bool = False,
               keep: Iterable[int] = ()) -> "StreamDecoder":
        return StreamDecoder(self, skip_special, remove_space, keep)


class StreamDecoder:
    """Text increments as ids arrive; an incomplete UTF-8 sequence waits for its next bytes.

    ``remove_space`` drops the first piece's leading space like ``decode`` does for vocabularies
    with add_space_prefix; leave it False when continuing after a prompt (llama.cpp's generation
    loop prints pieces with lstrip=0). ``keep``: special tokens whose text shows even with
    ``skip_special`` (a tool-call marker such as Mistral's ``[TOOL_CALLS]``)."""

    def __init__(self, tok: Tokenizer, skip_special: bool = False, remove_space: bool = False,
                 keep: Iterable[int] = ()):
        self._tok = tok
        self._special = not skip_special
        self._keep = frozenset(keep)
        self._strip = remove_space and tok.add_space_prefix
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, tid: int) -> str:
        b = self._tok.token_to_bytes(int(tid), self._special or int(tid) in self._keep)
        if self._strip:
            self._strip = False
            b = b[1:] if b[:1] == b" " else b
        return self._utf8.decode(b)

    def flush(self) -> str:
        """What is held back at the end (an incomplete sequence becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)
