"""Speculative decoding's proposals and acceptance (engine/speculative.py), on the CPU."""

from __future__ import annotations

import numpy as np
import pytest

from gguf_runtime.engine.speculative import AdaptiveK, accept_greedy, accept_sampled, ngram_propose


def test_ngram_takes_the_longest_latest_match():
    h = [7, 1, 2, 9, 5, 1, 2, 3, 4, 8, 2, 3]
    assert ngram_propose(h, 2) == [4, 8]  # [2, 3] last occurred at 6: 4, 8 followed
    assert ngram_propose(h + [4], 3) == [8, 2, 3]  # the 3-gram [2, 3, 4]
    assert ngram_propose([1, 2, 3], 4) == []  # nothing repeats
    assert ngram_propose([5, 6, 5], 4) == [6, 5]  # (the 1-gram 5 at 0)
    assert ngram_propose(h, 0) == []


def test_ngram_proposes_a_function_asked_back():
    """The case prompt lookup is for: a text the model repeats (code edited in place)."""
    code = list(range(100, 160))
    history = [1, 2] + code + [3, 4] + code[:10]
    assert ngram_propose(history, 8) == code[10:18]


def test_accept_greedy():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == (2, 9)
    assert accept_greedy([5, 6, 7], [5, 6, 7, 1]) == (3, 1)
    assert accept_greedy([5], [4, 0]) == (0, 4)
    assert accept_greedy([], [3]) == (0, 3)


P = np.array([[0.1, 0.5, 0.3, 0.1], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]])


@pytest.mark.parametrize("proposer", ["point", "draft"])
def test_sampled_tokens_follow_the_target(proposer, rng):
    """The first token of a step is distributed as the target's p, whatever the proposal (a fixed
    n-gram token, or drafts drawn from another distribution q)."""
    q = np.array([[0.4, 0.1, 0.1, 0.4], [0.1, 0.2, 0.3, 0.4], [0.25] * 4])
    n = 40000
    counts = np.zeros(4)
    for _ in range(n):
        if proposer == "point":
            props, q_rows = [3, 0], None
        else:
            props = [int(rng.choice(4, p=q[0])), int(rng.choice(4, p=q[1]))]
            q_rows = q
        accepted, tok = accept_sampled(props, P, rng, q_rows)
        counts[props[0] if accepted else tok] += 1
    freq = counts / n
    assert np.abs(freq - P[0]).max() < 0.01, freq  # (4 sigma of 40,000 draws: ~0.01)


def test_sampled_all_accepted_then_one_more_from_p(rng):
    """Proposals the target is certain of are all kept, and the token after them comes from the last row."""
    p = np.array([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert accept_sampled([1, 2], p, rng) == (2, 0)
    assert accept_sampled([0, 2], p, rng) == (0, 1)  # p(0) = 0: rejected, the rest is token 1


def test_adaptive_k():
    a = AdaptiveK(k=4, k_max=8)
    a.update(4, 4)
    assert a.k == 8
    for _ in range(10):
        a.update(a.k, 0)
    assert a.k == 1 and a.acceptance < 0.1
