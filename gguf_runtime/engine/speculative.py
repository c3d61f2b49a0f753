"""Speculative decoding's host side (issue 36): proposing tokens and accepting them.

- ``ngram_propose``: prompt lookup (llama.cpp's lookup decoding, vLLM's ``ngram``): the longest
  suffix of the sequence (``n_max`` down to ``n_min`` tokens) that occurred before; the tokens
  that followed its latest earlier occurrence are the proposal. No model.
- ``accept_greedy``: with greedy decoding the target's own argmax at each proposed position; the
  proposals agreeing with it are kept, and the first disagreement is replaced by the target's token,
  so the output is the target's greedy output token for token.
- ``accept_sampled``: with temperature > 0, speculative sampling (Leviathan et al. 2023, Chen et
  al. 2023): proposal x drawn from q is kept with probability min(1, p(x) / q(x)); at the first
  rejection the token is drawn from max(p - q, 0) renormalized; after k acceptances one more from
  p. The tokens are distributed as the target's own samples (a test checks it on a small
  vocabulary). A proposer without probabilities (n-gram) is a point mass: q(x) = 1.
- ``AdaptiveK``: how many tokens to propose, from the recent acceptance.

The target evaluates its last token and the k proposals in one step; the caller then keeps the
cache of the accepted positions only (a truncate).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np


def ngram_propose(history: Sequence[int], k: int, n_max: int = 3, n_min: int = 1, window: int = 8192) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
    ``history`` (n_max .. n_min tokens), searched in its last ``window`` tokens; [] when none."""
    if k <= 0:
        return []
    h = list(history[-window:])
    n_tok = len(h)
    for n in range(min(n_max, n_tok - 1), n_min - 1, -1):
        suffix = h[n_tok - n:]
        for start in range(n_tok - n - 1, -1, -1):  # latest first; the suffix itself excluded
            if h[start:start + n] == suffix:
                follow = h[start + n:start + n + k]
                if follow:
                    return follow
    return []


class NgramLookup:
    """ngram_propose's proposals from an index kept across calls on a growing history (the n-grams
    followed by a token, each at its latest start), so a call costs a few dict lookups, not a scan
    of the window: speculative_loop asks after every token of a fall-back run. A history that is
    not the last one extended is indexed afresh."""

    def __init__(self, n_max: int = 3, n_min: int = 1) -> None:
        self.n_max, self.n_min = n_max, n_min
        self.h: list[int] = []
        self.at: list[dict[tuple[int, ...], int]] = [{} for _ in range(n_max + 1)]

    def _sync(self, history: Sequence[int]) -> None:
        h, m = self.h, len(self.h)
        if len(history) < m or (m and (history[m - 1] != h[-1] or history[0] != h[0])):
            self.h, self.at, m = [], [{} for _ in range(self.n_max + 1)], 0
            h = self.h
        for t in history[m:]:
            h.append(int(t))
            end = len(h) - 1  # the n-grams ending just before the new token are now followed by it
            for n in range(self.n_min, self.n_max + 1):
                if end - n >= 0:
                    self.at[n][tuple(h[end - n:end])] = end - n

    def __call__(self, history: Sequence[int], k: int) -> list[int]:
        if k <= 0:
            return []
        self._sync(history)
        h = self.h
        for n in range(min(self.n_max, len(h) - 1), self.n_min - 1, -1):
            s = self.at[n].get(tuple(h[len(h) - n:]))
            if s is not None:
                return h[s + n:s + n + k]
        return []


def argmax_verified(params) -> bool:
    """Whether the target's token at each proposed position is its logits' argmax (greedy without a
    penalty): a device then verifies by argmax alone (eval_argmax, verify_many)."""
    return params.greedy and (params.repeat_penalty == 1.0 or params.repeat_last_n == 0)


def accept_greedy(proposals: Sequence[int], target: Sequence[int]) -> tuple[int, int]:
    """(accepted, next): target[i] is the target's argmax after the prefix and proposals[:i]
    (len(proposals) + 1 rows); the proposals agreeing with it are accepted, and ``next`` is the
    target's token at the first disagreement (or after the last proposal)."""
    a = 0
    while a < len(proposals) and proposals[a] == target[a]:
        a += 1
    return a, int(target[a])


