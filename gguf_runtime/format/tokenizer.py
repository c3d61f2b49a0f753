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

import codecs
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
            ids = [i for i in self._special_ids
                   if parse_special or not self._attrs[i] & (CONTROL | UNKNOWN)]
            by_text = {}
            for rank, i in enumerate(ids):
                by_text.setdefault(self.tokens[i], (rank, i))
            rx = re.compile(_trie_pattern({t[:8] for t in by_text})) if by_text else None
            lens = sorted({len(t) for t in by_text}, reverse=True)
            got = self._special[parse_special] = (by_text, rx, lens)
        return got

    def partition(self, text: str, parse_special: bool = False) -> list[str | int]:
        """tokenizer_st_partition: the text as raw-text pieces (str) and special-token ids (int)."""
        by_text, rx, lens = self._special_set(parse_special)
        if rx is None:
            return [text]
        found: set[str] = set()
        m = rx.search(text)
        while m is not None:  # every token text that occurs anywhere in the text
            p = m.start()
            for n in lens:
                if text[p:p + n] in by_text:
                    found.add(text[p:p + n])
            m = rx.search(text, p + 1)
        frags: list[str | int] = [text]
        for tok in sorted(found, key=lambda t: by_text[t][0]):
            tid = by_text[tok][1]
            lstrip, rstrip = self._attrs[tid] & LSTRIP, self._attrs[tid] & RSTRIP
            out: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or tok not in f:
                    out.append(f)
                    continue
                pos, end = 0, len(f)
                while (hit := f.find(tok, pos)) >= 0:
                    left = f[pos:hit].rstrip(_ASCII_WS) if lstrip else f[pos:hit]
                    if left:
                        out.append(left)
                    out.append(tid)
                    pos = hit + len(tok)
                    while rstrip and pos < end and f[pos] in _ASCII_WS:
                        pos += 1
                if pos < end:
                    out.append(f[pos:])
            frags = out
        return frags

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
