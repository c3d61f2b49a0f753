"""Tensor parallelism's control path on the CPU (backends/mirror.py): a front and two workers over
real pipes (threads here, processes in the product), each over a backend that logs its calls. The
workers must run exactly the front's calls, in its order: nested calls not doubled, the same seeds,
launches forwarded, attribute writes and KV reservations mirrored, callbacks and streams dropped."""

from __future__ import annotations

import multiprocessing as mp
import threading

import numpy as np
import pytest

from gguf_runtime.backends.mirror import MirrorFront, serve_calls, stop_all
from gguf_runtime.errors import ContextOverflowError
from gguf_runtime.sampling import SamplingParams


class FakeKV:
    def __init__(self, log: list) -> None:
        self.log, self.page_size = log, 16

    def reserve(self, slot, n, stream=None):
        self.log.append(("kv.reserve", slot, n, stream is not None))

    def release(self, slot, stream=None, tokens=()):
        self.log.append(("kv.release", slot, stream is not None, tuple(tokens)))


class Fake:
    """The backend calls the engine, server and bench make, each logged (nested ones as the CUDA
    backend nests them: start_decode truncates and prefills)."""

    def __init__(self, log: list) -> None:
        self.log, self.kv, self.stream, self.prefill_graph = log, FakeKV(log), object(), True
        self.mask_host = np.full((4, 3), 0xFFFFFFFF, np.uint32)  # (the CUDA backend's pinned mask rows)
        self._masked: set[int] = set()

    def _log_masks(self) -> None:
        """The rows a sampling call masks with, as this rank holds them when the call runs."""
        if self._masked:
            self.log.append(("masks", tuple((s, tuple(self.mask_host[s].tolist())) for s in sorted(self._masked))))

    def seq_constrain(self, slot):
        self._masked.add(slot)
        return self.mask_host[slot]

    def truncate(self, n):
        self.log.append(("truncate", n))

    def prefill(self, tokens):
        self.log.append(("prefill", tuple(tokens)))

    def eval(self, tokens, all_logits=False):
        if len(tokens) > 100:
            raise ContextOverflowError("too long")
        self.log.append(("eval", tuple(tokens), all_logits))
        return [0.0]

    def eval_argmax(self, tokens):
        self.log.append(("eval_argmax", tuple(tokens)))
        return [0] * len(tokens)

    def capture_verify(self, slot=0):
        self.log.append(("capture_verify", slot))

    def start_decode(self, prompt, params, seed=0, keep=0):
        self.truncate(keep)
        self.prefill(prompt)
        self.log.append(("start_decode", seed))

    def run_steps(self, n, params, graph=False):
        self.log.append(("run_steps", n, graph))

    def seq_add(self, slot, prompt, params, max_new, seed=None, reuse=False):
        self._log_masks()
        self.log.append(("seq_add", slot, tuple(prompt), max_new, reuse, seed))

    def batch_step(self, n):
        self._log_masks()
        self.log.append(("batch_step", n))

    def seq_release(self, slot, tokens=()):
        self._masked.discard(slot)
        self.mask_host[slot] = 0xFFFFFFFF
        self.log.append(("seq_release", slot, tuple(tokens)))

    def hidden(self, tokens, slot=0):
        self.log.append(("hidden", tuple(tokens), slot))

    def capture_buckets(self, mode=(False, True), progress=None):
        self.log.append(("capture", mode, progress is None))

    def start_single(self, history, params, seed, given=None):
        self.log.append(("start_single", tuple(history), seed, given))
        return lambda: self.log.append(("launch",))

    def end_single(self):
        self.log.append(("end_single",))

    def retune(self, tune):
        self.log.append(("retune", tune))

    def verify_many(self, parts):
        self.log.append(("verify_many", tuple((s, tuple(t)) for s, t in parts)))
        return [np.asarray(t) + 1 for _, t in parts]

    def seq_commit(self, slot, tokens):
        self.log.append(("seq_commit", slot, tuple(tokens)))


class Front(MirrorFront, Fake):
    pass


@pytest.fixture
def group():
    ctx = mp.get_context("spawn")
    front_log, logs, conns, threads, workers = [], [], [], [], []
    for _ in range(2):
        mine, theirs = ctx.Pipe()
        log = []
        be = Fake(log)
        t = threading.Thread(target=serve_calls, args=(be, theirs))
        t.start()
        logs.append(log)
        conns.append(mine)
        threads.append(t)
        workers.append(be)
    front = Front(front_log)
    front._conns = conns
    front.mirror_kv()
    front._mirror_ready = True

    def finish():
        stop_all(conns)
        for t in threads:
            t.join(timeout=10)
        return logs

    yield front, front_log, finish, workers


