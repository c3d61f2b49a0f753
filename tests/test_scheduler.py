"""The continuous-batching scheduler's control flow, on CPU, with scripted stand-in backends.

``FakeAdapter`` scripts tokens per slot (admission between steps, slot reuse, cancellation,
budgets, stops, fairness); ``FakeCudaBackend`` mimics the CUDA backend's batch API with a
deferred stream (ops run only when an event is waited on), so :class:`CudaAdapter`'s pipelining,
ring reads and KV-page reservations are checked against the real adapter code. Its pages hold
the identity of the history written there, so every read the prefix cache serves is checked too.
"""

from __future__ import annotations

import random
import threading
from types import SimpleNamespace

import pytest

from gguf_runtime.backends.page_pool import PagePool
from gguf_runtime.errors import BackendError, ContextOverflowError, KVCacheFullError
from gguf_runtime.sampling import SamplingParams
from gguf_runtime.server.adapters import CudaAdapter, NoRoom
from gguf_runtime.server.scheduler import Job, Scheduler, ShuttingDown, StopMatcher

EOG = 0


class FakeDecoder:
    def push(self, tok: int) -> str:
        return chr(ord("a") + (tok - 1) % 26)

    def flush(self) -> str:
        return ""


FAKE_TOK = SimpleNamespace(eog_ids=frozenset({EOG}), stream=lambda skip_special=True, keep=frozenset(): FakeDecoder())


def script(uid: int, i: int) -> int:
    """Token i of sequence uid: never EOG unless uid says where (uid // 1000 = EOG position)."""
    stop_at = uid // 1000
    return EOG if stop_at and i == stop_at else 1 + (uid * 7 + i) % 26


class FakeAdapter:
    """One token per active slot per step, from ``script``; logs every call."""

    name, margin = "fake", 0

    def __init__(self, slots: int = 2, n_ctx: int = 64) -> None:
        self.max_slots, self.n_ctx, self.tokenizer = slots, n_ctx, FAKE_TOK
        self.seqs: dict[int, list] = {}
        self.log: list[tuple] = []
        self.no_room = False
        self.fail_step = False

    def add(self, slot, prompt, params, max_new):
        if self.no_room:
            raise NoRoom
        assert slot not in self.seqs
        self.seqs[slot] = [params.seed, 0]
        self.log.append(("add", slot, params.seed))
        return len(prompt)

    def step(self):
        if self.fail_step:
            raise RuntimeError("device lost")
        self.log.append(("step", tuple(sorted(self.seqs))))
        out = {}
        for s, q in self.seqs.items():
            out[s] = [script(q[0], q[1])]
            q[1] += 1
        return out

    def release(self, slot):
        self.log.append(("release", slot))
        del self.seqs[slot]


class Events:
    def __init__(self) -> None:
        self.text, self.done, self.error, self.logprobs = [], None, None, []

    def __call__(self, kind, data) -> None:
        if kind == "text":
            self.text.append(data)
        elif kind == "logprobs":
            self.logprobs.append(list(data))
        elif kind == "done":
            self.done = data
        else:
            self.error = data


def job(uid: int, max_new: int = 5, stop=(), prompt_len: int = 3) -> Job:
    return Job(list(range(1, prompt_len + 1)), SamplingParams(seed=uid), max_new, Events(), tuple(stop))


def make(adapter) -> Scheduler:
    s = Scheduler(lambda: adapter)
    s._setup()
    return s


def run(s: Scheduler, *jobs: Job, steps: int = 1000) -> None:
    for j in jobs:
        s.submit(j)
    for _ in range(steps):
        s._pump()
        if not (s.active or s.waiting) and s._inbox.empty():
            return
    raise AssertionError("the scheduler did not go idle")


def expected(uid: int, n: int) -> str:
    out = []
    for i in range(n):
        t = script(uid, i)
        if t == EOG:
            break
        out.append(chr(ord("a") + (t - 1) % 26))
    return "".join(out)


def test_budget_and_text():
    a = FakeAdapter()
    s = make(a)
    j = job(7, max_new=5)
    run(s, j)
    assert j.emit.done is j and j.reason == "length" and len(j.ids) == 5
    assert "".join(j.emit.text) == expected(7, 5)
    assert a.seqs == {} and sorted(s._free) == [0, 1] and s._pending == 0


def test_end_of_generation_token_stops():
    s = make(FakeAdapter())
    j = job(3007, max_new=50)  # EOG at token 3
    run(s, j)
    assert j.reason == "stop" and len(j.ids) == 3 and "".join(j.emit.text) == expected(3007, 50)


def test_stop_string_is_cut_across_tokens():
    s = make(FakeAdapter())
    full = expected(11, 20)
    j = job(11, max_new=20, stop=[full[5:8]])
    run(s, j)
    assert j.reason == "stop" and "".join(j.emit.text) == full[:5]


def test_stop_matcher_holds_back_prefixes():
    m = StopMatcher(("</end>", "STOP"))
    assert m.push("hello </e") == ("hello ", False)
    assert m.push("nx") == ("</enx", False)
    assert m.push(" ST") == (" ", False)
    assert m.push("OP tail") == ("", True)
    assert StopMatcher(()).push("x") == ("x", False)
    m = StopMatcher(("ab",))
    assert m.push("xa") == ("x", False) and m.flush() == "a"


def test_admission_between_steps_and_slot_reuse():
    a = FakeAdapter(slots=2)
    s = make(a)
    j1, j2, j3 = job(1, 6), job(2, 3), job(3, 2)
    s.submit(j1)
    s._pump()
    s._pump()  # j1 has 2 tokens
    assert len(j1.ids) == 2
    run(s, j2, j3)
    adds = [e for e in a.log if e[0] == "add"]
    assert adds == [("add", 0, 1), ("add", 1, 2), ("add", 1, 3)]  # j3 reuses j2's slot, FIFO
    # j2 joined while j1 was running, and j3 right after j2 was released
    i2, r2, i3 = a.log.index(("add", 1, 2)), a.log.index(("release", 1)), a.log.index(("add", 1, 3))
    assert r2 < i3 and ("step", (0, 1)) in a.log[i2:r2]
    assert [len(j.ids) for j in (j1, j2, j3)] == [6, 3, 2]
    assert "".join(j3.emit.text) == expected(3, 2)


