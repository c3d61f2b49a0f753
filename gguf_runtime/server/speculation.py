"""Speculative decoding in the server's CUDA adapter (``serve --spec ngram``): while the decoding
sequences are few (at most the tuning table's serve_spec_seqs, and their verification rows fit the
backend's verify_rows) and all greedy, their next tokens are proposed by n-gram lookup over each
one's prompt and output and checked together in one verification step (the backend's
verify_many: the decode kernels over each sequence's last token and its proposals), the kept ones
and each target's next token committed into the slots as if sampled (seq_commit), so the
launch-ahead loop reads them from the ring like any others and plain batch steps can follow at
once. A sequence without proposals takes one row there: its decode step. Sampled, penalized,
constrained or logprobs requests, more sequences, or a prompt waiting to join: the steps are plain
batch steps.

Policy (engine/speculative.py's FallBack, per sequence): nothing proposed, no rows of proposals;
LOW_STEPS verifications in a row that keep nothing (after a run: one): a run of plain tokens
(PLAIN_RUN, doubled after each such run up to PLAIN_RUN_MAX) before its next try, ended early once
the lookup's guesses of the next token were right SHADOW_HITS times in a row. A verification needs
the pipeline drained (its inputs are the last tokens read), so the adapter stops launching while
one is wanted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.speculative import FallBack, NgramLookup, accept_greedy, argmax_verified, first_k
from ..sampling import SamplingParams


def speculates(params: SamplingParams, grammar: str | None, logprobs: int) -> bool:
    """Whether a request's tokens can be verified by argmax: greedy, no penalty, no grammar and no
    logprobs (their kernels run beside the batch step's sampler)."""
    return argmax_verified(params) and not grammar and logprobs < 0


@dataclass
class SpecSlot:
    """One speculating sequence: its tokens (prompt and those read), its lookup, proposal size and
    runs of plain tokens (engine/speculative.py's FallBack)."""

    hist: list[int]
    adapt: object
    lookup: NgramLookup = field(default_factory=NgramLookup)
    fall: FallBack = field(default_factory=FallBack)
    plain: int = 0  # tokens to decode plainly before the next try

    def proposals(self, room: int, rows: int) -> list[int]:
        """At most rows - 1 proposals, leaving a token of the room for the target's next one."""
        if self.plain:
            return []
        k = min(self.adapt.k, room - 1, rows - 1)
        return [int(t) for t in self.lookup(self.hist, k)][:max(k, 0)]

    def read(self, tokens: list[int]) -> None:
        """Tokens read; during a plain run the lookup guesses each next one, and SHADOW_HITS right
        guesses in a row end the run (a copied passage began)."""
        for t in tokens:
            self.hist.append(t)
            if self.plain:
                self.plain -= 1
                if self.fall.foretold(t, self.lookup(self.hist, 1)):
                    self.plain = 0

    def kept(self, proposed: int, accepted: int) -> None:
        if not proposed:
            return
        self.adapt.update(proposed, accepted)
        self.fall.kept(accepted)
        if not accepted:  # (the next try the cheapest, as speculative_loop's)
            self.adapt.k = self.adapt.k_min
            if self.fall.due(True):
                self.plain = self.fall.start()


class Speculation:
    """The adapter's speculating slots and its counts (verification steps, proposed, accepted)."""

    def __init__(self, backend, k: int) -> None:
        self.be, self.k = backend, k
        self.rows = getattr(backend, "verify_rows", 8)  # a verification step's rows at most
        self.seqs = getattr(getattr(backend, "tune", None), "serve_spec_seqs", 2)  # ... and its sequences
        self.slots: dict[int, SpecSlot] = {}
        self.stats = dict(steps=0, proposed=0, accepted=0)
        self.want = False  # a verification is wanted: launch nothing

    def add(self, slot: int, prompt: list[int]) -> None:
        self.slots[slot] = SpecSlot(list(prompt), first_k(self.be, self.k))

    def drop(self, slot: int) -> None:
        self.slots.pop(slot, None)

    def _plan(self, loop, filling: bool) -> dict[int, list[int]]:
        """The decoding slots' proposals (slot -> tokens) where every one speculates, their rows fit
        one step and no prompt waits; else {}."""
        active = loop.active()
        if (filling or not active or len(active) > self.seqs or 2 * len(active) > self.rows
                or any(s not in self.slots for s in active)):
            return {}
        per = self.rows // len(active)
        return {s: self.slots[s].proposals(loop.room(s), per) for s in active}

    def plan(self, loop, filling: bool) -> dict[int, list[int]] | None:
        """Before a step: the proposals to verify now (nothing in flight), else None; sets ``want``
        (the loop's gate: while it holds, the steps in flight are read and none launched)."""
        props = self._plan(loop, filling)
        self.want = any(props.values())
        return props if self.want and not loop.in_flight() else None

    def verify(self, loop, props: dict[int, list[int]]) -> None:
        """One verification step of every decoding slot: the kept tokens and the next one of each go
        to the loop (a slot without proposals: its decode step's token)."""
        parts = [(s, [self.slots[s].hist[-1]] + p) for s, p in props.items()]
        targets = self.be.verify_many(parts)
        for (s, rows), target in zip(parts, targets):
            p = rows[1:]
            accepted, nxt = accept_greedy(p, [int(t) for t in target])
            self.slots[s].kept(len(p), accepted)
            keep = p[:accepted] + [nxt]
            self.be.seq_commit(s, keep)
            loop.extend(s, len(keep))
            self.stats["proposed"] += len(p)
            self.stats["accepted"] += accepted
        self.stats["steps"] += 1

    def read(self, out: dict[int, list[int]]) -> None:
        for slot, toks in out.items():
            if (s := self.slots.get(slot)) is not None:
                s.read(toks)
