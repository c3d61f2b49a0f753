"""The one launch-ahead decode loop: decode steps run ahead of the host, which reads tokens later.

A backend that decodes on the device (the CUDA backend: ``stream``, ``seq_token``, and a step to
launch) leaves each step's sampled tokens in a pinned ring. ``LaunchAhead`` keeps up to ``depth``
steps enqueued on the backend's stream, records an event after each launch, and on ``step()``
waits for the oldest step's event and returns the tokens that became readable, per slot, in order.
Every sequence is admitted after its prompt's first token was sampled on the stream; each has a
budget of tokens, and no step is launched once some sequence would run more than ``margin``
tokens past its budget (its KV pages end there). A sequence dropped while steps are in flight is
safe: its slot can take a new sequence at once (everything is ordered on one stream), and tokens
of the old one are told apart by their admission number and discarded.

Three users, one loop: ``sample_loop`` (one sequence in slot 0: the engine's generation),
``engine.batch.generate_batch`` (several prompts at once), and the server's CUDA adapter
(continuous batching).
"""

from __future__ import annotations

import secrets
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

from ..sampling import SamplingParams


@dataclass
class _Seq:
    gen: int  # admission number: tells a sequence from an earlier one in the same slot
    launched: int  # tokens whose sampling has been enqueued (token 0 before admission)
    budget: int
    read: int = 0  # tokens returned by step()


@dataclass
class _Mark:
    event: object
    is_step: bool
    marks: list[tuple[int, int, int]]  # (slot, gen, token index) this launch produces


def _cupy_event():
    import cupy

    return cupy.cuda.Event(disable_timing=True)


class LaunchAhead:
    """Up to ``depth`` decode steps in flight for the admitted sequences (see the module).

    ``launch()`` enqueues one decode step of every admitted slot (default: the backend's batch
    step over slots below the highest admitted one).
    """

    def __init__(self, backend, depth: int, margin: int = 0, launch: Callable[[], None] | None = None,
                 new_event: Callable[[], object] | None = None,
                 read: Callable[[int, int], int] | None = None, gate: Callable[[], bool] | None = None) -> None:
        self.be, self.depth, self.margin = backend, max(1, int(depth)), margin
        self._launch = launch or (lambda: backend.batch_step(max(self._seqs) + 1))
        self._read = read or (lambda s, i: backend.seq_token(s, i))  # (slot, token index) -> token, once readable
        self._gate = gate or (lambda: True)  # False: launch nothing now (the host needs tokens read first)
        self._new_event = new_event or getattr(backend, "new_event", None) or _cupy_event
        self._pool: list[object] = []
        self._fifo: deque[_Mark] = deque()  # launches in stream order, not yet read
        self._steps = 0  # decode steps among them
        self._seqs: dict[int, _Seq] = {}
        self._gen = 0

    def admit(self, slot: int, budget: int) -> None:
        """A sequence whose token 0 has just been sampled (enqueued) into ``slot``."""
        self._gen += 1
        self._seqs[slot] = _Seq(self._gen, 1, budget)
        self._record(False, [(slot, self._gen, 0)])

    def drop(self, slot: int) -> None:
        """Forget the slot's sequence; tokens of it still in flight are discarded."""
        self._seqs.pop(slot, None)

    def extend(self, slot: int, n: int) -> None:
        """n tokens of the slot's sequence that the host put on the stream (a speculative
        verification's kept tokens, committed as the sampler commits one): read in order, after
        everything launched before them."""
        q = self._seqs[slot]
        self._record(False, [(slot, q.gen, q.launched + i) for i in range(n)])
        q.launched += n

    def room(self, slot: int) -> int:
        """Tokens the slot's sequence may still be given (its budget less those launched)."""
        q = self._seqs.get(slot)
        return q.budget - q.launched if q is not None else 0

    def active(self) -> list[int]:
        """The slots of the admitted sequences."""
        return list(self._seqs)

    def in_flight(self) -> bool:
        """Whether anything launched is not read yet."""
        return bool(self._fifo)

    def unread(self, slot: int) -> int:
        """Tokens of the slot's sequence enqueued and not yet returned by step() (0 if none)."""
        q = self._seqs.get(slot)
        return q.launched - q.read if q is not None else 0

    def busy(self) -> bool:
        """Whether any admitted sequence is decoding."""
        return bool(self._seqs)

    def pending(self) -> bool:
        """Whether ``step`` has anything left to read or launch."""
        return bool(self._fifo) or (bool(self._seqs) and self._may_launch())

    def _record(self, is_step: bool, marks: list[tuple[int, int, int]]) -> None:
        ev = self._pool.pop() if self._pool else self._new_event()
        ev.record(self.be.stream)
        self._fifo.append(_Mark(ev, is_step, marks))
        self._steps += is_step

    def _may_launch(self) -> bool:
        seqs = self._seqs.values()
        # some sequence still needs a token, and no sequence would write past its pages
        return any(q.launched < q.budget for q in seqs) and all(q.launched <= q.budget + self.margin
                                                                for q in seqs) and self._gate()

    def step(self) -> dict[int, list[int]]:
        """Launch up to ``depth`` steps ahead, wait for the oldest, return the readable tokens."""
        while self._steps < self.depth and self._seqs and self._may_launch():
            self._launch()
            marks = []
            for s, q in self._seqs.items():
                marks.append((s, q.gen, q.launched))
                q.launched += 1
            self._record(True, marks)
        if not self._fifo:
            return {}
        k = next((i for i, m in enumerate(self._fifo) if m.is_step), len(self._fifo) - 1)
        self._fifo[k].event.synchronize()  # the oldest step: all before it is done too
        k += 1
        while k < len(self._fifo) and (not self._fifo[k].is_step or self._fifo[k].event.done):
            if not self._fifo[k].is_step:
                # a first token sampled after that step (an admission): waited for and read now, not
                # with the next step, which was launched after it and would add its time to the TTFT
                self._fifo[k].event.synchronize()
            k += 1
        out: dict[int, list[int]] = {}
        for _ in range(k):
            m = self._fifo.popleft()
            self._steps -= m.is_step
            self._pool.append(m.event)
            for s, gen, i in m.marks:
                q = self._seqs.get(s)
                if q is not None and q.gen == gen:
                    q.read += 1
                    out.setdefault(s, []).append(self._read(s, i))
        return out


