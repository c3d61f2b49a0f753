"""The KV page pool's bookkeeping and prefix cache (backends/page_pool.py), on the host."""

from __future__ import annotations

import random

import pytest

from gguf_runtime.backends.page_pool import PagePool
from gguf_runtime.errors import KVCacheFullError

PS = 4


def check(pool: PagePool) -> None:
    """Every page is owned, cached or free, exactly once; references count the owners; keys and
    pages map one to one."""
    owners = [0] * pool.n_pages
    for seq in range(len(pool._owned)):
        for p in pool.owned(seq):
            owners[p] += 1
    assert owners == pool._ref
    free, lru = set(pool._free), set(pool._lru)
    assert len(free) == len(pool._free) and not free & lru
    for p in range(pool.n_pages):
        assert (owners[p] > 0) + (p in free) + (p in lru) == 1, p
        assert p not in lru or p in pool._key_of
        assert p not in free or p not in pool._key_of
    assert {v: k for k, v in pool._key_of.items()} == pool._page_of


def test_a_released_prompt_is_found_again_and_shared():
    pool = PagePool(8, PS, 3)
    prompt = list(range(1, 11))  # two full pages and two tokens
    assert pool.match(prompt, 9) == []
    pool.reserve(0, 3)
    pool.publish(0, prompt)
    first = pool.owned(0)[:2]
    assert pool.match(prompt, 9) == first  # running sequences share too
    assert pool.match(prompt, 7) == first[:1]  # at most `limit` tokens
    assert pool.match([1, 2, 3, 4, 9, 9, 9, 9], 8) == first[:1]  # the second page's tokens differ
    assert pool.match([9] + prompt[1:], 9) == []  # a page's key covers everything before it
    pool.reserve(1, 4, prefix=first)
    assert pool.owned(1)[:2] == first and pool._ref[first[0]] == 2
    pool.release(0)
    pool.release(1)
    check(pool)
    assert pool.cached() == 2 and pool.available() == 8 and pool.match(prompt, 9) == first


def test_full_pool_refuses_without_changing_anything():
    pool = PagePool(4, PS, 2)
    pool.reserve(0, 2)
    pool.publish(0, list(range(8)))
    pool.release(0)  # two cached pages
    pool.reserve(1, 1)
    before = (list(pool._free), dict(pool._lru), list(pool._ref), dict(pool._key_of))
    with pytest.raises(KVCacheFullError, match="3 free pages"):
        pool.reserve(0, 5)
    assert (list(pool._free), dict(pool._lru), list(pool._ref), dict(pool._key_of)) == before
    pool.reserve(0, 2, prefix=pool.match(list(range(8)) + [0], 8))  # the cached pages count as available
    pool.reserve(0, 3)
    check(pool)


def test_eviction_takes_the_oldest_and_a_sequences_last_page_first():
    pool = PagePool(6, PS, 2)
    a, b = list(range(12)), list(range(100, 112))
    for seq, toks in ((0, a), (1, b)):
        pool.reserve(seq, 3)
        pool.release(seq, toks)
    assert pool.cached() == 6
    pool.reserve(0, 2)  # evicts a's pages 3 and 2: a keeps its first page, b all three
    assert len(pool.match(a, 12)) == 1 and len(pool.match(b, 12)) == 3
    check(pool)


def test_the_same_content_twice_keeps_one_page():
    pool = PagePool(6, PS, 2)
    toks = list(range(9))
    for seq in (0, 1):  # two sequences prefill the same prompt before either is published
        pool.reserve(seq, 3)
    pool.publish(0, toks)
    pool.publish(1, toks)
    pool.release(0)
    pool.release(1)
    check(pool)
    assert pool.cached() == 2 and pool.available() == 6


def test_random_operations_keep_the_books():
    rng = random.Random(3)
    pool = PagePool(40, PS, 6)
    vocab = [rng.choices(range(3), k=30) for _ in range(4)]  # few distinct histories: many hits
    for _ in range(3000):
        seq = rng.randrange(6)
        if pool.owned(seq) and rng.random() < 0.5:
            toks = rng.choice(vocab)[:rng.randrange(0, len(pool.owned(seq)) * PS + 1)]
            pool.release(seq, toks)
        elif not pool.owned(seq):
            toks = rng.choice(vocab)[:rng.randrange(2, 30)]
            prefix = pool.match(toks, len(toks) - 1)
            try:
                pool.reserve(seq, -(-len(toks) // PS) + rng.randrange(3), prefix)
            except KVCacheFullError:
                continue
            pool.publish(seq, toks)
        check(pool)
    assert pool.hits > 0
    pool.clear()
    check(pool)
