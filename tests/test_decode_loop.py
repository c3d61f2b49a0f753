"""engine.decode_loop: the one launch-ahead loop, on a stand-in backend whose 'device' runs a
step only when the host waits for it (so how far ahead the loop launched is visible)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gguf_runtime.engine.batch import generate_batch
from gguf_runtime.engine.decode_loop import LaunchAhead, sample_loop
from gguf_runtime.sampling import SamplingParams


class Stream:
    def __init__(self):
        self.ops, self.done = [], 0

    def run_to(self, n):
        while self.done < n:
            self.ops[self.done]()
            self.done += 1

    def synchronize(self):
        self.run_to(len(self.ops))


class Event:
    def __init__(self):
        self.at, self.stream = None, None

    def record(self, stream):
        self.at, self.stream = len(stream.ops), stream

    def synchronize(self):
        self.stream.run_to(self.at)

    @property
    def done(self):
        return self.stream.done >= self.at


class Device:
    """Slot s's i-th token is 100 * s + i (token 0 sampled by start_single / seq_add)."""

    def __init__(self, n_slots=4):
        self.stream, self.ring, self.made = Stream(), {}, [0] * n_slots
        self.tune = SimpleNamespace(lookahead=3)
        self.launches, self.ended, self.in_flight_max = 0, 0, 0

    def _sample(self, slot):
        def op():
            self.ring[slot, self.made[slot]] = 100 * slot + self.made[slot]
            self.made[slot] += 1
        self.stream.ops.append(op)

    def new_event(self):
        return Event()

    def gpu_sampling(self, params):
        return True

    def start_single(self, history, params, seed):
        self._sample(0)

        def launch():
            self.launches += 1
            self._sample(0)
            self.in_flight_max = max(self.in_flight_max, len(self.stream.ops) - self.stream.done)
        return launch

    def end_single(self):
        self.stream.synchronize()
        self.ended += 1

    def seq_add(self, slot, prompt, params, n, seed):
        self.made[slot] = 0
        self._sample(slot)

    def batch_step(self, width):
        self.launches += 1
        for s in range(width):
            self._sample(s)

    def seq_token(self, slot, i):
        return self.ring[slot, i]

    def seq_release(self, slot):
        pass


def test_single_sequence_budget_lookahead_and_stop():
    d = Device()
    assert list(sample_loop(d, 10, SamplingParams(), [1], frozenset())) == list(range(10))
    assert d.launches == 9 and d.ended == 1  # n tokens: token 0 plus n - 1 steps
    assert d.in_flight_max <= 3 + 1  # lookahead steps (+ the token-0 sample) ahead of the host
    d = Device()
    assert list(sample_loop(d, 50, SamplingParams(), [1], frozenset({4}))) == [0, 1, 2, 3, 4]
    assert d.launches <= 4 + 3 and d.ended == 1  # stopped; at most lookahead steps past the stop


def test_single_sequence_closed_early_still_ends():
    d = Device()
    it = sample_loop(d, 50, SamplingParams(), [1], frozenset())
    assert next(it) == 0
    it.close()
    assert d.ended == 1


def test_batch_and_a_dropped_slot():
    d = Device()
    out = generate_batch(d, [[1], [2], [3]], 6, SamplingParams())
    assert out == [[100 * s + i for i in range(6)] for s in range(3)] and d.launches == 5
    d = Device()
    loop = LaunchAhead(d, depth=2, margin=10)  # (a finished sequence stays admitted here)
    for s in (0, 1):
        d.seq_add(s, [1], None, 8, None)
        loop.admit(s, 8)
    got = loop.step()
    assert got[0][0] == 0 and got[1][0] == 100
    loop.drop(1)
    d.seq_add(1, [1], None, 3, None)  # a new sequence in the same slot, old steps in flight
    loop.admit(1, 3)
    seen = {0: got[0], 1: []}
    while loop.pending():
        for s, toks in loop.step().items():
            seen[s] += toks
    assert seen[0] == list(range(8))
    assert seen[1][:3] == [100, 101, 102]  # the new sequence's tokens, none of the old one's
    assert len(seen[1]) <= 3 + 10


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_depth_bounds_steps_in_flight(depth):
    d = Device()
    loop = LaunchAhead(d, depth=depth)
    d.seq_add(0, [1], None, 20, None)
    loop.admit(0, 20)
    n = 0
    while loop.pending():
        n += len(loop.step().get(0, []))
        assert loop._steps <= depth
    assert n == 20 and d.launches == 19


def test_a_first_token_is_read_with_the_step_before_it():
    """A sequence admitted while steps are in flight: its first token (sampled after them on the
    stream) is read as soon as the step before it is, not with a step launched after it (that
    step's time would add to the time to first token)."""
    d = Device()
    loop = LaunchAhead(d, depth=2)
    d.seq_add(0, [1], None, 50, None)
    loop.admit(0, 50)
    loop.step()  # two steps in flight now
    d.seq_add(1, [1], None, 50, None)  # token 0 of slot 1, on the stream behind them
    loop.admit(1, 50)
    first = loop.step()  # waits for the oldest step in flight
    assert first.get(1) == [100]  # read now; before: only with the step launched after it
    assert loop._steps <= 2
