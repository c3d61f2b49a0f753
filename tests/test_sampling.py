"""The numpy sampler: each stage on hand-made examples, the chain, determinism, the distribution."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gguf_runtime.sampling import (Sampler, SamplingParams, apply_repeat_penalty, apply_temperature, draw,
                                   min_p_filter, softmax, top_k_filter, top_k_indices, top_p_filter)

NEG = -np.inf
PROBS5 = np.array([0.05, 0.5, 0.1, 0.2, 0.15])  # ids sorted by prob: 1, 3, 4, 2, 0
LOGITS5 = (np.log(PROBS5) + 3.0).astype(np.float32)  # shifted: filters must not care


def kept(x: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.isfinite(x)).tolist())


def chain(logits, history, p: SamplingParams):
    """The stage functions composed by hand (the specification the Sampler must match)."""
    x = np.where(np.isnan(logits), NEG, logits).astype(np.float32)
    x = apply_repeat_penalty(x, history, p.repeat_penalty, p.repeat_last_n)
    x = top_k_filter(x, p.top_k)
    x = top_p_filter(x, p.top_p)
    x = min_p_filter(x, p.min_p)
    return x


# ---- repetition penalty -------------------------------------------------------------------------

def test_repeat_penalty_positive_and_negative():
    logits = np.array([2.0, -1.0, 0.0, 3.0, 1.5, -4.0], dtype=np.float32)
    # token 1 appears twice (penalized once), 9 and -1 are out of range (ignored)
    out = apply_repeat_penalty(logits, [0, 1, 1, 2, 9, -1, 5], penalty=2.0, last_n=64)
    np.testing.assert_array_equal(out, [1.0, -2.0, 0.0, 3.0, 1.5, -8.0])
    assert out.dtype == np.float32
    np.testing.assert_array_equal(logits, [2.0, -1.0, 0.0, 3.0, 1.5, -4.0])  # input untouched
    # a penalty < 1 favours the repeated tokens, by the same rule
    np.testing.assert_allclose(apply_repeat_penalty(logits, [0, 1], 0.5, 64)[:2], [4.0, -0.5])


def test_repeat_penalty_window():
    logits = np.array([2.0, 2.0, 2.0, 2.0], dtype=np.float32)
    hist = [0, 1, 2]
    np.testing.assert_array_equal(apply_repeat_penalty(logits, hist, 2.0, last_n=1), [2, 2, 1, 2])
    np.testing.assert_array_equal(apply_repeat_penalty(logits, hist, 2.0, last_n=2), [2, 1, 1, 2])
    np.testing.assert_array_equal(apply_repeat_penalty(logits, hist, 2.0, last_n=-1), [1, 1, 1, 2])
    np.testing.assert_array_equal(apply_repeat_penalty(logits, hist, 2.0, last_n=0), logits)
    np.testing.assert_array_equal(apply_repeat_penalty(logits, hist, 1.0, last_n=64), logits)
    np.testing.assert_array_equal(apply_repeat_penalty(logits, [], 2.0, last_n=64), logits)


# ---- top-k --------------------------------------------------------------------------------------

def test_top_k():
    x = np.array([1.0, 5.0, 3.0, 5.0, 2.0], dtype=np.float32)
    assert kept(top_k_filter(x, 1)) == {1}  # tie at the top: lower id
    assert kept(top_k_filter(x, 2)) == {1, 3}
    assert kept(top_k_filter(x, 3)) == {1, 2, 3}
    assert kept(top_k_filter(x, 0)) == kept(top_k_filter(x, 99)) == set(range(5))
    np.testing.assert_array_equal(top_k_filter(x, 3), [NEG, 5.0, 3.0, 5.0, NEG])
    assert top_k_indices(x, 3).tolist() == [1, 3, 2]
    assert top_k_indices(x, 0).tolist() == [1, 3, 2, 4, 0]
    ties = np.array([4.0, 1.0, 4.0, 4.0, 0.5], dtype=np.float32)
    assert top_k_indices(ties, 2).tolist() == [0, 2]  # boundary ties: lowest ids
    assert top_k_indices(ties, 4).tolist() == [0, 2, 3, 1]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-3, 3), min_size=1, max_size=60), st.integers(1, 70))
def test_top_k_indices_matches_stable_sort(values, k):
    x = np.array(values, dtype=np.float32)  # few distinct values: many ties
    expect = np.argsort(-x, kind="stable")[:k]
    assert top_k_indices(x, k).tolist() == expect.tolist()


# ---- top-p --------------------------------------------------------------------------------------

@pytest.mark.parametrize("p, expect", [
    (0.3, {1}),  # 0.5 >= 0.3
    (0.5, {1}),
    (0.6, {1, 3}),  # 0.5 + 0.2
    (0.84, {1, 3, 4}),  # 0.85: the token that crosses p is kept
    (0.86, {1, 3, 4, 2}),
    (0.99, {0, 1, 2, 3, 4}),
    (1.0, {0, 1, 2, 3, 4}),
])
def test_top_p_known(p, expect):
    assert kept(top_p_filter(LOGITS5, p)) == expect


def test_top_p_ignores_removed_tokens():
    # after top-k removed ids 0 and 2, the probabilities renormalize over 1, 3, 4: 0.5/0.85 = 0.588...
    x = top_k_filter(LOGITS5, 3)
    assert kept(top_p_filter(x, 0.58)) == {1}
    assert kept(top_p_filter(x, 0.60)) == {1, 3}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-20, 20, allow_nan=False, width=32), min_size=1, max_size=50),
       st.floats(0.01, 0.999))
def test_top_p_is_smallest_set(values, p):
    x = np.array(values, dtype=np.float32)
    probs = softmax(x)
    keep = sorted(kept(top_p_filter(x, p)))
    mass = probs[keep].sum()
    assert mass >= p - 1e-12 or len(keep) == len(x)
    # dropping the least likely kept token falls below p: the set is the smallest one
    assert mass - probs[keep].min() < p + 1e-12
    dropped = sorted(set(range(len(x))) - set(keep))
    if dropped:
        assert probs[dropped].max() <= probs[keep].min()


@pytest.mark.parametrize("top_k", [0, 40])
@pytest.mark.parametrize("n, p, expect", [(4, 0.5, 2), (4, 0.75, 3), (4, 0.25, 1), (8, 0.5, 4), (8, 0.125, 1)])
def test_top_p_boundary_is_inclusive(top_k, n, p, expect):
    """Equal logits give probabilities 1/n exactly (n a power of two), so a prefix sums to p exactly:
    the nucleus is that prefix (the first whose sum reaches p, >=), not one token more; in the stage
    function and on both paths of the Sampler (after top-k, and the full-vocabulary search)."""
    x = np.zeros(n, np.float32)
    assert kept(top_p_filter(x, p)) == set(range(expect))
    s = Sampler(SamplingParams(temperature=1.0, top_k=top_k, top_p=p, min_p=0.0, seed=0))
    assert s.candidates(x)[0].tolist() == list(range(expect))
    assert sorted({s.sample(x) for _ in range(64)}) == list(range(expect))


def test_top_p_boundary_after_top_k():
    """top-k 4 of 8 equal logits renormalizes to 1/4 each: top-p 0.5 then keeps exactly two."""
    s = Sampler(SamplingParams(temperature=1.0, top_k=4, top_p=0.5, min_p=0.0, seed=0))
    assert s.candidates(np.zeros(8, np.float32))[0].tolist() == [0, 1]


# ---- min-p --------------------------------------------------------------------------------------

@pytest.mark.parametrize("p, expect", [
    (0.0, {0, 1, 2, 3, 4}),
    (0.05, {0, 1, 2, 3, 4}),  # 0.05 >= 0.025
    (0.15, {1, 2, 3, 4}),  # threshold 0.075
    (0.25, {1, 3, 4}),  # threshold 0.125
    (0.35, {1, 3}),  # threshold 0.175
    (1.0, {1}),
])
def test_min_p_known(p, expect):
    assert kept(min_p_filter(LOGITS5, p)) == expect


def test_min_p_is_relative_to_the_top_token():
    # a flat distribution: the top token has 1% ... an absolute 0.5 cut would drop everything
    x = np.zeros(100, dtype=np.float32)
    x[:10] = math.log(2.0)  # ten tokens twice as likely as the rest
    assert kept(min_p_filter(x, 0.49)) == set(range(100))
    assert kept(min_p_filter(x, 0.51)) == set(range(10))


@pytest.mark.parametrize("top_k", [0, 40])
def test_min_p_boundary_is_inclusive(top_k):
    """min-p keeps logit >= max + ln(p): at p = 1 exactly the tokens tied with the top one, in the
    stage function and in the Sampler (where a strict > would leave no token at all)."""
    x = np.array([1.0, 3.0, 3.0, 2.0, 3.0], dtype=np.float32)
    assert kept(min_p_filter(x, 1.0)) == {1, 2, 4}
    s = Sampler(SamplingParams(temperature=1.0, top_k=top_k, top_p=1.0, min_p=1.0, seed=0))
    ids, probs = s.distribution(x)
    assert ids.tolist() == [1, 2, 4] and probs.tolist() == [1 / 3] * 3
    assert {s.sample(x) for _ in range(64)} == {1, 2, 4}


# ---- softmax, temperature, draw -----------------------------------------------------------------

def test_softmax_is_safe():
    p = softmax(np.array([1000.0, 999.0, NEG], dtype=np.float32))
    np.testing.assert_allclose(p, [1 / (1 + math.e**-1), math.e**-1 / (1 + math.e**-1), 0.0])
    assert p.dtype == np.float64
    with pytest.raises(ValueError):
        softmax(np.array([NEG, NEG]))
    np.testing.assert_array_equal(softmax(np.array([np.inf, 0.0, np.inf])), [0.5, 0.0, 0.5])


def test_temperature_and_draw():
    np.testing.assert_allclose(apply_temperature(np.array([1.0, -2.0], dtype=np.float32), 0.5), [2.0, -4.0])
    with pytest.raises(ValueError):
        apply_temperature(np.array([1.0]), 0.0)
    probs = np.array([0.0, 0.25, 0.0, 0.75, 0.0])
    assert draw(probs, 0.0) == 1  # zero-probability entries are never drawn
    assert draw(probs, 0.2499) == 1
    assert draw(probs, 0.25) == 3
    assert draw(probs, 0.999999) == 3


# ---- the Sampler --------------------------------------------------------------------------------

def test_greedy_is_argmax():
    rng = np.random.default_rng(1)
    s = Sampler(SamplingParams(temperature=0.0))
    for _ in range(20):
        x = rng.standard_normal(1000).astype(np.float32)
        assert s.sample(x, []) == int(np.argmax(x))
    x = np.array([1.0, 3.0, 3.0, 2.0], dtype=np.float32)
    assert s.sample(x, []) == 1  # ties: lowest id
    # after the repetition penalty: 3.0/2 = 1.5 < 2.0
    s = Sampler(SamplingParams(temperature=0.0, repeat_penalty=2.0))
    assert s.sample(x, [1, 2]) == 3
    ids, probs = s.distribution(x, [1, 2])
    assert ids.tolist() == [3] and probs.tolist() == [1.0]


def _draws(sampler: Sampler, n: int = 200, vocab: int = 500) -> list[int]:
    rng = np.random.default_rng(123)  # the logits are the same for every sampler
    hist: list[int] = []
    for _ in range(n):
        hist.append(sampler.sample((rng.standard_normal(vocab) * 2).astype(np.float32), hist))
    return hist


def test_seed_determinism():
    p = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.1)
    a = _draws(Sampler(SamplingParams(seed=42, **p)))
    b = _draws(Sampler(SamplingParams(seed=42, **p)))
    c = _draws(Sampler(SamplingParams(seed=43, **p)))
    assert a == b
    assert a != c
    assert len(set(a)) > 50  # really sampling, not stuck


def test_random_seed_is_recorded():
    s1 = Sampler(SamplingParams())
    s2 = Sampler(SamplingParams())
    assert isinstance(s1.seed, int) and s1.seed >= 0
    assert s1.seed != s2.seed or s1.seed == s2.seed == 0  # 2^-32 chance of a clash
    replay = Sampler(SamplingParams(seed=s1.seed))
    assert _draws(s1, 50) == _draws(replay, 50)
    assert SamplingParams().seed is None  # the params are not modified


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_empirical_distribution_matches_softmax(temperature):
    logits = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2], dtype=np.float32)
    s = Sampler(SamplingParams(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, seed=7))
    n = 40000
    counts = np.bincount([s.sample(logits, []) for _ in range(n)], minlength=len(logits))
    expected = softmax(logits.astype(np.float64) / temperature) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.3  # chi-square, 7 degrees of freedom, p = 0.001


def test_empirical_distribution_after_filters():
    # top-k 3 keeps ids 1, 3, 4; temperature 0.5 squares their relative probabilities
    s = Sampler(SamplingParams(temperature=0.5, top_k=3, top_p=1.0, min_p=0.0, seed=3))
    n = 30000
    counts = np.bincount([s.sample(LOGITS5, []) for _ in range(n)], minlength=5)
    assert counts[0] == counts[2] == 0
    q = PROBS5[[1, 3, 4]] ** 2
    expected = q / q.sum() * n
    chi2 = float(((counts[[1, 3, 4]] - expected) ** 2 / expected).sum())
    assert chi2 < 13.8  # 2 degrees of freedom, p = 0.001


def test_default_chain_on_known_example():
    # repeat penalty 2 on token 1 (0.5 -> smaller); then top-k 40, top-p 0.95, min-p 0.05 as llama.cpp
    s = Sampler(SamplingParams(repeat_penalty=2.0, seed=0))
    ids, v = s.candidates(LOGITS5, [1])
    pen = apply_repeat_penalty(LOGITS5, [1], 2.0, 64)
    assert ids.tolist() == np.argsort(-pen, kind="stable")[: len(ids)].tolist()
    np.testing.assert_array_equal(v, pen[ids])
    assert set(ids.tolist()) == kept(chain(LOGITS5, [1], s.params))


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from([0, 1, 5, 40, 3000]), st.sampled_from([1.0, 0.95, 0.5, 0.1]),
       st.sampled_from([0.0, 0.05, 0.3]), st.sampled_from([1.0, 1.3]), st.sampled_from([16, 2000, 20000]),
       st.sampled_from([0.3, 3.0, 8.0]), st.booleans())
def test_sampler_matches_stage_functions(seed, top_k, top_p, min_p, penalty, vocab, scale, quantize):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(vocab) * scale).astype(np.float32)
    if quantize:  # many exact ties
        x = np.round(x).astype(np.float32)
    x[rng.integers(0, vocab, 3)] = NEG
    hist = rng.integers(0, vocab, 100).tolist()
    p = SamplingParams(temperature=0.9, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=penalty)
    s = Sampler(p)
    ids, v = s.candidates(x, hist)
    ref = chain(x, hist, p)
    ref_ids = np.argsort(-ref, kind="stable")[: len(kept(ref))]
    assert ids.tolist() == ref_ids.tolist()  # same set, same (descending, lower-id-first) order
    np.testing.assert_array_equal(v, ref[ids])
    ids2, probs = s.distribution(x, hist)
    assert ids2.tolist() == ids.tolist()
    np.testing.assert_allclose(probs, softmax(v.astype(np.float64) / 0.9), rtol=1e-12)
    assert int(s.sample(x, hist)) in set(ids.tolist())


def test_nan_logits_are_never_drawn():
    x = np.array([np.nan, 1.0, np.nan, 0.5], dtype=np.float32)
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0))
    assert {s.sample(x, []) for _ in range(200)} == {1, 3}
    assert Sampler(SamplingParams(temperature=0.0)).sample(x, []) == 1
    with pytest.raises(ValueError):
        s.sample(np.full(4, NEG, dtype=np.float32), [])


def test_large_vocabulary_matches_stage_functions():
    """A 262,144-token vocabulary (Gemma-3's) through the fast paths (partition, nucleus search)
    gives the stage functions' candidates; how fast is bench/sampler_timing.py's question."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(262144) * 2).astype(np.float32)
    x[:5] += 12.0  # a realistic peaked distribution
    hist = rng.integers(0, 262144, 64).tolist()
    for params in (SamplingParams(repeat_penalty=1.1, seed=0), SamplingParams(top_k=0, seed=0)):
        ids, v = Sampler(params).candidates(x, hist)
        ref = chain(x, hist, params)
        assert ids.tolist() == np.argsort(-ref, kind="stable")[: len(kept(ref))].tolist()


# ---- validation ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, fragment", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(min_p=-0.01), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(repeat_penalty=0.0), "repeat_penalty"),
    (dict(repeat_penalty=-1.0), "repeat_penalty"),
    (dict(repeat_last_n=-2), "repeat_last_n"),
    (dict(seed=-1), "seed"),
])
def test_validate_errors(kwargs, fragment):
    p = SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=fragment) as ei:
        p.validate()
    assert "\n" not in str(ei.value)
    with pytest.raises(ValueError, match=fragment):
        Sampler(p)


def test_validate_accepts_edges():
    for p in (SamplingParams(), SamplingParams(temperature=0, top_k=0, top_p=1.0, min_p=0.0),
              SamplingParams(top_p=1e-6, min_p=1.0, repeat_penalty=0.5, repeat_last_n=-1, seed=0)):
        p.validate()
    d = SamplingParams()
    assert (d.temperature, d.top_k, d.top_p, d.min_p, d.repeat_penalty, d.repeat_last_n, d.seed) == \
        (0.8, 40, 0.95, 0.05, 1.0, 64, None)