def _draw(p: np.ndarray, rng: np.random.Generator) -> int:
    c = np.cumsum(p, dtype=np.float64)
    return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), len(p) - 1))


def accept_sampled(proposals: Sequence[int], p_rows: np.ndarray, rng: np.random.Generator,
                   q_rows: np.ndarray | None = None) -> tuple[int, int]:
    """(accepted, next) by speculative sampling. p_rows: the target's probabilities at each
    proposed position and one past them [len(proposals) + 1, V]; q_rows: the proposer's (None: each
    proposal certain, as n-gram lookup's)."""
    for i, x in enumerate(proposals):
        p = np.asarray(p_rows[i], np.float64)
        qx = 1.0 if q_rows is None else float(q_rows[i][x])
        if qx > 0 and rng.random() * qx < p[x]:  # kept with probability min(1, p(x) / q(x))
            continue
        if q_rows is None:
            rest = p.copy()
            rest[x] = 0.0
        else:
            rest = np.maximum(p - np.asarray(q_rows[i], np.float64), 0.0)
        if rest.sum() <= 0:  # (p equals q: the rejection cannot happen; numerically, draw from p)
            rest = p
        return i, _draw(rest, rng)
    return len(proposals), _draw(np.asarray(p_rows[len(proposals)], np.float64), rng)


