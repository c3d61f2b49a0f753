"""SentencePiece-style BPE (``tokenizer.ggml.model == "llama"``) as llama.cpp's
``llm_tokenizer_spm`` does it.

Spaces become U+2581 ("▁"); the text starts as one symbol per character and the adjacent pair
whose concatenation is a vocabulary token of highest score is merged first (the leftmost one on a
tie: llama.cpp's priority queue order), until no pair forms a token. A final symbol that is not a
token is emitted as byte tokens ``<0xXX>`` (byte fallback), or the unknown token without them.

Speed: llama.cpp runs the merge over a whole text fragment. Here the fragment is cut into
independent segments first, and each distinct segment is merged once (cached). A cut between two
characters ``a`` and ``b`` is safe when no vocabulary token contains ``ab``: no merge can then ever
span the cut, and merges on either side do not change each other's order (each side's queue
order, score then position, is kept). We cut only before "▁", after any character that never
precedes "▁" inside a token — for Llama and Gemma every word boundary.
"""

from __future__ import annotations

import functools
import heapq
import re

SPACE = "\u2581"
# segments cached: as many as this, of up to this many characters (longer ones are merged afresh, so
# a giant input cannot grow the cache by its own size)
CACHED_SEGMENTS = 1 << 15
CACHED_SEGMENT_CHARS = 64


class SPM:
    """``encode(text)`` for one raw-text fragment (the caller adds the space prefix)."""

    SHORT = 48  # segments up to this many characters use the quadratic loop, longer ones a heap

    def __init__(self, tokens: list[str], token_to_id: dict[str, int], scores: list[float],
                 unk_id: int | None):
        self.token_to_id = token_to_id
        self.scores = scores
        hexd = "0123456789ABCDEF"
        byte_ids: list[int | None] = []
        for b in range(256):  # llama_vocab::byte_to_token
            tid = token_to_id.get(f"<0x{hexd[b >> 4]}{hexd[b & 15]}>")
            if tid is None and b < 0x80:
                tid = token_to_id.get(chr(b))
            byte_ids.append(tid if tid is not None else unk_id)
        self.byte_ids = byte_ids
        before = {t[i - 1] for t in tokens if SPACE in t[1:] for i in range(1, len(t)) if t[i] == SPACE}
        if before:
            cls = "".join(re.escape(c) for c in sorted(before))
            self._cut = re.compile(f"(?<=[^{cls}])(?={SPACE})")
        else:
            self._cut = re.compile(f"(?<=.)(?={SPACE})", re.S)
        self._segment = functools.lru_cache(maxsize=CACHED_SEGMENTS)(self._encode_segment)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` (spaces not yet escaped)."""
        out: list[int] = []
        cached, fresh = self._segment, self._encode_segment
        for s in self._cut.split(text.replace(" ", SPACE)):
            if s:
                out.extend(cached(s) if len(s) <= CACHED_SEGMENT_CHARS else fresh(s))
        return out

    def _encode_segment(self, text: str) -> tuple[int, ...]:
        parts = self.merge(text) if len(text) <= self.SHORT else self.merge_heap(text)
        t2i, byte_ids = self.token_to_id, self.byte_ids
        out: list[int] = []
        for p in parts:
            tid = t2i.get(p)
            if tid is not None:
                out.append(tid)
            else:  # resegment(): a symbol that is no token is always a single character here
                ids = (byte_ids[b] for b in p.encode("utf-8", "surrogatepass"))
                out.extend(i for i in ids if i is not None)
        return tuple(out)

    def merge(self, text: str) -> list[str]:
        parts = list(text)
        t2i, scores = self.token_to_id, self.scores
        while len(parts) > 1:
            best, at = 0.0, -1
            for i in range(len(parts) - 1):
                tid = t2i.get(parts[i] + parts[i + 1])
                if tid is not None and (at < 0 or scores[tid] > best):
                    best, at = scores[tid], i
            if at < 0:
                break
            parts[at:at + 2] = [parts[at] + parts[at + 1]]
        return parts

    def merge_heap(self, text: str) -> list[str]:
        """llama.cpp's loop: a max-heap on (score, -left); stale pairs fail the size check."""
        sym = list(text)
        n = len(sym)
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        heap: list[tuple[float, int, int, int]] = []
        t2i, scores = self.token_to_id, self.scores

        def push(left: int, right: int) -> None:
            if left >= 0 and right >= 0:
                t = sym[left] + sym[right]
                tid = t2i.get(t)
                if tid is not None:
                    heapq.heappush(heap, (-scores[tid], left, right, len(t)))

        for i in range(1, n):
            push(i - 1, i)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            if not sym[left] or not sym[right] or len(sym[left]) + len(sym[right]) != size:
                continue
            sym[left], sym[right] = sym[left] + sym[right], ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            push(prev[left], left)
            push(left, nxt[left])
        return [s for s in sym if s]