def test_fairness_every_active_sequence_advances_each_step():
    a = FakeAdapter(slots=4)
    s = make(a)
    jobs = [job(u, 8) for u in range(1, 5)]
    run(s, *jobs)
    steps = [e[1] for e in a.log if e[0] == "step"]
    assert steps[:8] == [(0, 1, 2, 3)] * 8 and len(steps) == 8


def test_cancel_frees_the_slot_before_the_next_step():
    a = FakeAdapter(slots=1)
    s = make(a)
    long, waiting = job(5, 1000), job(6, 3)
    s.submit(long)
    s.submit(waiting)
    for _ in range(3):
        s._pump()
    assert s.active[0] is long and list(s.waiting) == [waiting]
    s.cancel(long)
    s._pump()
    log = a.log[a.log.index(("release", 0)):]
    assert log[:3] == [("release", 0), ("add", 0, 6), ("step", (0,))]
    assert long.state == "cancelled" and long.emit.done is None and long.emit.error is None
    run(s)
    assert waiting.reason == "length" and s._pending == 0


def test_cancel_while_waiting():
    a = FakeAdapter(slots=1)
    s = make(a)
    j1, j2 = job(1, 4), job(2, 4)
    s.submit(j1)
    s.submit(j2)
    s.cancel(j2)
    run(s)
    assert ("add", 0, 2) not in a.log and j2.state == "cancelled" and j1.reason == "length"


def test_no_room_waits_then_fails_when_idle():
    a = FakeAdapter(slots=2)
    s = make(a)
    j1, j2 = job(1, 3), job(2, 3)
    s.submit(j1)
    s._pump()
    a.no_room = True
    s.submit(j2)
    s._pump()
    assert list(s.waiting) == [j2] and s.active == {0: j1}
    run(s)
    assert j1.reason == "length" and isinstance(j2.emit.error, ContextOverflowError)


def test_admission_limits_prompt_tokens_per_round():
    a = FakeAdapter(slots=8)
    s = make(a)
    s.admit_tokens = 10
    first = job(1, 50, prompt_len=4)
    s.submit(first)
    s._pump()
    for u in range(2, 6):
        s.submit(job(u, 2, prompt_len=4))
    s._pump()
    assert len(s.active) <= 4  # 3 admitted (12 tokens >= 10), then the round stops
    run(s)


def test_budget_clipping():
    a = FakeAdapter(n_ctx=64)
    a.margin = 2
    s = make(a)
    assert s.budget(10, None) == 52 and s.budget(10, 5) == 5 and s.budget(10, 10**9) == 52
    with pytest.raises(ContextOverflowError):
        s.budget(62, None)
    # a request's own window (Ollama's num_ctx): up to the server's context (past it, the server's), the margin kept
    assert s.budget(10, None, 20) == 10 and s.budget(10, 4, 20) == 4 and s.budget(10, None, 64) == 52
    assert s.budget(10, None, 65) == 52 and s.budget(10, None, 10**9) == 52
    with pytest.raises(ContextOverflowError, match="the prompt is 20 tokens but options.num_ctx is 20"):
        s.budget(20, None, 20)
    zero = job(1, 0)
    run(s, zero)
    assert zero.reason == "length" and not zero.ids and not a.log


def test_failures_keep_serving():
    a = FakeAdapter()
    s = make(a)
    bad_emit = job(1, 100)
    bad_emit.emit = lambda kind, data: (_ for _ in ()).throw(RuntimeError("loop closed"))
    run(s, bad_emit)
    assert bad_emit.state == "cancelled" and a.seqs == {}
    j = job(2, 100)
    s.submit(j)
    s._pump()
    a.fail_step = True
    s._pump()
    assert isinstance(j.emit.error, RuntimeError) and s.active == {} and a.seqs == {}
    a.fail_step = False
    ok = job(3, 4)
    run(s, ok)
    assert ok.reason == "length"


def test_threaded_shutdown_fails_running_jobs():
    s = Scheduler(lambda: FakeAdapter(slots=1))
    s.start()
    j1, j2 = job(1, 10**6), job(2, 5)
    s.submit(j1)
    s.submit(j2)
    threading.Event().wait(0.05)
    s.shutdown()
    assert isinstance(j1.emit.error, ShuttingDown) and isinstance(j2.emit.error, ShuttingDown)
    with pytest.raises(ShuttingDown):
        s.submit(job(3))


def test_factory_error_reaches_start():
    s = Scheduler(lambda: (_ for _ in ()).throw(BackendError("no GPU")))
    with pytest.raises(BackendError, match="no GPU"):
        s.start()


# ---- CudaAdapter against a stand-in of the CUDA backend's batch API ----------------------------


class FakeStream:
    def __init__(self) -> None:
        self.ops: list = []

    def run_one(self) -> None:
        self.ops.pop(0)()


class FakeEvent:
    def __init__(self, stream: FakeStream, rng: random.Random) -> None:
        self.stream, self.rng, self.fired = stream, rng, True

    def record(self, stream) -> None:
        self.fired = False
        stream.ops.append(self._fire)

    def _fire(self) -> None:
        self.fired = True

    def synchronize(self) -> None:
        while not self.fired:
            self.stream.run_one()

    @property
    def done(self) -> bool:
        if self.stream.ops and self.rng.random() < 0.5:  # the device got ahead meanwhile
            self.stream.run_one()
        return self.fired