class AdaptiveK:
    """Tokens to propose: doubled (up to k_max) after a step that kept them all, halved (down to
    k_min) when the recent acceptance is under ``low``; the acceptance is averaged over steps.
    ``pow2``: the verification's rows (k + 1) stay powers of two (k = 1, 3, 7, ...; snapped down)."""

    def __init__(self, k: int = 4, k_min: int = 1, k_max: int = 8, low: float = 0.3, decay: float = 0.8,
                 pow2: bool = False) -> None:
        snap = (lambda v: (1 << (v + 1).bit_length() - 1) - 1) if pow2 else (lambda v: v)
        self.k, self.k_min, self.k_max = snap(k), k_min, max(k_min, snap(k_max))
        self.low, self.decay, self.pow2 = low, decay, pow2
        self.rate = 1.0
        self.proposed = self.accepted = 0

    def update(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.proposed += proposed
        self.accepted += accepted
        self.rate = self.decay * self.rate + (1 - self.decay) * accepted / proposed
        if accepted == proposed:
            self.k = min(self.k_max, self.k * 2 + self.pow2)
        elif self.rate < self.low:
            self.k = max(self.k_min, (self.k - self.pow2) // 2)

    @property
    def acceptance(self) -> float:
        """Accepted over proposed since the start."""
        return self.accepted / self.proposed if self.proposed else 0.0


def first_k(backend, k: int) -> AdaptiveK:
    """The proposal sizes speculative_loop starts from for ``--spec-k k``: up to 2 k as kept tries
    double it; on a backend with ``verify_rows`` (the GPU) at most verify_rows - 1, and k + 1 a
    power of two (its matvecs' compiled row counts), so k = 4 starts at 3."""
    k_max = max(k, 1) * 2
    pow2 = (most := getattr(backend, "verify_rows", 0)) > 1
    if pow2:  # (past verify_rows, a slower kernel path)
        k, k_max = min(k, most - 1), min(k_max, most - 1)
    return AdaptiveK(k, k_max=k_max, pow2=pow2)


def _probs(sampler, logits: np.ndarray, history: Sequence[int], n_vocab: int) -> np.ndarray:
    """The target's draw distribution over the whole vocabulary (the sampler's chain)."""
    ids, probs = sampler.distribution(logits, history)
    p = np.zeros(n_vocab, np.float64)
    p[ids] = probs
    return p


PLAIN_RUN = 64  # tokens a fall-back run decodes the plain way before proposals are tried again ...
PLAIN_RUN_MAX = 256  # ... doubled up to this after each run that nothing kept was proposed since
LOW_STEPS = 2  # verification steps that kept nothing, in a row, before falling back (after a fall-back run: 1)
SHADOW_HITS = 2  # a run after failed proposals ends once the lookup's next-token guesses were right this often in a row


@dataclasses.dataclass
class FallBack:
    """Where speculation stops paying, one sequence's runs of plain decoding (speculative_loop's
    and the server's rule): nothing proposed, or LOW_STEPS verifications in a row that kept nothing
    (after a run: one), start a run of ``length`` plain tokens, doubled after each run until a
    proposal is kept (PLAIN_RUN .. PLAIN_RUN_MAX). A run after failed n-gram proposals watches the
    lookup's guess of each next token: SHADOW_HITS right in a row end it (a copied passage began)."""

    idle: int = 0  # verifications in a row that kept nothing
    ran: bool = False  # a run happened, and no proposal was kept since
    length: int = PLAIN_RUN  # the next run's tokens
    guess: list[int] | None = None  # during a run: the lookup's guess of the next token ...
    hits: int = 0  # ... and how many tokens in a row its guesses were right

    def kept(self, accepted: int) -> None:
        """A verification kept ``accepted`` proposals."""
        if accepted:
            self.idle, self.ran, self.length = 0, False, PLAIN_RUN
        else:
            self.idle += 1

    def due(self, proposed: bool) -> bool:
        """Decode plainly now (``proposed``: the lookup has tokens to verify)?"""
        return not proposed or self.idle >= (1 if self.ran else LOW_STEPS)

    def start(self) -> int:
        """A run starts: its length."""
        if self.ran:
            self.length = min(self.length * 2, PLAIN_RUN_MAX)
        self.ran, self.idle, self.guess, self.hits = True, 0, None, 0
        return self.length

    def foretold(self, token: int, guess: list[int]) -> bool:
        """During a run: ``token`` came, and ``guess`` is the lookup's for the one after it; whether
        the guesses were right SHADOW_HITS tokens in a row."""
        if self.guess is not None:
            self.hits = self.hits + 1 if self.guess == [token] else 0
        self.guess = guess
        return self.hits >= SHADOW_HITS


def speculative_loop(backend, n: int, params, history: list[int], stop: frozenset[int], k: int = 4,
                     propose=ngram_propose, stats: dict | None = None):
    """Up to n tokens after the prompt already in ``backend`` (its ``last_logits``), as
    host_loop.host_sample_loop gives them, with ``propose(history, k)``'s tokens checked k at a time:
    each step evaluates the last token and the proposals in one call (``eval(..., all_logits=True)``;
    greedy runs without a penalty on a backend with ``eval_argmax``: the argmaxes computed there),
    keeps the accepted ones (greedy: the target's argmax; sampled: speculative sampling) and truncates
    the cache to them. Where speculation does not pay (nothing to propose, or LOW_STEPS steps in a
    row keeping nothing, the first at k tokens, the next at one) a backend that decodes on its device
    (``start_single``) decodes PLAIN_RUN tokens its own launch-ahead way (decode_loop.sample_loop)
    before proposals are tried again, one step of one token, and twice as many after each such run
    until a proposal is kept (PLAIN_RUN_MAX). A run ends early where proposals would pay again: the
    lookup proposes something after proposing nothing, or (n-gram lookup) its one-token guesses
    foretold SHADOW_HITS tokens in a row after failing.
    ``stats`` (if given) counts verification steps, proposed and accepted tokens, and tokens decoded
    the plain way and their seconds; and the seconds spent proposing (propose_s) and verifying
    (verify_s: the evaluation and its readback), and the fall-back runs started (runs).

    Greedy output equals the plain loop's token for token where a multi-row evaluation gives the
    same argmax as one row at a time: exactly on the numpy backend, and on the GPU where the
    verification runs on the decode matvecs (a row there is a decode step bit for bit); past them
    (big models' tensor-core products) the rows' logits differ in float order, which the int8
    activations can round up to a flipped near tie (the 8B twin's text parts within tens of tokens)."""
    from ..sampling import Sampler
    from .decode_loop import sample_loop

    if propose is ngram_propose:  # (the same proposals from an index kept over the loop)
        propose = NgramLookup()
    sampler = Sampler(params)
    hist = list(history)
    adapt = first_k(backend, k)
    st = stats if stats is not None else {}
    st.update(steps=0, proposed=0, accepted=0, plain=0, plain_s=0.0, propose_s=0.0, verify_s=0.0, runs=0)
    last = backend.last_logits
    last = np.asarray(last.get() if hasattr(last, "get") else last, np.float32)  # (a device array on CUDA)
    last = last.reshape(-1, last.shape[-1])[-1]
    n_vocab = int(last.shape[-1])
    tok = sampler.sample(last, hist)
    produced, fresh, fall = 0, True, FallBack()
    on_device = argmax_verified(params) and hasattr(backend, "eval_argmax")
    plain_ok = hasattr(backend, "start_single")
    if on_device and hasattr(backend, "capture_verify"):  # (the GPU: each verification size's graph now, not mid-answer)
        backend.capture_verify()
    while True:
        if fresh:  # (a fall-back run yielded its last token already)
            yield tok
            produced += 1
            if tok in stop or produced >= n:
                return
        fresh = True
        hist.append(tok)
        t_prop = time.perf_counter()
        props = [int(t) for t in propose(hist, min(adapt.k, n - produced))][:n - produced]
        st["propose_s"] += time.perf_counter() - t_prop
        if plain_ok and fall.due(bool(props)):
            run_len = fall.start()
            st["runs"] += 1
            # decode the plain way from tok (its first step evaluates it: the decode graph's
            # arithmetic, as plain decoding's), then leave the run's last token unevaluated, as a
            # verification step does
            base, t0 = backend.n_past, time.perf_counter()
            got: list[int] = []
            run_params = params if params.seed is None else dataclasses.replace(  # (each run its own draws)
                params, seed=(int(params.seed) * 1000003 + produced) % (1 << 63))
            # the run stops launching (its steps in flight still give their tokens) once speculation
            # would pay again: where nothing was proposed, once the lookup proposes something; where
            # the n-gram lookup's proposals failed, once its one-token proposals foretold SHADOW_HITS
            # tokens in a row (a draft model is not asked a token at a time: its runs run their length)
            watch = not props or isinstance(propose, NgramLookup)
            found, seen = [False], (list(hist) if watch else None)  # (the lookup's history, grown a token at a time)
            run = sample_loop(backend, min(run_len, n - produced), run_params, hist[:-1], stop, given=tok,
                              hold=(lambda: found[0]) if watch else None)
            try:
                for t in run:
                    got.append(t)
                    yield t
                    produced += 1
                    if t in stop or produced >= n:
                        break
                    if watch and not found[0]:
                        seen.append(t)
                        guess = propose(seen, 1)
                        found[0] = fall.foretold(t, guess) or (bool(guess) and not props)
            finally:
                run.close()  # (the device loop ends: its slot freed, the stream waited for)
            st["plain"] += len(got)
            st["plain_s"] += time.perf_counter() - t0  # (the consumer's time between tokens included)
            backend.truncate(base + len(got))
            if not got or got[-1] in stop or produced >= n:
                return
            hist.extend(got[:-1])
            tok, fresh = got[-1], False
            continue
        base, t_ver = backend.n_past, time.perf_counter()
        if on_device:  # greedy without a penalty: the argmaxes computed where the logits are
            target = [int(t) for t in backend.eval_argmax([tok] + props)]
            accepted, nxt = accept_greedy(props, target)
        elif params.greedy:
            rows = np.asarray(backend.eval([tok] + props, all_logits=True)).reshape(len(props) + 1, -1)
            target = [int(sampler.distribution(rows[i], hist + props[:i])[0][0]) for i in range(len(props) + 1)]
            accepted, nxt = accept_greedy(props, target)
        else:
            rows = np.asarray(backend.eval([tok] + props, all_logits=True)).reshape(len(props) + 1, -1)
            p_rows = np.stack([_probs(sampler, rows[i], hist + props[:i], n_vocab) for i in range(len(props) + 1)])
            accepted, nxt = accept_sampled(props, p_rows, sampler.rng)
        st["verify_s"] += time.perf_counter() - t_ver
        adapt.update(len(props), accepted)
        fall.kept(accepted)
        if not accepted:  # (the next try the cheapest: a verification's cost grows with its rows, steeply
            adapt.k = adapt.k_min  # past the decode matvecs' rows; a kept try doubles k again)
        st["steps"] += 1
        st["proposed"] += len(props)
        st["accepted"] += accepted
        backend.truncate(base + 1 + accepted)
        for t in props[:accepted]:
            yield t
            produced += 1
            if t in stop or produced >= n:
                return
            hist.append(t)
        tok = nxt