def test_workers_run_exactly_the_fronts_calls(group):
    front, front_log, finish, workers = group
    p = SamplingParams(temperature=0.0)
    front.start_decode([1, 2, 3], p, seed=7)
    front.run_steps(4, p, graph=True)
    launch = front.start_single([1, 2], p, 9)
    for _ in range(3):
        launch()
    front.end_single()
    front.capture_verify()  # (speculation's start: graphs whose collectives every rank must run)
    assert [a.tolist() for a in front.verify_many([(1, [3, 4]), (2, [5])])] == [[4, 5], [6]]  # (serve --spec)
    front.seq_commit(1, [4, 7])
    front.eval_argmax([4, 5, 6])  # (speculative verification: every rank's forward, its collectives)
    front.start_single([1, 2, 4], p, 9, given=5)()  # (the fall-back from a given token)
    front.end_single()
    front.seq_add(1, (5, 6), p, 10)  # no seed: the front picks one, the same everywhere
    front.seq_add(2, (5, 6, 7), p, 10, reuse=True)
    front.batch_step(2)
    front.seq_release(1)
    front.seq_release(2, [5, 6, 7, 9])
    front.hidden([4, 5], slot=3)
    front.capture_buckets(progress=lambda *a: None)  # (the callback stays here)
    front.kv.reserve(0, 64, stream=front.stream)
    front.kv.release(0, stream=front.stream, tokens=[1, 2])
    front.eval([8], all_logits=True)
    with pytest.raises(ContextOverflowError):
        front.eval(list(range(200)))  # every rank refuses alike
    front.prefill_graph = False
    logs = finish()
    assert front_log.count(("truncate", 0)) == 1 and front_log.count(("prefill", (1, 2, 3))) == 1
    seeds = [e[-1] for e in front_log if e[0] == "seq_add"]
    assert len(seeds) == 2 and all(isinstance(s, int) for s in seeds)
    assert ("seq_release", 2, (5, 6, 7, 9)) in front_log and ("kv.release", 0, True, (1, 2)) in front_log
    assert ("capture", (False, True), False) in front_log
    for log, be in zip(logs, workers):
        assert log == [e if e[0] != "capture" else ("capture", e[1], True) for e in front_log]
        assert be.prefill_graph is False
    assert sum(e == ("launch",) for e in logs[0]) == 4
    assert ("eval_argmax", (4, 5, 6)) in logs[0] and ("start_single", (1, 2, 4), 9, 5) in logs[0]
    assert ("capture_verify", 0) in logs[0]
    assert ("verify_many", ((1, (3, 4)), (2, (5,)))) in logs[0] and ("seq_commit", 1, (4, 7)) in logs[0]


def test_writes_before_ready_stay_local(group):
    front, front_log, finish, workers = group
    front._mirror_ready = False
    front.prefill_graph = False  # (the backend's own setup, while loading)
    logs = finish()
    assert all(be.prefill_graph is True for be in workers) and logs == [[], []]


def test_grammar_masks_reach_the_workers_before_each_sampling_call(group):
    """A constrained slot's mask row, written by rank 0's caller between steps, is what every worker
    masks with at the next call that samples (the first token's, each batch step's); a row written
    after the last step is not sent until a call samples; nothing is sent once the slot is free."""
    front, front_log, finish, workers = group
    p = SamplingParams(temperature=0.0)
    row = front.seq_constrain(1)
    row[:] = [1, 2, 3]
    front.seq_add(1, (5, 6), p, 10)
    row[:] = [4, 5, 6]
    front.batch_step(2)
    row[:] = [7, 8, 9]
    front.batch_step(2)
    row[:] = [0, 0, 0]  # (after the last step)
    front.seq_release(1)
    front.batch_step(2)
    logs = finish()
    masks = [e[1] for e in front_log if e[0] == "masks"]
    assert masks == [((1, (1, 2, 3)),), ((1, (4, 5, 6)),), ((1, (7, 8, 9)),)]
    for log, be in zip(logs, workers):
        assert log == front_log
        assert not be._masked and (be.mask_host == 0xFFFFFFFF).all()
