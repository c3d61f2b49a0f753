"""The GPU sampler (sampling.cu topk_sample) draw for draw against the numpy Sampler.

The kernel draws its uniform number from (seed, step) with splitmix64 (sampling.cu); ``gpu_uniform``
computes the same number on the host, so for every step the numpy Sampler's inverse-CDF draw
(sampling.draw) with that number is the token the kernel must commit. The only freedom left is
float32: where the number falls within 1e-5 of a boundary of the cumulative distribution (the
kernel sums __expf in float32, numpy exp in float64), either neighbour is right, and such draws are
counted, not compared. A sampler that ignores temperature, top-p or min-p, or cuts one token early
or late, fails on most draws.
"""

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from gguf_runtime.quant_kernels import launch_sampling as LS  # noqa: E402
from gguf_runtime.quant_kernels import launchers as L  # noqa: E402
from gguf_runtime.backends.cuda.tuning import Tuning  # noqa: E402
from gguf_runtime.sampling import Sampler, SamplingParams  # noqa: E402
from test_gpu_kernels import sampler_state  # noqa: E402

M64 = (1 << 64) - 1
AMBIGUOUS = 1e-5  # of the total mass: float32 scans of __expf against float64 (<= ~1e-6 apart)


def splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def gpu_uniform(seed: int, step: int) -> float:
    """The uniform number topk_sample draws with at (seed, step), as a float32 in [0, 1)."""
    r = splitmix64(seed ^ splitmix64((step * 0x100000001B3) & M64))
    return float(np.float32((r >> 11) * (1.0 / 9007199254740992.0)))


@pytest.fixture(scope="module")
def k():
    return L.Kernels(Tuning().knobs())  # the launch choices the backend makes


def gpu_draws(k, logits: np.ndarray, n: int, top_k: int, top_p: float, min_p: float, temp: float,
              seed: int) -> list[int]:
    """n draws (steps 0..n-1) of topk_sample on one row of fixed logits."""
    st, keep, ring, _mem = sampler_state(logits.shape[0], top_k=top_k, top_p=top_p, min_p=min_p, temp=temp,
                                         seed=seed)
    d = cp.asarray(logits)
    out = []
    for i in range(n):
        LS.topk_sample(k, d.data.ptr, logits.shape[0], logits.shape[0], st, 1)
        if i % 16 == 15:
            cp.cuda.runtime.deviceSynchronize()
            out += ring.tolist()
    assert not keep["counter"].get().any()
    assert int(keep["step"].get()[0]) == n
    return out


def compare(k, logits, n, top_k, top_p, min_p, temp, seed=12345):
    """Every unambiguous draw equals numpy's; returns (numpy's candidate ids, ambiguous draws)."""
    params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=0)
    ids, probs = Sampler(params).distribution(logits)
    cdf = np.cumsum(probs)
    got = gpu_draws(k, logits, n, top_k, top_p, min_p, temp, seed)
    ambiguous, wrong = 0, []
    for step, tok in enumerate(got):
        u = gpu_uniform(seed, step)
        want = int(ids[min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), len(ids) - 1)])
        if np.abs(cdf[:-1] - u * cdf[-1]).min(initial=1.0) < AMBIGUOUS * cdf[-1]:
            ambiguous += 1
        elif tok != want:
            wrong.append((step, tok, want))
    assert not wrong, f"{len(wrong)} of {n} draws differ from numpy's (step, gpu, numpy): {wrong[:8]}"
    return ids, ambiguous


def cuts_decided(logits, top_k, top_p, min_p):
    """Whether no top-p or min-p cut of these logits lies within float32 reach of a candidate (the
    kernel's float32 sums and numpy's float64 ones could then keep different sets, both right)."""
    x = np.sort(logits.astype(np.float64))[::-1][:top_k]
    p = np.exp(x - x[0])
    c = np.cumsum(p) / p.sum()
    return (top_p >= 1.0 or np.abs(c - top_p).min() > 2e-5) and \
        (min_p <= 0 or np.abs(x - (x[0] + np.log(min_p))).min() > 2e-5)


