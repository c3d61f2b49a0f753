"""Host bookkeeping of a paged KV pool: which pages each sequence owns, and the prefix cache.

A page holds ``page_size`` consecutive positions of one sequence. Once a page is full its content
is fixed by the tokens it holds and every token before them, so a full page is named by a chain
key: blake2b-128 of the previous page's key and the page's tokens (vLLM's automatic prefix
caching, llama-server's prompt cache). A sequence admitted with a prompt whose leading pages are
cached takes those pages as they are (reference-counted, shared with whoever else holds them) and
evaluates only the rest; its own writes start past them, so a shared page is never written again.

Pages are in one of three states:

* owned: held by one or more sequences (``ref`` > 0);
* cached: held by none, but their key is known: kept for a later prompt, evicted least recently
  released first when the free list runs dry (a sequence's last page goes before its first, so
  the shorter prefix stays usable longest);
* free: no content worth keeping.

``available()`` counts free and cached pages: what a new sequence can get. Everything here runs on
the thread that owns the backend; the device never sees this, only the block table built from it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence

import numpy as np

from ..errors import KVCacheFullError

ROOT = b""  # the key before a sequence's first page


def page_key(prev: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(prev + np.asarray(tokens, "<i4").tobytes(), digest_size=16).digest()


class PagePool:
    def __init__(self, n_pages: int, page_size: int, n_seqs: int) -> None:
        self.n_pages, self.page_size = n_pages, page_size
        self._free = list(range(n_pages - 1, -1, -1))  # pop() hands out the lowest page first
        self._ref = [0] * n_pages
        self._key_of: dict[int, bytes] = {}  # page -> key, for cached and published owned pages
        self._page_of: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, oldest first
        self._owned: list[list[int]] = [[] for _ in range(n_seqs)]
        self._keys: list[list[bytes]] = [[] for _ in range(n_seqs)]  # keys of each sequence's leading full pages
        self.hits = 0  # tokens admitted sequences took from the cache (statistics)

    # ---- queries -----------------------------------------------------------------------------
    def owned(self, seq: int) -> list[int]:
        return self._owned[seq]

    def available(self) -> int:
        """Pages a new sequence can get: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._lru)

    def cached(self) -> int:
        """Pages kept only for the prefix cache."""
        return len(self._lru)

    def match(self, tokens: Sequence[int], limit: int) -> list[int]:
        """The cached pages of the longest prefix of ``tokens`` made of whole pages, covering at
        most ``limit`` tokens (a prompt's last token is evaluated again, for its logits)."""
        ps, key, pages = self.page_size, ROOT, []
        for i in range(min(limit, len(tokens)) // ps):
            key = page_key(key, tokens[i * ps:(i + 1) * ps])
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    # ---- changes -----------------------------------------------------------------------------
    def reserve(self, seq: int, n_pages: int, prefix: Sequence[int] = ()) -> bool:
        """Give ``seq`` pages until it owns ``n_pages``; a sequence that owns none may first take
        ``prefix`` (match's pages: shared, not written). False if it already owned enough;
        KVCacheFullError (nothing changed) if the pool cannot give the rest."""
        owned = self._owned[seq]
        prefix = list(prefix) if not owned else []
        taking_cached = sum(1 for p in prefix if self._ref[p] == 0)
        short = max(0, n_pages - len(owned) - len(prefix)) - (self.available() - taking_cached)
        if short > 0:
            raise KVCacheFullError(
                f"the KV cache has {self.available()} free pages of {self.page_size} tokens, "
                f"{short + self.available()} are needed; wait for a sequence to finish or raise the KV budget")
        if n_pages <= len(owned):
            return False
        for p in prefix:
            self._take(p)
            owned.append(p)
        self._keys[seq] = [self._key_of[p] for p in prefix]
        self.hits += len(prefix) * self.page_size
        while len(owned) < n_pages:
            owned.append(self._fresh())
        return True

    def publish(self, seq: int, tokens: Sequence[int]) -> None:
        """``tokens``: the sequence's tokens from position 0 whose K/V are written (or enqueued to
        be, before anything that could read them). Its full pages among them become findable by
        match, unless another page already holds the same content."""
        ps, owned, keys = self.page_size, self._owned[seq], self._keys[seq]
        for i in range(len(keys), min(len(tokens) // ps, len(owned))):
            key = page_key(keys[-1] if keys else ROOT, tokens[i * ps:(i + 1) * ps])
            keys.append(key)
            page = owned[i]
            if page not in self._key_of and key not in self._page_of:
                self._key_of[page], self._page_of[key] = key, page

    def release(self, seq: int, tokens: Sequence[int] = ()) -> None:
        """Drop the sequence's pages (after publishing ``tokens``, as publish): cached where they
        have a key and nobody else holds them, free otherwise."""
        if tokens:
            self.publish(seq, tokens)
        for p in reversed(self._owned[seq]):  # the last page is the first evicted
            self._ref[p] -= 1
            if self._ref[p]:
                continue
            if p in self._key_of:
                self._lru[p] = None
            else:
                self._free.append(p)
        self._owned[seq], self._keys[seq] = [], []

    def clear(self) -> None:
        """Forget every cached page (owned pages keep their keys)."""
        while self._lru:
            self._forget(self._lru.popitem(last=False)[0])

    # ---- internals ---------------------------------------------------------------------------
    def _take(self, page: int) -> None:
        if self._ref[page] == 0:
            del self._lru[page]
        self._ref[page] += 1

    def _fresh(self) -> int:
        if self._free:
            page = self._free.pop()
        else:  # evict the least recently released cached page
            page = self._lru.popitem(last=False)[0]
            del self._page_of[self._key_of.pop(page)]
        self._ref[page] = 1
        return page

    def _forget(self, page: int) -> None:
        del self._page_of[self._key_of.pop(page)]
        self._free.append(page)
