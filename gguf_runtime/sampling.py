"""Choosing the next token from the logits: llama.cpp's default sampler chain, in numpy.

This is the reference implementation: a GPU sampler is tested against it stage by stage, so every
stage is a pure function of its inputs with the math written out.

The chain, in llama.cpp's default order::

    repetition penalty -> top-k -> top-p -> min-p -> temperature -> softmax -> draw

Conventions shared by the stage functions:

* ``logits`` is a 1-D float array over the vocabulary (or over a subset of it); a removed token
  has logit ``-inf``. Each stage returns a new array and never changes its input.
* "Descending order" always breaks ties by the lower token id, so every stage is deterministic.
* top-p and min-p see the probabilities of the tokens still in the running (softmax over the finite
  logits, at temperature 1), as in llama.cpp, where temperature is applied after them.
* Probabilities are computed in float64 after subtracting the maximum logit.

:class:`Sampler` runs the chain on compact candidate lists (ids plus logits) rather than
masked full-vocabulary arrays, so a 262,144-token vocabulary costs one partition (introselect) and a
sort of the survivors; the result is identical to chaining the stage functions.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = [
    "SamplingParams", "Sampler",
    "apply_repeat_penalty", "top_k_indices", "top_k_filter", "top_p_filter", "min_p_filter",
    "apply_temperature", "softmax", "draw",
]


# ---- parameters ---------------------------------------------------------------------------------

@dataclass
class SamplingParams:
    """Sampler settings, with llama.cpp's defaults. 0 / 1.0 switch a stage off as noted."""

    temperature: float = 0.8  # 0 = greedy (argmax after the repetition penalty)
    top_k: int = 40  # 0 = off
    top_p: float = 0.95  # 1.0 = off
    min_p: float = 0.05  # 0 = off
    repeat_penalty: float = 1.0  # 1.0 = off
    repeat_last_n: int = 64  # tokens of history penalized; 0 = off, -1 = the whole history
    seed: int | None = None  # None = a random seed (the Sampler records the one it drew)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first out-of-range setting."""

        def num(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) \
                    or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
            return float(v)

        def integer(name: str) -> int:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"{name} must be an integer, got {v!r}")
            return int(v)

        if num("temperature") < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if integer("top_k") < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < num("top_p") <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not 0 <= num("min_p") <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if num("repeat_penalty") <= 0:
            raise ValueError(f"repeat_penalty must be > 0 (1 = off), got {self.repeat_penalty}")
        if integer("repeat_last_n") < -1:
            raise ValueError(f"repeat_last_n must be >= -1 (0 = off, -1 = whole history), got {self.repeat_last_n}")
        if self.seed is not None and (integer("seed") < 0):
            raise ValueError(f"seed must be a non-negative integer or None, got {self.seed}")


# ---- stages (pure functions) --------------------------------------------------------------------

def apply_repeat_penalty(logits: np.ndarray, history: Sequence[int], penalty: float,
                         last_n: int = 64) -> np.ndarray:
    """llama.cpp's repetition penalty.

    Every distinct token among the last ``last_n`` of ``history`` (all of it if ``last_n`` is -1,
    none if 0) has its logit divided by ``penalty`` when positive, multiplied when <= 0 -- so a
    penalty > 1 always makes it less likely. Ids outside the vocabulary are ignored.
    """
    out = np.array(logits, dtype=np.float32, copy=True)
    if penalty == 1.0 or last_n == 0 or len(history) == 0:
        return out
    window = history if last_n < 0 else history[-last_n:]
    ids = np.unique(np.asarray(window, dtype=np.int64))
    ids = ids[(ids >= 0) & (ids < out.shape[0])]
    v = out[ids]
    out[ids] = np.where(v > 0, v / np.float32(penalty), v * np.float32(penalty))
    return out


def top_k_indices(logits: np.ndarray, k: int) -> np.ndarray:
    """Ids of the ``k`` largest logits in descending order (ties: lower id first).

    A partition finds the k-th largest value in O(n); only the k survivors are sorted. No NaNs.
    """
    x = np.asarray(logits)
    n = x.shape[0]
    if k <= 0 or k >= n:
        return np.argsort(-x, kind="stable")
    kth = np.partition(x, n - k)[n - k]  # the k-th largest value, in O(n)
    above = np.flatnonzero(x > kth)  # fewer than k, ascending ids
    ties = np.flatnonzero(x == kth)[: k - above.shape[0]]  # the lowest ids among the ties
    sel = np.concatenate([above, ties])
    return sel[np.argsort(-x[sel], kind="stable")]  # stable: equal logits stay in id order


