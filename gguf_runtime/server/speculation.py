"""Speculative decoding in the server's CUDA adapter (``serve --spec ngram``): while one greedy
sequence decodes alone, its next tokens are proposed by n-gram lookup over its prompt and output
and checked in one verification step (the backend's seq_verify: the decode kernels over the last
token and the proposals), the kept ones and the target's next token committed into the slot as if
sampled (seq_commit), so the launch-ahead loop reads them from the ring like any others and plain
batch steps can follow at once. As soon as a second sequence decodes or a prompt waits to join,
the steps are plain batch steps again.

Policy (engine/speculative.py's, per slot): nothing proposed: plain steps, launched ahead as
usual, until the lookup proposes; LOW_STEPS verifications in a row that keep nothing: a run of
plain tokens (PLAIN_RUN, doubled after each such run up to PLAIN_RUN_MAX) before the next try.
A verification needs the pipeline drained (its input is the last token read), so the adapter
stops launching while it wants one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.speculative import LOW_STEPS, PLAIN_RUN, PLAIN_RUN_MAX, NgramLookup, accept_greedy, first_k
from ..sampling import SamplingParams


def speculates(params: SamplingParams, grammar: str | None, logprobs: int) -> bool:
    """Whether a request's tokens can be verified by argmax: greedy, no penalty, no grammar and no
    logprobs (their kernels run beside the batch step's sampler)."""
    return (params.greedy and (params.repeat_penalty == 1.0 or params.repeat_last_n == 0) and not grammar
            and logprobs < 0)


@dataclass
class SpecSlot:
    """One speculating sequence: its tokens (prompt and those read), its lookup and proposal size."""

    hist: list[int]
    adapt: object
    lookup: NgramLookup = field(default_factory=NgramLookup)
    plain: int = 0  # tokens to decode plainly before the next try
    run: int = PLAIN_RUN  # the next run's length
    idle: int = 0  # verifications in a row that kept nothing

    def proposals(self, room: int) -> list[int]:
        return [int(t) for t in self.lookup(self.hist, min(self.adapt.k, room - 1))][:max(room - 1, 0)]

    def read(self, tokens: list[int]) -> None:
        self.hist.extend(tokens)
        self.plain = max(0, self.plain - len(tokens))


class Speculation:
    """The adapter's speculating slots and its counts (steps, proposed, accepted)."""

    def __init__(self, backend, k: int) -> None:
        self.be, self.k = backend, k
        self.slots: dict[int, SpecSlot] = {}
        self.stats = dict(steps=0, proposed=0, accepted=0)
        self.want = False  # the sole decoding sequence wants a verification: launch nothing

    def add(self, slot: int, prompt: list[int]) -> None:
        self.slots[slot] = SpecSlot(list(prompt), first_k(self.be, self.k))

    def drop(self, slot: int) -> None:
        self.slots.pop(slot, None)

    def sole(self, loop, filling: bool) -> SpecSlot | None:
        """The speculating sequence when it decodes alone and no prompt waits, else None."""
        active = loop.active()
        if filling or len(active) != 1 or active[0] not in self.slots:
            return None
        return self.slots[active[0]]

    def plan(self, loop, filling: bool) -> int | None:
        """Before a step: the slot to verify now (nothing in flight), else None; sets ``want`` (the
        gate: while it holds, in-flight steps are read and none launched)."""
        s = self.sole(loop, filling)
        self.want = s is not None and s.plain == 0 and bool(s.proposals(loop.room(loop.active()[0])))
        return loop.active()[0] if self.want and not loop.in_flight() else None

    def verify(self, loop, slot: int) -> None:
        """One verification of the slot's proposals; the kept tokens and the next one go to the loop."""
        s = self.slots[slot]
        props = s.proposals(loop.room(slot))
        target = [int(t) for t in self.be.seq_verify(slot, [s.hist[-1]] + props)]
        accepted, nxt = accept_greedy(props, target)
        s.adapt.update(len(props), accepted)
        if accepted:
            s.idle, s.run = 0, PLAIN_RUN
        else:  # (the next try the cheapest, as speculative_loop's)
            s.idle, s.adapt.k = s.idle + 1, s.adapt.k_min
            if s.idle >= LOW_STEPS:
                s.plain, s.run, s.idle = s.run, min(s.run * 2, PLAIN_RUN_MAX), 0
        keep = props[:accepted] + [nxt]
        self.be.seq_commit(slot, keep)
        loop.extend(slot, len(keep))
        self.stats["steps"] += 1
        self.stats["proposed"] += len(props)
        self.stats["accepted"] += accepted

    def read(self, out: dict[int, list[int]]) -> None:
        for slot, toks in out.items():
            if (s := self.slots.get(slot)) is not None:
                s.read(toks)