class FakeKV:
    """The real page pool (backends/page_pool.py) over simulated pages: ``mem[page][i]`` is what the
    stream's ops wrote at that position, the identity of the history up to it (a running hash of
    the sequence's tokens), so reading a page another history wrote, or one nobody wrote, fails."""

    page_size = 16

    def __init__(self, n_pages: int, slots: int) -> None:
        self.n_pages, self.pool = n_pages, PagePool(n_pages, self.page_size, slots)
        self.mem = [[None] * self.page_size for _ in range(n_pages)]

    def capacity(self, s):
        return len(self.pool.owned(s)) * self.page_size

    def free_pages(self):
        return self.pool.available()

    def match(self, tokens):
        return self.pool.match(tokens, len(tokens) - 1)

    def reserve(self, s, n, prefix=()):
        self.pool.reserve(s, -(-n // self.page_size), prefix)

    def publish(self, s, tokens):
        self.pool.publish(s, tokens)

    def release(self, s, tokens=()):
        self.pool.release(s, tokens)

    def write(self, table, p, ident):
        self.mem[table[p // self.page_size]][p % self.page_size] = ident

    def check(self, table, idents):
        """A read of positions [0, len(idents)): each must hold that history's K/V."""
        for p, want in enumerate(idents):
            assert self.mem[table[p // self.page_size]][p % self.page_size] == want, f"position {p}: stale K/V"


def identities(tokens, start=(0,)):
    out = list(start[-1:])
    for t in tokens:
        out.append(hash((out[-1], t)))
    return out[1:]


class FakeCudaBackend:
    name = "cuda"
    use_graph = False

    def __init__(self, n_ctx=256, max_batch=8, n_pages=None) -> None:
        self.n_ctx, self.max_batch, self.stream = n_ctx, max_batch, FakeStream()
        self.kv = FakeKV(n_pages or n_ctx // 16 * max_batch, max_batch)
        self.ring = [[None] * max_batch for _ in range(64)]
        self.dev: list = [None] * max_batch  # device-side slot state, as ops leave it
        self.steps = 0
        self.evaluated: list[tuple[int, int]] = []  # (prompt tokens, evaluated) of each admission
        self.filling: dict = {}  # slot -> [table, tokens in its pages, identities] while its prompt is evaluated
        self.chunks: list = []  # (slot, tokens, steps launched before) of each seq_prefill

    def seq_add(self, slot, prompt, params, max_new, seed, reuse=False):
        cached = self.seq_start(slot, prompt, params, max_new, reuse)
        self.seq_prefill(slot, prompt[cached:])
        self.seq_first(slot, prompt, params, seed, publish=reuse)
        return len(prompt) - cached

    def seq_start(self, slot, prompt, params, max_new, reuse=False):
        kv = self.kv
        prefix = kv.match(prompt) if reuse and not kv.capacity(slot) else []
        kv.reserve(slot, min(self.n_ctx, len(prompt) + max_new), prefix=prefix)
        past = len(prefix) * kv.page_size
        self.filling[slot] = [list(kv.pool.owned(slot)), past, identities(prompt)]
        self.evaluated.append((len(prompt), len(prompt) - past))
        self.chunks.append((slot, past, "start"))
        return past

    def seq_prefill(self, slot, tokens):
        table, past, idents = f = self.filling[slot]
        assert len(tokens) <= len(idents) - past
        f[1] = past + len(tokens)
        self.chunks.append((slot, len(tokens), self.steps))

        def op():
            self.kv.check(table, idents[:past])  # what the prompt's earlier part left (or the cache)
            for p in range(past, past + len(tokens)):
                self.kv.write(table, p, idents[p])

        self.stream.ops.append(op)

    def seq_first(self, slot, prompt, params, seed, publish=False):
        table, past, idents = self.filling.pop(slot)
        assert past == len(prompt), "sampled before the prompt's last token was evaluated"
        cap = self.kv.capacity(slot)
        if publish:
            self.kv.publish(slot, prompt)

        def op():
            self.kv.check(table, idents)
            t0 = script(seed, 0)
            self.dev[slot] = {"pos": len(prompt), "n": 1, "uid": seed, "cap": cap, "table": table,
                              "idents": list(idents), "last": t0}
            self.ring[0][slot] = t0

        self.stream.ops.append(op)

    def batch_step(self, n_slots):
        rows = next(b for b in (1, 2, 4, 8, 16, 32, 64) if b >= n_slots)
        assert rows <= self.max_batch
        self.steps += 1

        def op():
            for d_slot in range(rows):
                d = self.dev[d_slot]
                if d is None:
                    continue
                assert d["pos"] < d["cap"], "a decode step wrote past the slot's KV pages"
                d["idents"] += identities([d["last"]], d["idents"])  # the token it consumes
                self.kv.write(d["table"], d["pos"], d["idents"][-1])
                self.kv.check(d["table"], d["idents"])  # attention reads the whole history
                d["pos"] += 1
                d["last"] = script(d["uid"], d["n"])
                self.ring[d["n"] % 64][d_slot] = d["last"]
                d["n"] += 1

        self.stream.ops.append(op)

    def seq_token(self, slot, i):
        return self.ring[i % 64][slot]

    def seq_release(self, slot, tokens=()):
        self.filling.pop(slot, None)
        self.kv.release(slot, tokens)

        def op():
            self.dev[slot] = None

        self.stream.ops.append(op)


class PackingFakeBackend(FakeCudaBackend):
    """... with the real backend's seq_prefill_many: the parts of one call are one forward (recorded)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.forwards: list[list[tuple[int, int, bool]]] = []  # (slot, tokens, first token sampled) of each call

    def seq_prefill_many(self, parts):
        self.forwards.append([(slot, len(toks), first is not None) for slot, toks, first in parts])
        for slot, toks, first in parts:
            if len(toks):
                self.seq_prefill(slot, toks)
            if first is not None:
                self.seq_first(slot, *first)


def cuda_adapter(depth: int, seed: int = 0, packing: bool = True, **kw):
    be = (PackingFakeBackend if packing else FakeCudaBackend)(**kw)
    rng = random.Random(seed)
    eng = SimpleNamespace(backend=be, tokenizer=FAKE_TOK)
    return CudaAdapter(eng, depth=depth, new_event=lambda: FakeEvent(be.stream, rng)), be


@pytest.mark.parametrize("depth,packing", [(1, True), (2, True), (4, True), (2, False)])
def test_cuda_adapter_many_jobs(depth, packing):
    rng = random.Random(depth)
    a, be = cuda_adapter(depth, seed=depth, packing=packing)
    s = make(a)
    jobs = []
    for u in range(1, 41):
        stop_at = rng.choice([0, 0, 1, 2, 5, 9])
        uid = stop_at * 1000 + u
        n_prompt = rng.randint(1, 60)
        jobs.append(job(uid, s.budget(n_prompt, rng.choice([None, 1, 3, 17, 10**6])), prompt_len=n_prompt))
    for i in range(0, len(jobs), 7):  # arrivals in bursts, between steps
        for j in jobs[i:i + 7]:
            s.submit(j)
        for _ in range(rng.randint(0, 5)):
            s._pump()
    run(s, steps=100000)
    for j in jobs:
        uid = j.params.seed
        assert j.state == "done", (uid, j.emit.error)
        assert "".join(j.emit.text) == expected(uid, j.max_new)
        assert j.reason == ("stop" if uid // 1000 and uid // 1000 < j.max_new else "length")
    assert be.kv.free_pages() == be.kv.n_pages and a.loop._seqs == {}
    assert any(n > e for n, e in be.evaluated)  # (the prompts share their start: the cache served some)


def test_cuda_adapter_cancel_and_reuse_with_steps_in_flight():
    a, be = cuda_adapter(depth=3, max_batch=2)
    s = make(a)
    j1, j2, j3 = job(1, 200), job(2, 200), job(3, 6)
    s.submit(j1)
    s.submit(j2)
    s.submit(j3)
    for _ in range(4):
        s._pump()
    assert be.stream.ops  # steps are in flight
    s.cancel(j1)
    s._pump()  # slot 0 released and j3 admitted into it with old steps still queued
    assert s.active[0] is j3 and be.kv.capacity(0) > 0
    s.cancel(j2)
    run(s)
    assert j3.reason == "length" and "".join(j3.emit.text) == expected(3, 6)
    assert be.kv.free_pages() == be.kv.n_pages


def test_cuda_adapter_kv_full_waits():
    # pages for one sequence at a time: the second waits for the first, then runs
    a, be = cuda_adapter(depth=2, n_ctx=64, max_batch=2, n_pages=4)
    s = make(a)
    j1, j2 = job(1, s.budget(20, None), prompt_len=20), job(2, 10, prompt_len=20)
    s.submit(j1)
    s.submit(j2)
    s._pump()
    assert list(s.waiting) == [j2]
    run(s)
    assert j1.reason == j2.reason == "length" and "".join(j2.emit.text) == expected(2, 10)


def chat_job(uid: int, prompt: list[int], max_new: int) -> Job:
    return Job(list(prompt), SamplingParams(seed=uid), max_new, Events())


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_prefix_cache_serves_a_resent_conversation(depth):
    """Twenty turns, each resending the history (prompt, the answer's tokens, a new message): each
    turn evaluates only what the cache lacks (under two pages plus the new message), the pages it
    reads hold exactly that history (FakeKV checks every read), and the answers are the script's."""
    a, be = cuda_adapter(depth, n_ctx=1024, max_batch=2)
    s = make(a)
    history = list(range(1, 40))
    for turn in range(1, 21):
        j = chat_job(turn, history, 12)
        run(s, j)
        assert j.reason == "length" and "".join(j.emit.text) == expected(turn, 12)
        n, evaluated = be.evaluated[-1]
        assert n == len(history) and (turn == 1 or evaluated < 2 * 16 + 7), (turn, evaluated)
        history += j.ids + [100 + turn] * 7  # the answer as generated, then the next message
    assert sum(e for _, e in be.evaluated) < 0.4 * sum(n for n, _ in be.evaluated)
    assert be.kv.free_pages() == be.kv.n_pages


def test_prefix_cache_off_evaluates_everything():
    a, be = cuda_adapter(2, n_ctx=512, max_batch=2)
    a.prefix_cache = False
    s = make(a)
    for uid in (1, 2):
        run(s, chat_job(uid, list(range(1, 60)), 4))
    assert be.evaluated == [(59, 59), (59, 59)] and be.kv.pool.cached() == 0


def test_prefix_cache_shared_by_concurrent_sequences_and_cancels():
    """Eight requests with one 50-token system prompt arrive together: the first evaluates it, the
    others take its three full pages while it runs (ref-counted); cancelling the first (and a
    second) while their pages are shared leaves the others' output and reads intact."""
    a, be = cuda_adapter(2, n_ctx=256, max_batch=8)
    s = make(a)
    system = list(range(1, 51))
    jobs = [chat_job(uid, system + [200 + uid] * 3, 30) for uid in range(1, 9)]
    for j in jobs:
        s.submit(j)
    s._pump()
    # all eight evaluated in the first step: the first whole, then the others (they waited for its
    # pages, so took them back with them) only their own last 5 tokens
    evaluated = [sum(n for slot, n, at in be.chunks if slot == j.slot and at != "start") for j in jobs]
    assert len(s.active) == 8 and evaluated == [53] + [5] * 7
    assert [j.prompt_eval for j in jobs] == evaluated
    assert [[(slot, n) for slot, n, _ in f] for f in be.forwards] == [[(0, 53)], [(s_, 5) for s_ in range(1, 8)]]
    shared = be.kv.pool.owned(jobs[0].slot)[:3]
    assert all(be.kv.pool.owned(j.slot)[:3] == shared for j in jobs)
    for _ in range(3):
        s._pump()
    s.cancel(jobs[0])
    s.cancel(jobs[5])
    run(s)
    for j in jobs[1:5] + jobs[6:]:
        assert j.reason == "length" and "".join(j.emit.text) == expected(j.params.seed, 30)
    assert be.kv.free_pages() == be.kv.n_pages and be.kv.pool.cached() > 0


def test_prompts_arriving_together_are_evaluated_in_one_forward():
    """Sixteen different prompts submitted at once: one seq_prefill_many call holds them all (the
    backend packs it into forwards), each part whole and sampling its first token; arrivals while
    they decode go into the next step's call, and every answer is the script's."""
    a, be = cuda_adapter(2, n_ctx=256, max_batch=32)
    s = make(a)
    jobs = [chat_job(uid, [1000 * uid + i for i in range(5 + uid)], 12) for uid in range(1, 17)]
    for j in jobs:
        s.submit(j)
    s._pump()
    assert be.forwards == [[(j.slot, 5 + j.params.seed, True) for j in jobs]]
    late = [chat_job(uid, [1000 * uid + i for i in range(9)], 6) for uid in range(17, 21)]
    for j in late:
        s.submit(j)
    s._pump()
    assert be.forwards[1] == [(j.slot, 9, True) for j in late]
    run(s)
    for j in jobs + late:
        assert j.reason == "length" and "".join(j.emit.text) == expected(j.params.seed, j.max_new)
    assert be.kv.free_pages() == be.kv.n_pages


def test_prefix_cache_evicts_least_recent_and_never_what_is_in_use():
    """A pool of 24 pages under 60 requests of 10 different 40-token prompts (three pages each plus
    room to generate): pages are evicted oldest first when the free list runs dry, never while a
    running sequence holds them (FakeKV's reads would see another history), and every answer is
    the script's."""
    rng = random.Random(5)
    a, be = cuda_adapter(2, n_ctx=128, max_batch=4, n_pages=24)
    s = make(a)
    prompts = [[1000 * k + i for i in range(40)] for k in range(10)]
    jobs = [chat_job(uid, rng.choice(prompts), rng.randint(1, 20)) for uid in range(1, 61)]
    for i in range(0, 60, 5):
        for j in jobs[i:i + 5]:
            s.submit(j)
        for _ in range(rng.randint(0, 6)):
            s._pump()
    run(s, steps=100000)
    for j in jobs:
        assert j.state == "done" and "".join(j.emit.text) == expected(j.params.seed, j.max_new)
    hits = sum(n - e for n, e in be.evaluated)
    assert 0 < hits < sum(n for n, _ in be.evaluated)
    assert be.kv.free_pages() == be.kv.n_pages


def test_long_prompt_is_evaluated_in_chunks_between_decode_steps():
    """With another sequence decoding, a 100-token prompt is evaluated 16 tokens per step (the first
    chunk at admission), the running stream getting a token every step meanwhile; it then decodes
    as if alone. With nothing else running, a prompt is evaluated whole at admission."""
    a, be = cuda_adapter(2, n_ctx=512, max_batch=4)
    a.chunk = 16
    s = make(a)
    lone = chat_job(1, list(range(1, 101)), 3)
    run(s, lone)
    assert [c[1] for c in be.chunks if c[0] == lone.slot and c[2] != "start"] == [100]
    runner, late = chat_job(2, [7, 8, 9], 60), chat_job(3, list(range(300, 400)), 10)
    s.submit(runner)
    for _ in range(3):
        s._pump()
    s.submit(late)
    seen = []
    for _ in range(10):
        s._pump()
        seen.append(len(runner.ids))
    parts = [c for c in be.chunks if c[0] == late.slot and c[2] != "start"]
    assert [n for _, n, _ in parts] == [16] * 6 + [4]  # (none at admission: the next step takes the first)
    assert all(b[2] > a_[2] for a_, b in zip(parts, parts[1:])), "two chunks without a decode step between"
    assert seen == sorted(seen) and seen[-1] - seen[0] >= 8  # the running stream kept going
    doc, short = chat_job(4, list(range(600, 700)), 5), chat_job(5, [1, 2, 3, 4], 5)
    s.submit(doc)
    s._pump()
    s.submit(short)
    s._pump()  # the short prompt is evaluated at admission, not behind the document's chunks
    assert [c[1] for c in be.chunks if c[0] == short.slot and c[2] != "start"] == [4]
    assert doc.slot in a._filling and short.slot not in a._filling
    run(s)
    for j, uid, n in ((late, 3, 10), (runner, 2, 60), (doc, 4, 5), (short, 5, 5)):
        assert "".join(j.emit.text) == expected(uid, n)
    assert be.kv.free_pages() == be.kv.n_pages


def test_a_prompt_cancelled_or_failing_mid_evaluation_ends_alone():
    """A request cancelled while its prompt is evaluated in chunks frees its slot (the pages its
    chunks wrote stay findable: the same prompt again evaluates only the rest); one whose later
    chunk fails gets that error, and the running stream is untouched by either."""
    a, be = cuda_adapter(2, n_ctx=512, max_batch=4)
    a.chunk = 16
    s = make(a)
    runner = chat_job(1, [5, 6], 80)
    s.submit(runner)
    s._pump()
    doc = list(range(500, 600))
    gone = chat_job(2, doc, 5)
    s.submit(gone)
    for _ in range(4):
        s._pump()
    written = sum(n for slot, n, at in be.chunks if slot == gone.slot and at != "start")
    s.cancel(gone)
    s._pump()
    assert gone.state == "cancelled" and gone.slot not in s.active and written == 4 * 16
    again = chat_job(3, doc, 5)
    s.submit(again)
    s._pump()
    assert be.evaluated[-1] == (100, 100 - written)  # the chunks it wrote were kept
    real = be.seq_prefill
    be.seq_prefill = lambda slot, toks: (_ for _ in ()).throw(RuntimeError("device fault")) \
        if slot == again.slot else real(slot, toks)
    s._pump()
    be.seq_prefill = real
    assert again.state == "failed" and isinstance(again.emit.error, RuntimeError)
    run(s)
    assert "".join(runner.emit.text) == expected(1, 80) and be.kv.free_pages() == be.kv.n_pages


class BurstAdapter(FakeAdapter):
    """Three tokens per slot a step (as the launch-ahead loop returns them), each with a logprobs
    entry (token, -token, ()) for the slots admitted with logprobs."""

    def __init__(self) -> None:
        super().__init__()
        self.logprobs: dict[int, list] = {}

    def add(self, slot, prompt, params, max_new, logprobs=-1):
        if logprobs >= 0:
            self.logprobs[slot] = []
        return super().add(slot, prompt, params, max_new)

    def step(self):
        out = {}
        for _ in range(3):
            for slot, toks in super().step().items():
                out.setdefault(slot, []).extend(toks)
        for slot in self.logprobs:
            self.logprobs[slot] = [(t, -float(t), ()) for t in out.get(slot, [])]
        return out

    def release(self, slot):
        self.logprobs.pop(slot, None)
        super().release(slot)


@pytest.mark.parametrize("uid,max_new,stop,reason", [(7, 7, False, "length"), (4007, 50, False, "stop"),
                                                     (11, 20, True, "stop")])
def test_logprobs_follow_the_tokens_kept(uid, max_new, stop, reason):
    """A job with logprobs gets one entry per token of job.ids, in order, through "logprobs" events
    sent before each step's text, however the step's tokens end: the budget (7 of 9 returned), an
    end-of-generation token, a stop string. A job without logprobs beside it gets none."""
    s = make(BurstAdapter())
    j = job(uid, max_new=max_new, stop=[expected(uid, 20)[5:8]] if stop else ())
    other = job(uid + 1, max_new=max_new)
    j.logprobs = 0
    run(s, j, other)
    assert j.reason == reason and j.ids
    assert [e[0] for e in j.logprobs_seen] == j.ids
    assert [e for batch in j.emit.logprobs for e in batch] == j.logprobs_seen
    assert len(j.emit.logprobs) == -(-len(j.ids) // 3)  # one event per step
    assert other.logprobs_seen == [] and other.emit.logprobs == []


def test_cuda_adapter_refuses_logprobs_where_the_backend_has_none():
    """A backend without the logprobs kernels: a request with logprobs fails alone, saying so; one
    without keeps going."""
    a, be = cuda_adapter(depth=2)
    s = make(a)
    j, ok = job(5, max_new=4), job(6, max_new=4)
    j.logprobs = 2
    run(s, j, ok)
    assert isinstance(j.emit.error, BackendError) and "logprobs" in str(j.emit.error)
    assert ok.reason == "length" and len(ok.ids) == 4


class _RingRow(list):
    """A row of the fake token ring that also fills the logprobs ring's row, as the kernels around
    the GPU sampler do: (the token written, a serial number of the write)."""

    def __init__(self, be, n: int) -> None:
        super().__init__([None] * be.max_batch)
        self.be, self.n = be, n

    def __setitem__(self, slot, tok) -> None:
        super().__setitem__(slot, tok)
        self.be.writes += 1
        self.be.lp[self.n][slot] = (tok, self.be.writes)


class LogprobsFakeBackend(PackingFakeBackend):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.writes, self.asked = 0, {}
        self.lp = [[None] * self.max_batch for _ in range(64)]
        self.ring = [_RingRow(self, n) for n in range(64)]

    def seq_logprobs(self, slot, k):
        self.asked[slot] = k

    def seq_logprobs_entry(self, slot, i, tok):
        written, serial = self.lp[i % 64][slot]
        return tok, -float(serial), ((written, 0.0),)


@pytest.mark.parametrize("depth", [1, 3])
def test_cuda_adapter_reads_logprobs_beside_each_token(depth):
    """Jobs with logprobs among jobs without, steps in flight, a cancel and a slot reused: each kept
    token's entry is read from the ring row its token came from (the token the fake wrote there is
    the token returned), in the order written, one entry per token of job.ids; the others get none."""
    be = LogprobsFakeBackend(max_batch=4)
    rng = random.Random(depth)
    a = CudaAdapter(SimpleNamespace(backend=be, tokenizer=FAKE_TOK), depth=depth,
                    new_event=lambda: FakeEvent(be.stream, rng))
    s = make(a)
    jobs = [job(u, 12 + u % 5) for u in range(1, 9)]
    for j in jobs[::2]:
        j.logprobs = 3
    victim = job(99, 200)
    victim.logprobs = 1
    s.submit(victim)
    for j in jobs[:3]:
        s.submit(j)
    for _ in range(3):
        s._pump()
    s.cancel(victim)
    run(s, *jobs[3:])
    for j in jobs:
        assert j.state == "done" and "".join(j.emit.text) == expected(j.params.seed, j.max_new)
        if j.logprobs < 0:
            assert j.logprobs_seen == [] and j.emit.logprobs == []
            continue
        assert [e[0] for e in j.logprobs_seen] == j.ids
        assert all(e[2][0][0] == e[0] for e in j.logprobs_seen)  # the same ring row as the token
        serials = [-e[1] for e in j.logprobs_seen]
        assert serials == sorted(serials)
    assert set(be.asked) <= set(range(4)) and a.logprobs == {}


def test_cuda_adapter_clamps_top_k():
    a, be = cuda_adapter(depth=2)
    p = a._params(SamplingParams(top_k=0))
    assert p.top_k == 1024 and a._params(SamplingParams(temperature=0, top_k=0)).top_k == 0


def test_a_request_whose_tokens_fail_fails_alone():
    """An exception while turning one request's tokens into text (a token id its vocabulary lacks,
    say) fails that request; the others and later ones are served."""
    a = FakeAdapter(slots=2)
    s = make(a)
    bad, good = job(1, 6), job(2, 6)
    broken = SimpleNamespace(push=lambda tok: (_ for _ in ()).throw(ValueError("token 99999 out of range")),
                             flush=lambda: "")
    run(s, good)
    s.submit(bad)
    s.submit(good2 := job(3, 6))
    s._pump()
    s._state[bad] = (broken, s._state[bad][1])
    for _ in range(20):
        s._pump()
    assert isinstance(bad.emit.error, ValueError) and bad.state == "failed"
    assert good.reason == "length" and good2.reason == "length" and "".join(good2.emit.text) == expected(3, 6)
    assert a.seqs == {}


def test_a_dying_loop_calls_on_fatal():
    """A bug in the loop itself (not in one request) ends the scheduler through on_fatal (the server
    exits), failing what waited, instead of leaving a thread-less server that looks alive."""
    died = threading.Event()
    seen = []
    adapter = FakeAdapter(slots=1)
    s = Scheduler(lambda: adapter, on_fatal=lambda e: (seen.append(e), died.set()))
    s.start()
    s._admit = lambda: (_ for _ in ()).throw(RuntimeError("bug in the loop"))
    j = job(1, 5)
    s.submit(j)
    assert died.wait(5)
    assert isinstance(seen[0], RuntimeError) and isinstance(j.emit.error, ShuttingDown)
    with pytest.raises(ShuttingDown):
        s.submit(job(2))


class CountingConstraint:
    """A stand-in grammar whose mask records how many tokens it had consumed when it was written."""

    def __init__(self, tok, n_vocab, grammar) -> None:
        self.n, self.grammar = 0, grammar

    def advance(self, tok) -> None:
        if self.grammar == "refuse" and self.n == 2:
            raise ValueError("the grammar engine refused token 7")
        self.n += 1

    def fill(self, words) -> None:
        words[0] = self.n


class MaskFakeBackend(PackingFakeBackend):
    """... with seq_constrain: each time the 'device' samples a constrained slot's token n it notes
    the mask row's content then (the copy a real step makes as it runs)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.rows: dict = {}
        self.used: list[tuple[int, int, int]] = []  # (slot, token index, mask's consumed count)

    grammar_masks = True

    def seq_constrain(self, slot):
        import numpy as np
        self.rows[slot] = np.zeros(4, np.uint32)
        return self.rows[slot]

    def _note(self, slots, first=False):
        def op():
            for s in slots:
                if s in self.rows and (first or self.dev[s] is not None):
                    self.used.append((s, 0 if first else self.dev[s]["n"], int(self.rows[s][0])))
        self.stream.ops.append(op)

    def seq_first(self, slot, prompt, params, seed, publish=False):
        self._note([slot], first=True)
        super().seq_first(slot, prompt, params, seed, publish)

    def batch_step(self, n_slots):
        self._note(list(range(n_slots)))
        super().batch_step(n_slots)

    def seq_release(self, slot, tokens=()):
        self.rows.pop(slot, None)
        super().seq_release(slot, tokens)


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_cuda_adapter_grammar_masks_follow_each_token(depth):
    """Constrained jobs among free ones, steps launched ahead where nothing is constrained: every
    token of a constrained slot is sampled under the mask written after all its earlier tokens were
    consumed (token n under a grammar that consumed n), the first one under the fresh grammar's;
    every job's text is the script's; a grammar that refuses a token fails its job alone."""
    be = MaskFakeBackend(max_batch=4)
    rng = random.Random(depth)
    a = CudaAdapter(SimpleNamespace(backend=be, tokenizer=FAKE_TOK, cfg=SimpleNamespace(n_vocab=100)), depth=depth,
                    new_event=lambda: FakeEvent(be.stream, rng))
    a.new_constraint = CountingConstraint
    s = make(a)
    jobs = [job(u, 10 + u % 4) for u in range(1, 10)]
    for j in jobs[1::3]:
        j.grammar = "g"
    bad = job(50, 12)
    bad.grammar = "refuse"
    for j in jobs[:4]:
        s.submit(j)
    for _ in range(2):
        s._pump()
    run(s, bad, *jobs[4:])
    for j in jobs:
        assert j.state == "done" and "".join(j.emit.text) == expected(j.params.seed, j.max_new), j.params.seed
    assert bad.state == "failed" and "refused" in str(bad.emit.error)
    assert len(be.used) > 20 and all(n == consumed for _, n, consumed in be.used), be.used[:10]
    assert be.kv.free_pages() == be.kv.n_pages and a._constraints == {}


# ---- speculative decoding in the CUDA adapter (server/speculation.py) -------------------------------


class SpecFakeBackend(PackingFakeBackend):
    """... with verify_many / seq_commit: each verification row's argmax is the script's next token
    (the scripted model's tokens repeat every 26, so n-gram lookup proposes them); the rows' K/V
    are written stale and only the kept rows' set right at the commit, so a later read of a
    rejected row's K/V fails FakeKV's checks."""

    slot_speculation = True

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.verifies: list[tuple[int, int, int]] = []  # (slot, rows, decoding slots)

    verify_rows = 8

    def verify_many(self, parts):
        assert sum(len(t) for _, t in parts) <= self.verify_rows
        while self.stream.ops:  # (the real one waits for its stream)
            self.stream.run_one()
        out = []
        for slot, tokens in parts:
            d = self.dev[slot]
            assert d["last"] == tokens[0], "a verification starts from the slot's last sampled token"
            self.verifies.append((slot, len(tokens), len(parts)))
            for i in range(len(tokens)):
                assert d["pos"] + i < d["cap"], "a verification wrote past the slot's KV pages"
                self.kv.write(d["table"], d["pos"] + i, ("stale", i))
            out.append([script(d["uid"], d["n"] + i) for i in range(len(tokens))])
        return out

    def seq_commit(self, slot, tokens):
        d = self.dev[slot]
        tokens = list(tokens)

        def op():
            new = identities([d["last"]] + tokens[:-1], d["idents"])  # the rows kept: their K/V made right
            for j, ident in enumerate(new):
                self.kv.write(d["table"], d["pos"] + j, ident)
            d["idents"] += new
            d["pos"] += len(new)
            for t in tokens:
                self.ring[d["n"] % 64][slot] = t
                d["n"] += 1
            d["last"] = tokens[-1]

        self.stream.ops.append(op)


def spec_adapter(depth: int = 2, seqs: int | None = None, **kw):
    be = SpecFakeBackend(**kw)
    if seqs is not None:  # (else the adapter's default of the tuning table's serve_spec_seqs)
        be.tune = SimpleNamespace(serve_spec_seqs=seqs)
    rng = random.Random(depth)
    eng = SimpleNamespace(backend=be, tokenizer=FAKE_TOK)
    return CudaAdapter(eng, depth=depth, new_event=lambda: FakeEvent(be.stream, rng), spec="ngram"), be


def greedy_job(uid: int, max_new: int, prompt_len: int = 3) -> Job:
    return Job(list(range(1, prompt_len + 1)), SamplingParams(temperature=0.0, seed=uid), max_new, Events())


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_speculation_alone_keeps_the_text_and_verifies(depth):
    """A greedy request decoding alone: once its output repeats, proposals are verified several a
    step; the text is the script's, the budget holds, the pages come back."""
    a, be = spec_adapter(depth)
    s = make(a)
    j = greedy_job(5, 150)
    run(s, j, steps=5000)
    assert j.state == "done" and "".join(j.emit.text) == expected(5, 150)
    assert be.verifies and a.spec.stats["accepted"] > 60, a.spec.stats
    assert max(r for _, r, _ in be.verifies) > 2
    assert be.kv.free_pages() == be.kv.n_pages and a.loop._seqs == {}


def test_speculation_pauses_beside_a_sampled_request():
    """A greedy and a sampled request at once: no verification while both decode; the texts are
    the script's. After the sampled one ends, the greedy one speculates alone."""
    a, be = spec_adapter(2)
    s = make(a)
    g, other = greedy_job(7, 120), job(8, 60)  # (job: sampled)
    run(s, g, other, steps=5000)
    assert "".join(g.emit.text) == expected(7, 120) and "".join(other.emit.text) == expected(8, 60)
    assert be.verifies and all(n == 1 for _, _, n in be.verifies), be.verifies
    assert 0 not in a.spec.slots and 1 not in a.spec.slots


@pytest.mark.parametrize("n,depth,seqs", [(2, 2, None), (4, 2, None), (4, 1, 4), (4, 3, 4), (5, 2, 4)])
def test_speculation_of_a_few_greedy_requests_together(n, depth, seqs):
    """n greedy requests: up to serve_spec_seqs (2 by default; 4, the most 8 rows allow) verified
    together (rows shared: 4 each for two, 2 each for four); more decode plainly until enough have
    ended. Every text is the script's, the pages come back."""
    a, be = spec_adapter(depth, seqs)
    s = make(a)
    jobs = [greedy_job(10 + u, 90 + 7 * u, prompt_len=3 + u) for u in range(n)]
    run(s, *jobs, steps=20000)
    for u, j in enumerate(jobs):
        assert j.state == "done" and "".join(j.emit.text) == expected(10 + u, 90 + 7 * u), u
    together = [m for _, _, m in be.verifies]
    assert max(together) == min(n, seqs or 2) and a.spec.stats["accepted"] > 10, (a.spec.stats, together)
    assert all(r <= 8 // m for _, r, m in be.verifies)
    assert be.kv.free_pages() == be.kv.n_pages and a.loop._seqs == {}


def test_speculation_stop_token_and_short_budget():
    """A stop token inside kept proposals ends the request there; a budget shorter than the
    proposals caps them."""
    a, be = spec_adapter(2)
    s = make(a)
    j = greedy_job(80 * 1000 + 3, 200)  # the script's EOG at token 80
    run(s, j, steps=5000)
    assert j.reason == "stop" and "".join(j.emit.text) == expected(80 * 1000 + 3, 200)
    k = greedy_job(4, 31)
    run(s, k, steps=5000)
    assert k.reason == "length" and "".join(k.emit.text) == expected(4, 31)
    assert be.kv.free_pages() == be.kv.n_pages


def test_speculation_refused_where_the_backend_cannot_verify_slots():
    """A backend without slot verification or another mode: one line."""
    from gguf_runtime.errors import BackendError
    be = PackingFakeBackend()
    eng = SimpleNamespace(backend=be, tokenizer=FAKE_TOK)
    with pytest.raises(BackendError, match="--spec ngram is not served by this backend"):
        CudaAdapter(eng, spec="ngram")
    with pytest.raises(BackendError, match="not served yet"):
        CudaAdapter(eng, spec="draft")



def test_speculating_request_cancelled_then_its_slot_reused():
    """A speculating request cancelled mid-answer (between a verification and the steps after it):
    its slot and pages are free at once; the next request in that slot speculates from its own
    prompt and gives the script's text."""
    a, be = spec_adapter(2, max_batch=2)
    s = make(a)
    j = greedy_job(21, 200)
    s.submit(j)
    for _ in range(400):
        s._pump()
        if a.spec.stats["steps"] >= 3:
            break
    assert a.spec.stats["steps"] >= 3 and j.state == "active"
    s.cancel(j)
    k = greedy_job(22, 120, prompt_len=5)
    run(s, k, steps=5000)
    assert j.state == "cancelled" and "".join(k.emit.text) == expected(22, 120)
    assert a.spec.slots == {} and be.kv.free_pages() == be.kv.n_pages


def test_speculation_run_ends_when_a_copied_passage_begins(monkeypatch):
    """Proposals that fail twice start a plain run; once the answer copies a passage of the prompt,
    the lookup's guesses of the next token come right and end the run, so the passage is verified,
    not decoded plainly (without that rule the run lasts PLAIN_RUN tokens)."""
    import sys
    me = sys.modules[__name__]
    passage = list(range(200, 240))
    prompt = list(range(1, 13)) + [99] + passage + [5]
    # tokens the prompt holds in another order (the lookup proposes, wrongly), then the passage
    answer = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4] + passage + [60 + i for i in range(30)]
    plain_script = me.script
    monkeypatch.setattr(me, "script", lambda uid, i: answer[i] if uid == 77 else plain_script(uid, i))
    a, be = spec_adapter(2)
    s = make(a)
    j = Job(list(prompt), SamplingParams(temperature=0.0, seed=77), len(answer), Events())
    run(s, j, steps=5000)
    assert "".join(j.emit.text) == "".join(chr(ord("a") + (t - 1) % 26) for t in answer)
    assert a.spec.stats["accepted"] >= 30, a.spec.stats