def top_k_filter(logits: np.ndarray, k: int) -> np.ndarray:
    """Keep the ``k`` largest logits (ties at the boundary: lower ids), -inf elsewhere; k <= 0 = off."""
    x = np.asarray(logits)
    if k <= 0 or k >= x.shape[0]:
        return x.copy()
    out = np.full_like(x, -np.inf)
    keep = top_k_indices(x, k)
    out[keep] = x[keep]
    return out


def softmax(logits: np.ndarray) -> np.ndarray:
    """float64 probabilities; -inf logits get 0. Subtracts the max first, so large logits are safe."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max() if x.shape[0] else -np.inf
    if m == np.inf:  # +inf logits take all the mass, shared equally
        p = (x == np.inf).astype(np.float64)
        return p / p.sum()
    if not np.isfinite(m):
        raise ValueError("no token has a finite logit")
    e = np.exp(x - m)
    return e / e.sum()


def _top_p_count(sorted_probs: np.ndarray, p: float) -> int:
    """How many of the (descending) probabilities form the smallest prefix whose sum is >= p."""
    cum = np.cumsum(sorted_probs)
    n = int(np.searchsorted(cum, p, side="left")) + 1  # first index with cum >= p, plus one
    return min(n, sorted_probs.shape[0])  # rounding left the sum short of p: keep them all


def top_p_filter(logits: np.ndarray, p: float) -> np.ndarray:
    """Nucleus sampling: keep the smallest set of most likely tokens whose probability sums to >= p.

    Probabilities are the softmax of the finite logits; tokens are taken in descending order (ties:
    lower id) and the token that crosses ``p`` is kept. p >= 1 = off.
    """
    x = np.asarray(logits)
    if p >= 1.0:
        return x.copy()
    order = np.argsort(-x, kind="stable")
    n_keep = _top_p_count(softmax(x)[order], p)
    out = np.full_like(x, -np.inf)
    keep = order[:n_keep]
    out[keep] = x[keep]
    return out


def min_p_filter(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep tokens whose probability is >= ``p`` times the top token's; p <= 0 = off.

    In logits: keep ``logit >= max_logit + ln(p)`` (as llama.cpp), which never drops the top token.
    """
    x = np.asarray(logits)
    if p <= 0.0:
        return x.copy()
    threshold = float(np.max(x)) + math.log(p)
    return np.where(x.astype(np.float64) >= threshold, x, -np.inf).astype(x.dtype, copy=False)


def apply_temperature(logits: np.ndarray, temperature: float) -> np.ndarray:
    """float64 logits / temperature (temperature > 0; 0 means greedy and is handled by the caller)."""
    if temperature <= 0:
        raise ValueError("temperature must be > 0 here; greedy decoding takes the argmax instead")
    return np.asarray(logits, dtype=np.float64) / float(temperature)


