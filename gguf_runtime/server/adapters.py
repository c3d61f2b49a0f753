"""Backend adapters: the small interface the scheduler drives, over the CUDA and numpy backends.

An adapter has ``tokenizer``, ``n_ctx``, ``max_slots`` and ``margin`` (context tokens a sequence
needs past its budget), and four calls, all made from the scheduler's thread:

* ``add(slot, prompt, params, max_new) -> int``: admit a sequence (prefill it, sample its first
  token); returns how many prompt tokens were evaluated. Raises :class:`NoRoom` when the KV cache
  cannot hold it right now (the scheduler keeps it waiting).
* ``step() -> {slot: [token, ...]}``: advance every admitted sequence; returns the tokens that
  became readable (in order; possibly none for a slot, possibly several).
* ``release(slot)``: forget the sequence; its slot and KV pages are free at once.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from ..errors import BackendError, KVCacheFullError
from ..sampling import SamplingParams

MAX_GPU_TOP_K = 1024  # the CUDA sampler's top-k limit (backend_cuda.MAX_GPU_TOP_K)


class NoRoom(Exception):
    """The KV cache has no pages for this sequence now; try again when one finishes."""


def make_adapter(engine, depth: int = 2, progress: Callable[[str, int, int], None] | None = None):
    """The adapter for the engine's backend: CUDA (batched) or numpy (one sequence at a time)."""
    if getattr(engine.backend, "name", "") == "cuda":
        return CudaAdapter(engine, depth=depth, progress=progress)
    return NumpyAdapter(engine)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n, i = min(len(a), len(b)), 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class NumpyAdapter:
    """One sequence at a time in slot 0 (the numpy backend holds one KV cache), reusing the KV
    prefix the previous request left (the engine's ``cached`` bookkeeping)."""

    name = "numpy"
    max_slots = 1
    margin = 0

    def __init__(self, engine) -> None:
        self.engine, self.be, self.tokenizer = engine, engine.backend, engine.tokenizer
        self.n_ctx = engine.n_ctx
        self._it = None
        self._seq: list[int] = []

    def add(self, slot: int, prompt: Sequence[int], params: SamplingParams, max_new: int) -> int:
        eng, be = self.engine, self.be
        prompt = list(prompt)
        keep = _common_prefix(eng.cached, prompt)
        if keep == len(prompt):  # all cached: re-evaluate the last token for its logits
            keep -= 1
        be.truncate(keep)
        del eng.cached[keep:]
        eng.cached.extend(prompt[keep:])
        self._seq = prompt
        try:
            be.prefill(prompt[keep:])
        except BaseException:
            self._trim()
            raise
        self._it = be.sample_loop(max_new, params, list(prompt), frozenset())
        return len(prompt) - keep

    def step(self) -> dict[int, list[int]]:
        if self._it is None:
            return {}
        try:
            tok = next(self._it)
        except StopIteration:
            self._it = None
            return {}
        self._seq.append(tok)
        return {0: [tok]}

    def release(self, slot: int) -> None:
        if self._it is not None:
            self._it.close()
            self._it = None
        self._trim()

    def _trim(self) -> None:
        """Keep as cached exactly the tokens whose K/V the backend holds."""
        n = min(self.be.n_past, len(self._seq))
        self.engine.cached[:] = self._seq[:n]
        self.be.truncate(n)


@dataclass
class _Seq:
    gen: int  # admission number: tells a sequence from an earlier one in the same slot
    launched: int  # tokens whose sampling has been enqueued (token 0 by seq_add)
    budget: int


@dataclass
class _Mark:
    event: object
    is_step: bool
    marks: list[tuple[int, int, int]]  # (slot, gen, token index) this launch produces


def _cupy_event():
    import cupy

    return cupy.cuda.Event(disable_timing=True)


