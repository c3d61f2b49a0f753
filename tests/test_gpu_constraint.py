"""Structured output on the CUDA backend: a constrained generation samples on the host (masks from
llguidance) and gives schema-valid JSON; in the server's batch steps (CudaAdapter) constrained and
free sequences share the steps (token_mask.cu) and every constrained answer is schema-valid; the
batch steps' logprobs (logprobs.cu) equal the numpy backend's on the same file."""

import json

import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from gguf_runtime.engine.constraint import compile_grammar  # noqa: E402
from gguf_runtime.engine.engine import Engine  # noqa: E402
from gguf_runtime.sampling import SamplingParams  # noqa: E402
from gguf_runtime.server.adapters import CudaAdapter  # noqa: E402

from micro_models import Micro, write_micro  # noqa: E402
from test_constraint import SCHEMAS, check  # noqa: E402


# head size 64: the CUDA attention kernels take 64, 128 and 256
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_micro(Micro(vocab="gpt-2", n_vocab=None, seed=3, n_embd=256, n_ff=512, n_head=4, n_head_kv=2), tmp_path_factory.mktemp("m") / "micro.gguf")
    return Engine(path, backend="cuda", n_ctx=512)


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_cuda_generation_under_a_schema(engine, i):
    for seed in range(2):
        con = engine.constraint("json_schema", SCHEMAS[i])
        gen = engine.generate(engine.encode_raw("data:"), n_predict=300,
                              params=SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed),
                              constraint=con)
        text = gen.text()
        assert gen.stats.stop_reason == "stop", text
        check(json.loads(text), SCHEMAS[i])
    free = engine.generate(engine.encode_raw("data:"), n_predict=8, params=SamplingParams(temperature=0))
    assert len(free.text()) > 0  # the graph path still serves free text after host-sampled runs


@pytest.fixture(scope="module")
def batch_engine(engine):
    """The same file served with eight slots (the server's batch steps)."""
    return Engine(engine.path, backend="cuda", n_ctx=512, max_batch=8)


class _Events:
    def __init__(self) -> None:
        self.text, self.error, self.logprobs = [], None, []

    def __call__(self, kind, data) -> None:
        if kind == "text":
            self.text.append(data)
        elif kind == "logprobs":
            self.logprobs.extend(data)
        elif kind == "error":
            self.error = data


def _serve(adapter, jobs) -> None:
    from gguf_runtime.server.scheduler import Scheduler
    s = Scheduler(lambda: adapter)
    s._setup()
    for j in jobs:
        s.submit(j)
    for _ in range(20000):
        s._pump()
        if not (s.active or s.waiting) and s._inbox.empty():
            return
    raise AssertionError("the scheduler did not go idle")


def test_cuda_batch_steps_under_schemas_beside_free_text(batch_engine):
    """Eight constrained jobs (four schemas, two seeds) and four free ones in one server's batch
    steps: every constrained answer is complete, valid JSON of its schema; the free ones run."""
    from gguf_runtime.server.scheduler import Job
    engine = batch_engine
    ad = CudaAdapter(engine, capture=True)
    params = lambda seed: SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)  # noqa: E731
    prompt = engine.encode_raw("data:")
    jobs = [Job(list(prompt), params(seed), 300, _Events(), grammar=compile_grammar("json_schema", SCHEMAS[i]))
            for i in range(4) for seed in range(2)]
    free = [Job(list(prompt), params(10 + seed), 24, _Events()) for seed in range(4)]
    _serve(ad, jobs[:4] + free + jobs[4:])
    for n, j in enumerate(jobs):
        text = "".join(j.emit.text)
        assert j.state == "done" and j.reason == "stop", (n, j.state, j.emit.error, text)
        check(json.loads(text), SCHEMAS[n // 2])
    assert all(j.state == "done" and j.ids for j in free)


def test_cuda_batch_logprobs_equal_numpy(batch_engine):
    """Greedy answers with logprobs (5 alternatives) through the CUDA adapter's batch steps and the
    numpy adapter on the same micro file: up to the first token where the two greedy answers part (a
    near tie of float32 against float64 sums) and at it, the same distribution: log-probabilities
    within 2e-3, the same alternatives but where numpy's are within 2e-3 of each other; most tokens agree."""
    from gguf_runtime.server.adapters import NumpyAdapter
    from gguf_runtime.server.scheduler import Job
    engine = batch_engine
    ref = Engine(engine.path, backend="numpy", n_ctx=512)
    prompts = [engine.encode_raw(t) for t in ("data:", "the quick brown", "1 2 3")]

    def answers(ad):
        jobs = [Job(list(p), SamplingParams(temperature=0, seed=0), 16, _Events(), logprobs=5) for p in prompts]
        _serve(ad, jobs)
        return jobs

    got, want = answers(CudaAdapter(engine, capture=True)), answers(NumpyAdapter(ref))
    agree = 0
    for g, w in zip(got, want):
        assert len(g.logprobs_seen) == len(g.ids) and len(w.logprobs_seen) == len(w.ids)
        n = next((i for i, (a, b) in enumerate(zip(g.ids, w.ids)) if a != b), min(len(g.ids), len(w.ids)))
        agree += n
        for i, (eg, ew) in enumerate(zip(g.logprobs_seen[:n + 1], w.logprobs_seen[:n + 1])):
            assert eg[0] == g.ids[i] and ew[0] == w.ids[i]
            assert len(eg[2]) == len(ew[2]) == 5
            if i < n:
                assert abs(eg[1] - ew[1]) < 2e-3, (i, eg, ew)
            theirs = dict(ew[2])
            for (ig, vg), (iw, vw) in zip(eg[2], ew[2]):
                assert abs(vg - vw) < 2e-3, (i, eg, ew)
                # another id at this place: a near tie in numpy's own values (or past its last one)
                assert ig == iw or abs(theirs.get(ig, ew[2][-1][1]) - vw) < 2e-3, (i, eg, ew)
    assert agree >= 24, agree  # of 48


def test_cuda_spec_ngram_same_greedy_text(engine):
    """Prompt-lookup speculation on the CUDA backend (verification: graphed small chunks with every
    row's logits, argmax on the device): the same greedy text as the plain decode loop."""
    prompt = engine.encode_raw("one two three four five " * 6)
    greedy = SamplingParams(temperature=0)
    plain = engine.generate(prompt, n_predict=48, params=greedy)
    plain_text = plain.text()
    spec = engine.generate(prompt, n_predict=48, params=greedy, spec="ngram", spec_k=4)
    assert spec.text() == plain_text and spec.stats.spec_steps > 0


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=5)],
                         ids=["greedy", "sampled"])
