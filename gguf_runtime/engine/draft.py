"""Speculative decoding's draft model (``--spec draft --draft FILE``, llama.cpp's ``-md``): a smaller
model of the same vocabulary proposes its own greedy continuation, k tokens, which the target then
checks in one evaluation (speculative.py).

The draft runs on a backend of its own (its KV cache, on the GPU its decode graphs) and follows the
target's sequence: before each proposal it evaluates what it has not seen of the history (a prefix
it holds is kept, as the engine's cache is), then decodes k tokens from the last one the way plain
decoding does (decode_loop.sample_loop from a given token). Its proposals are greedy, hence
certain: with temperature > 0 the target keeps one with probability p(x) (speculative sampling
with a point-mass q), so the output is still the target's own distribution.
"""

from __future__ import annotations

from typing import Sequence

from ..errors import GGUFRunError
from ..sampling import SamplingParams
from .decode_loop import sample_loop

GREEDY = SamplingParams(temperature=0.0, repeat_penalty=1.0)
VOCAB_SLACK = 128  # ids the two vocabularies may differ by at their end (llama.cpp's bound: padding)


def check_vocab(target, draft, target_path: str, draft_path: str) -> None:
    """One line where the draft's tokens are not the target's (the same ids must be the same text)."""
    a, b = target.tokenizer, draft.tokenizer
    na, nb = target.cfg.n_vocab, draft.cfg.n_vocab
    if abs(na - nb) > VOCAB_SLACK:
        raise GGUFRunError(f"--draft {draft_path}: its vocabulary has {nb:,} tokens and the model's {na:,}; "
                           "use a draft model of the same family (the same tokenizer)")
    for i in range(min(len(a.tokens), len(b.tokens))):
        if a.tokens[i] != b.tokens[i]:
            raise GGUFRunError(f"--draft {draft_path}: token {i} is {b.tokens[i]!r} there and {a.tokens[i]!r} in "
                               f"{target_path}; use a draft model of the same family (the same tokenizer)")


class DraftProposer:
    """``propose(history, k)`` for speculative_loop: the draft engine's greedy continuation of
    ``history``, at most k tokens (fewer where its context ends; ids the target lacks end it)."""

    def __init__(self, draft, n_vocab: int) -> None:
        self.engine = draft  # the draft model's Engine
        self.n_vocab = n_vocab  # the target's: a proposal past it ends there
        self.held: list[int] = []  # the tokens whose K/V the draft's cache holds, in order

    def __call__(self, history: Sequence[int], k: int) -> list[int]:
        be, n_ctx = self.engine.backend, self.engine.n_ctx
        k = min(k, n_ctx - len(history))
        if k <= 0 or not history:
            return []
        ctx, last = list(history[:-1]), int(history[-1])
        keep = 0
        for x, y in zip(self.held, ctx):
            if x != y:
                break
            keep += 1
        be.truncate(keep)
        del self.held[keep:]
        try:
            if len(ctx) > keep:
                be.prefill(ctx[keep:])
            self.held = list(ctx)
            out = [int(t) for t in sample_loop(be, k, GREEDY, ctx, frozenset(), given=last)]
        except BaseException:
            self.held = []  # (what the draft's cache holds is unknown now: all of it evaluated again)
            raise
        # the loop evaluated `last` and every token it yielded but the last one (on a GPU perhaps
        # more, launched ahead): the cache keeps exactly those
        self.held = ctx + [last] + out[:-1]
        be.truncate(len(self.held))
        for i, t in enumerate(out):
            if t >= self.n_vocab:
                return out[:i]
        return out