class CudaAdapter:
    """Every admitted sequence in its own slot of the CUDA backend's batch graphs.

    Up to ``depth`` decode steps are in flight: ``step`` launches steps until ``depth`` are
    enqueued, then waits for the oldest and reads the tokens it (and what preceded it on the
    stream) produced from the pinned ring. A sequence therefore runs up to ``depth - 1`` steps
    past its end before the host sees it; ``margin`` = ``depth`` extra tokens of KV pages are
    reserved for that, and the scheduler clips budgets so they stay inside the context. A slot
    released while steps are in flight is safe to reuse at once: everything is ordered on the
    backend's one stream, and tokens of the old sequence are dropped by their admission number.
    """

    name = "cuda"

    def __init__(self, engine, depth: int = 2, new_event: Callable[[], object] | None = None,
                 capture: bool = True, progress: Callable[[str, int, int], None] | None = None) -> None:
        be = engine.backend
        try:
            from ..backend_cuda import RING
        except ImportError:  # a stand-in backend (tests)
            RING = 64
        self.engine, self.be, self.tokenizer = engine, be, engine.tokenizer
        self.n_ctx, self.max_slots = be.n_ctx, be.max_batch
        self.depth = max(1, min(int(depth), RING // 2))
        self.margin = self.depth
        self._new_event = new_event or _cupy_event
        self._pool: list[object] = []
        self._fifo: deque[_Mark] = deque()  # launches in stream order, not yet read
        self._steps = 0  # decode steps among them
        self._seqs: dict[int, _Seq] = {}
        self._gen = 0
        if capture and getattr(be, "use_graph", False) and hasattr(be, "capture_buckets"):
            be.capture_buckets(progress=progress)  # before serving: no capture pause mid-stream

    def _params(self, p: SamplingParams) -> SamplingParams:
        """The GPU sampler keeps at most 1024 candidates: top-k 0 (off) or above becomes 1024."""
        if not p.greedy and not 0 < p.top_k <= MAX_GPU_TOP_K:
            return dataclasses.replace(p, top_k=MAX_GPU_TOP_K)
        return p

    def add(self, slot: int, prompt: Sequence[int], params: SamplingParams, max_new: int) -> int:
        be, kv = self.be, self.be.kv
        n = min(self.n_ctx, len(prompt) + max_new + self.margin)
        need = -(-n // kv.page_size) - kv.capacity(slot) // kv.page_size
        if need > kv.free_pages():
            raise NoRoom
        try:
            be.seq_add(slot, list(prompt), self._params(params), max_new + self.margin, params.seed)
        except KVCacheFullError:
            raise NoRoom from None
        except BackendError:
            be.seq_release(slot)
            raise
        except BaseException:
            be.seq_release(slot)
            raise
        self._gen += 1
        self._seqs[slot] = _Seq(self._gen, 1, max_new)
        self._record(False, [(slot, self._gen, 0)])
        return len(prompt)

    def _record(self, is_step: bool, marks: list[tuple[int, int, int]]) -> None:
        ev = self._pool.pop() if self._pool else self._new_event()
        ev.record(self.be.stream)
        self._fifo.append(_Mark(ev, is_step, marks))
        self._steps += is_step

    def _may_launch(self) -> bool:
        seqs = self._seqs.values()
        # some sequence still needs a token, and no sequence would write past its pages
        return any(q.launched < q.budget for q in seqs) and all(q.launched <= q.budget + self.margin
                                                                for q in seqs)

    def step(self) -> dict[int, list[int]]:
        while self._steps < self.depth and self._seqs and self._may_launch():
            self.be.batch_step(max(self._seqs) + 1)
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
        while k < len(self._fifo) and self._fifo[k].event.done:
            k += 1
        out: dict[int, list[int]] = {}
        for _ in range(k):
            m = self._fifo.popleft()
            self._steps -= m.is_step
            self._pool.append(m.event)
            for s, gen, i in m.marks:
                q = self._seqs.get(s)
                if q is not None and q.gen == gen:
                    out.setdefault(s, []).append(self.be.seq_token(s, i))
        return out

    def release(self, slot: int) -> None:
        self._seqs.pop(slot, None)
        self.be.seq_release(slot)