@pytest.mark.parametrize("top_k,top_p,min_p,temp", [(40, 0.95, 0.05, 0.8), (5, 1.0, 0.0, 1.5), (1000, 0.9, 0.0, 1.0),
                                                    (200, 0.8, 0.02, 0.5), (64, 1.0, 0.1, 2.0)])
def test_draw_for_draw_random_logits(k, top_k, top_p, min_p, temp, rng):
    """512 steps on 32,000 random logits: every draw is numpy's for the same uniform number."""
    logits = (rng.standard_normal(32000) * 3).astype(np.float32)
    while not cuts_decided(logits, top_k, top_p, min_p):  # a few percent of draws of logits
        logits = (rng.standard_normal(32000) * 3).astype(np.float32)
    ids, ambiguous = compare(k, logits, 512, top_k, top_p, min_p, temp)
    assert ambiguous <= 512 * 0.1  # ~2e-5 of the draws per candidate: 8 expected of 512 at top-k 1000
    assert len(ids) > 1  # a real choice, not a single candidate


@pytest.mark.parametrize("n_tied,top_p,expect", [(8, 0.5, 4), (8, 0.25, 2), (4, 0.75, 3)])
def test_top_p_boundary_is_inclusive(k, n_tied, top_p, expect):
    """Tied top logits (probability 1/n each, exact in float32 too): the nucleus of p is the first
    prefix whose mass reaches p exactly (>=), not one token more; ties in id order, across blocks."""
    logits = np.full(40000, -30.0, np.float32)
    tied = np.array([7, 900, 5000, 8191, 8192, 20000, 31000, 39999])[:n_tied]
    logits[tied] = 2.0
    ids, _ = compare(k, logits, 256, n_tied, top_p, 0.0, 1.0)
    assert ids.tolist() == tied[:expect].tolist()


def test_min_p_boundary_is_inclusive(k):
    """min-p 1.0 keeps exactly the tokens tied with the top one (logit >= max + ln 1)."""
    logits = np.full(40000, -1.0, np.float32)
    logits[[11, 12000, 30001]] = 2.5
    ids, _ = compare(k, logits, 256, 40, 1.0, 1.0, 0.7)
    assert ids.tolist() == [11, 12000, 30001]


def test_temperature_shapes_the_draws(k, rng):
    """The same logits and seed at two temperatures: each matches numpy, and they differ."""
    logits = (rng.standard_normal(32000) * 2).astype(np.float32)
    a = gpu_draws(k, logits, 256, 40, 1.0, 0.0, 0.3, 99)
    b = gpu_draws(k, logits, 256, 40, 1.0, 0.0, 1.5, 99)
    compare(k, logits, 256, 40, 1.0, 0.0, 0.3, 99)
    compare(k, logits, 256, 40, 1.0, 0.0, 1.5, 99)
    assert len(set(a)) < len(set(b)) and a != b


@pytest.mark.parametrize("n_vocab,allowed", [(50257, [50256]), (50257, [3, 4895, 50256]),
                                             (128256, [17, 64000, 128255]), (32000, [31999])])
def test_a_grammar_mask_leaves_only_the_allowed_tokens(k, n_vocab, allowed, rng):
    """A grammar mask leaves a few finite logits among tens of thousands at -inf; at top-k 1024 the
    -inf ties fill every block's candidates, and the allowed tokens (the end-of-text id, last in the
    vocabulary, among them) must keep their places: every draw is one of them, numpy's draw."""
    logits = np.full(n_vocab, -np.inf, np.float32)
    logits[allowed] = rng.standard_normal(len(allowed)).astype(np.float32)
    got = gpu_draws(k, logits, 64, 1024, 1.0, 0.0, 1.0, 7)
    assert set(got) <= set(allowed), sorted(set(got) - set(allowed))[:8]
    compare(k, logits, 64, 1024, 1.0, 0.0, 1.0, 7)
    if len(allowed) > 1:
        assert len(set(got)) > 1