def test_cuda_decode_from_a_given_token(engine, params):
    """sample_loop(given=t), decoding from a token the host holds (speculative decoding's fall-back):
    t is committed, not sampled, and the tokens after it are the plain loop's after t, from the
    prompt and from the middle of the answer (the same decode graph, the same draws)."""
    from gguf_runtime.engine.decode_loop import sample_loop
    be = engine.backend
    prompt = engine.encode_raw("one two three four five " * 3)

    def plain():
        be.truncate(0)
        be.prefill(prompt)
        return list(sample_loop(be, 40, params, list(prompt), frozenset()))
    ref = plain()
    assert ref == plain()
    be.truncate(0)
    be.prefill(prompt)
    assert list(sample_loop(be, 39, params, list(prompt), frozenset(), given=ref[0])) == ref[1:]
    if params.greedy:  # (a sampled run's draws count from its start)
        be.truncate(len(prompt) + 20)
        assert list(sample_loop(be, 19, params, list(prompt) + ref[:20], frozenset(), given=ref[20])) == ref[21:]


def test_cuda_verification_argmax_is_the_decode_steps(engine):
    """eval_argmax (speculative decoding's verification, on the one-row decode step's kernels) over a
    plain greedy answer in chunks of 1 to 8 tokens, teacher-forced: every row's argmax is the token
    the plain decode steps chose (a prompt-path verification parts from them at near ties)."""
    from gguf_runtime.engine.decode_loop import sample_loop
    be = engine.backend
    prompt = engine.encode_raw("the quick brown fox")
    be.truncate(0)
    be.prefill(prompt)
    ref = list(sample_loop(be, 48, SamplingParams(temperature=0), list(prompt), frozenset()))
    seq = prompt + ref
    for width in (1, 3, 5, 8, 8):  # (8 twice: its captured graph)
        be.truncate(len(prompt) - 1)
        pos, got = len(prompt) - 1, []
        while pos < len(seq) - 1:
            chunk = seq[pos:pos + width]
            got += [int(t) for t in be.eval_argmax(chunk)]
            pos += len(chunk)
        assert got[:len(ref)] == ref, width


def test_cuda_draft_model_same_greedy_text(engine):
    """--spec draft on the GPU: the micro model as its own draft (its own backend, cache and decode
    graphs: proposals from its launch-ahead loop) gives the plain greedy text, every proposal kept."""
    eng = Engine(engine.path, backend="cuda", n_ctx=512, draft=engine.path)
    prompt = eng.encode_raw("one two three four five")
    greedy = SamplingParams(temperature=0)
    plain = eng.generate(prompt, n_predict=40, params=greedy).text()
    for _ in range(2):  # (the second: the draft's cache and graphs reused)
        gen = eng.generate(prompt, n_predict=40, params=greedy, spec="draft", spec_k=4)
        assert gen.text() == plain
        assert gen.stats.spec_accepted == gen.stats.spec_proposed > 0


def test_cuda_server_speculation_same_greedy_text(batch_engine):
    """serve --spec ngram: a greedy request decoding alone, then two together, are verified several
    tokens a step (verify_many / seq_commit in the batch slots: both slots' rows in one step) and
    answer what the plain batch steps answer; the pages come back."""
    from gguf_runtime.server.scheduler import Job
    engine = batch_engine
    prompt = engine.encode_raw("one two three four five six seven one two three four five six seven one two")
    greedy = SamplingParams(temperature=0, seed=0)

    def answers(spec, jobs_of):
        ad = CudaAdapter(engine, capture=True, spec=spec)
        jobs = jobs_of()
        _serve(ad, jobs)
        assert all(j.state == "done" for j in jobs), [(j.state, j.emit.error) for j in jobs]
        return ad, [list(j.ids) for j in jobs]

    alone = lambda: [Job(list(prompt), greedy, 64, _Events())]  # noqa: E731
    _, want = answers("none", alone)
    ad, got = answers("ngram", alone)
    assert got == want and ad.spec.stats["steps"] > 0, ad.spec.stats
    pair = lambda: [Job(list(prompt), greedy, 64, _Events()), Job(engine.encode_raw("data:"), greedy, 40, _Events())]  # noqa: E731
    _, want2 = answers("none", pair)
    ad2, got2 = answers("ngram", pair)
    assert got2 == want2 and ad2.spec.stats["steps"] > 0, ad2.spec.stats
    assert engine.backend.kv.free_pages() == engine.backend.kv.n_pages