def sample_loop(backend, n: int, params: SamplingParams, history: list[int],
                stop: frozenset[int], constraint=None, given: int | None = None,
                hold: Callable[[], bool] | None = None) -> Iterator[int]:
    """Up to n tokens of the sequence in the backend's slot 0 (its prompt already evaluated),
    until a stop token (yielded) or the budget. Device-decoding backends run the launch-ahead
    loop; the others, samplers the device lacks and grammar-constrained output (``constraint``)
    sample on the host. ``given``: the tokens follow that one, not evaluated yet (``history``: the
    evaluated tokens, without it); a device-decoding backend's first decode step evaluates it, and
    ``hold()`` true ends the loop early: it launches no more steps and yields those in flight."""
    if given is not None:
        if constraint is None and hasattr(backend, "start_single") and backend.gpu_sampling(params):
            yield from _loop_after(backend, n, params, history, stop, int(given), hold)
        else:
            backend.eval([int(given)])
            yield from sample_loop(backend, n, params, list(history) + [int(given)], stop, constraint)
        return
    if not hasattr(backend, "start_single"):
        yield from backend.sample_loop(n, params, history, stop, constraint=constraint)
        return
    if constraint is not None or not backend.gpu_sampling(params):
        yield from backend.host_sample_loop(n, params, history, stop, constraint=constraint)
        return
    yield from _loop_after(backend, n, params, history, stop, None)


def _loop_after(backend, n: int, params: SamplingParams, history: list[int], stop: frozenset[int],
                given: int | None, hold: Callable[[], bool] | None = None) -> Iterator[int]:
    """The launch-ahead loop of slot 0 from token 0 sampled on the stream, or from ``given``."""
    seed = int(params.seed) if params.seed is not None else secrets.randbits(63)
    launch = backend.start_single(history, params, seed, given) if given is not None else \
        backend.start_single(history, params, seed)  # token 0 sampled on the stream
    loop = LaunchAhead(backend, backend.tune.lookahead, launch=launch,
                       gate=(lambda: not hold()) if hold is not None else None)
    skip = given is not None  # (token 0 is the given one: read, not yielded)
    loop.admit(0, n + skip)
    try:
        while loop.pending():
            for tok in loop.step().get(0, ()):
                if skip:
                    skip = False
                    continue
                yield tok
                if tok in stop:
                    return
    finally:
        backend.end_single()