def draw(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF draw: the index i with cdf[i-1] <= u * total < cdf[i]; u in [0, 1).

    A zero-probability entry can never be drawn.
    """
    cdf = np.cumsum(np.asarray(probs, dtype=np.float64))
    i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return min(i, cdf.shape[0] - 1)


# ---- the sampler --------------------------------------------------------------------------------

_TOP_P_FIRST_TRY = 256  # without top-k, look for the nucleus among this many best tokens first


class Sampler:
    """Runs the chain on one logits vector per call, drawing from its own seeded generator.

    Same seed (and same inputs) => same draws. ``seed`` holds the seed actually used.
    """

    def __init__(self, params: SamplingParams | None = None) -> None:
        self.params = params if params is not None else SamplingParams()
        self.params.validate()
        self.seed: int = int(self.params.seed) if self.params.seed is not None else secrets.randbits(32)
        self.rng = np.random.default_rng(self.seed)

    def _penalized(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        x = np.asarray(logits, dtype=np.float32)
        if x.ndim != 1 or x.shape[0] == 0:
            raise ValueError(f"logits must be a non-empty 1-D array, got shape {x.shape}")
        if np.isnan(x).any():
            x = np.where(np.isnan(x), np.float32(-np.inf), x)
        pr = self.params
        if pr.repeat_penalty != 1.0 and pr.repeat_last_n != 0 and len(history):
            x = apply_repeat_penalty(x, history, pr.repeat_penalty, pr.repeat_last_n)
        return x

    def candidates(self, logits: np.ndarray, history: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """The tokens that survive penalty, top-k, top-p and min-p, in descending order (ties:
        lower id), with their logits (float32, before temperature)."""
        pr = self.params
        x = self._penalized(logits, history)
        n = x.shape[0]
        if not np.isfinite(x).any() and not (x == np.inf).any():
            raise ValueError("no token has a finite logit")

        # top-k (sorted survivors), or the nucleus found among the best few hundred tokens
        if 0 < pr.top_k < n:
            ids = top_k_indices(x, pr.top_k)
            v = x[ids]
        elif pr.top_p < 1.0:
            ids, v = self._nucleus_without_top_k(x)
        else:
            ids = np.flatnonzero(x > -np.inf)
            v = x[ids]  # sorted below, after min-p has shrunk them
        # top-p over the current candidates (already sorted, and already cut if done above)
        if pr.top_p < 1.0 and 0 < pr.top_k < n:
            n_keep = _top_p_count(softmax(v), pr.top_p)
            ids, v = ids[:n_keep], v[:n_keep]
        # min-p relative to the best remaining token
        if pr.min_p > 0.0:
            keep = v.astype(np.float64) >= float(v.max()) + math.log(pr.min_p)
            ids, v = ids[keep], v[keep]
        # canonical order when no stage sorted them
        if not (0 < pr.top_k < n) and not pr.top_p < 1.0:
            order = np.argsort(-v, kind="stable")  # ids ascending on entry: ties stay lower-id first
            ids, v = ids[order], v[order]
        return ids, v

    def _nucleus_without_top_k(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """top-p on the full vocabulary, sorting only as many tokens as the nucleus needs.

        Uses the global softmax normaliser, and sums the same terms in the same order as a full
        sort would, so the cut is identical to ``top_p_filter``.
        """
        p = self.params.top_p
        n = x.shape[0]
        x64 = x.astype(np.float64)
        m = float(x64.max())
        if m == np.inf:
            ids = np.flatnonzero(x == np.inf)
            return ids, x[ids]
        z = float(np.exp(x64 - m).sum())
        k = _TOP_P_FIRST_TRY
        while True:
            ids = top_k_indices(x, k) if k < n else np.argsort(-x, kind="stable")
            probs = np.exp(x64[ids] - m) / z
            cum_end = float(np.cumsum(probs)[-1])
            if cum_end >= p or k >= n:
                n_keep = _top_p_count(probs, p)
                ids = ids[:n_keep]
                return ids, x[ids]
            k *= 8

    def distribution(self, logits: np.ndarray, history: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """(ids, float64 probabilities) of the final draw; one id with probability 1 when greedy."""
        if self.params.greedy:
            x = self._penalized(logits, history)
            return np.array([int(np.argmax(x))], dtype=np.int64), np.ones(1)
        ids, v = self.candidates(logits, history)
        return ids, softmax(apply_temperature(v, self.params.temperature))

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """The next token id. Greedy takes the argmax (ties: lowest id) and draws nothing."""
        ids, probs = self.distribution(logits, history)
        if ids.shape[0] == 1:
            return int(ids[0])
        return int(ids[draw(probs, float(self.rng.random()))])


MAX_TOP_LOGPROBS = 20  # alternatives per token the APIs may ask for (OpenAI's and Ollama's limit)


def token_logprobs(logits: np.ndarray, tok: int, k: int) -> tuple[int, float, tuple[tuple[int, float], ...]]:
    """(``tok``, its log-probability, the ``k`` most likely tokens' (id, log-probability) in descending
    order, ties by lower id) under the model's own distribution: log-softmax of the raw logits, before
    penalties, temperature, truncation or a grammar's mask (as Ollama and vLLM report them). The
    log-sum-exp is taken in float64 after subtracting the maximum."""
    x = np.asarray(logits, dtype=np.float32)
    m = float(x.max())
    lse = m + math.log(float(np.exp((x - np.float32(m)).astype(np.float64)).sum()))
    top = top_k_indices(x, k) if k > 0 else np.empty(0, np.int64)
    return int(tok), float(x[tok]) - lse, tuple((int(i), float(x[i]) - lse) for i in top[:k])
