"""Embeddings, server side (CPU): the scheduler lending a free slot to an embedding between steps
(the CUDA adapter's way, on a scripted adapter), /api/embed, /api/embeddings and /v1/embeddings
through the official ``ollama`` and ``openai`` clients (float and base64) against the engine's own
vectors, bad requests, an embedding between a running generation's steps, and ``gguf-run embed``."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from gguf_runtime.engine import embed as E
from gguf_runtime.engine.engine import Engine
from gguf_runtime.errors import ContextOverflowError
from gguf_runtime.sampling import SamplingParams
from gguf_runtime.server.adapters import NoRoom
from gguf_runtime.server.scheduler import EmbedJob, Job, Scheduler

from test_embed import CTX, TEXTS, pooled  # noqa: F401  (pooled: the module's fixture, shared)
from test_scheduler import Events, FakeAdapter


# ---- the scheduler lends a free slot (the CUDA adapter's way) ---------------------------------
class SlotAdapter(FakeAdapter):
    """A FakeAdapter whose embeddings need a free slot, as the CUDA adapter's do."""

    embed_slot = True

    def __init__(self, slots: int = 1, pages: int | None = None) -> None:
        super().__init__(slots)
        self.pages = pages  # tokens an embedding may hold (None: any)

    def embed(self, slot, ids):
        assert 0 <= slot < self.max_slots and slot not in self.seqs
        if self.pages is not None and len(ids) > self.pages:
            raise NoRoom
        self.log.append(("embed", slot, len(ids)))
        return np.full(3, float(len(ids)), np.float32)


def _pump(s: Scheduler, until, steps: int = 500) -> None:
    for _ in range(steps):
        s._pump()
        if until():
            return
    raise AssertionError("not reached")


def test_embeddings_wait_for_a_free_slot_and_give_it_back():
    ad = SlotAdapter(slots=1)
    s = Scheduler(lambda: ad)
    s._setup()
    gen = Job([1, 2, 3], SamplingParams(seed=1), 6, Events())
    s.submit(gen)
    _pump(s, lambda: gen.state == "active")
    ev = Events()
    emb = EmbedJob([[1] * 4, [1] * 9], ev)
    s.submit(emb)
    s._pump()
    assert emb.state == "waiting" and not any(e[0] == "embed" for e in ad.log)  # the one slot generates
    _pump(s, lambda: emb.state == "done")
    assert gen.state == "done" and len(gen.ids) == 6
    assert [e for e in ad.log if e[0] == "embed"] == [("embed", 0, 4), ("embed", 0, 9)]
    assert ev.done is emb and [v[0] for v in emb.vectors] == [4.0, 9.0] and emb.tokens == 13
    assert s._free == [0] and s._pending == 0


def test_embeddings_are_not_starved_by_waiting_generations():
    """One slot, generations queued behind the running one: the embedding takes the slot in the gap
    (only for its call) before the next generation is admitted."""
    ad = SlotAdapter(slots=1)
    s = Scheduler(lambda: ad)
    s._setup()
    gens = [Job([1, 2, 3], SamplingParams(seed=i), 6, Events()) for i in (1, 2, 3)]
    for g in gens:
        s.submit(g)
    _pump(s, lambda: gens[0].state == "active")
    emb = EmbedJob([[1] * 4], Events())
    s.submit(emb)
    _pump(s, lambda: emb.state == "done")
    assert gens[0].state == "done" and gens[1].state in ("waiting", "active") and gens[2].state == "waiting"
    kinds = [e[0] for e in ad.log]
    assert kinds.index("embed") < [i for i, k in enumerate(kinds) if k == "add"][1]
    _pump(s, lambda: gens[2].state == "done")


def test_embeddings_run_between_steps_in_a_spare_slot():
    ad = SlotAdapter(slots=2)
    s = Scheduler(lambda: ad, admit_tokens=8)
    s._setup()
    gen = Job([1, 2, 3], SamplingParams(seed=1), 12, Events())
    s.submit(gen)
    _pump(s, lambda: gen.state == "active")
    emb = EmbedJob([[1] * 5] * 4, Events())
    s.submit(emb)
    _pump(s, lambda: emb.state == "done")
    assert gen.state == "active"  # the generation still runs
    kinds = [e[0] for e in ad.log]
    first, last = kinds.index("embed"), len(kinds) - 1 - kinds[::-1].index("embed")
    assert "step" in kinds[first:last]  # admit_tokens per round: steps between the inputs
    assert {e[1] for e in ad.log if e[0] == "embed"} == {1}
    _pump(s, lambda: gen.state == "done")
    assert sorted(s._free) == [0, 1]


def test_an_embedding_the_cache_cannot_hold_fails_when_idle():
    ad = SlotAdapter(slots=1, pages=4)
    s = Scheduler(lambda: ad)
    s._setup()
    ev = Events()
    emb = EmbedJob([[1] * 3, [1] * 9], ev)
    s.submit(emb)
    _pump(s, lambda: emb.state == "failed")
    assert isinstance(ev.error, ContextOverflowError) and s._free == [0] and s._pending == 0


def test_a_cancelled_embedding_is_dropped():
    ad = SlotAdapter(slots=1)
    s = Scheduler(lambda: ad)
    s._setup()
    gen = Job([1, 2, 3], SamplingParams(seed=1), 50, Events())
    s.submit(gen)
    _pump(s, lambda: gen.state == "active")
    ev = Events()
    emb = EmbedJob([[1] * 3], ev)
    s.submit(emb)
    s._pump()
    s.cancel(emb)
    s._pump()
    assert emb.state == "cancelled" and not s.embeds and ev.done is None and ev.error is None


# ---- the server ---------------------------------------------------------------------------------
httpx = pytest.importorskip("httpx")
ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from gguf_runtime.server.adapters import make_adapter  # noqa: E402
from gguf_runtime.server.app import Service, build_app  # noqa: E402
from live_server import live  # noqa: E402

NAME = "micro"


@pytest.fixture(scope="module")
def server(pooled):
    svc = Service(lambda: make_adapter(Engine(pooled[None], backend="numpy", n_ctx=CTX)), name=NAME).start()
    with live(svc) as url:
        yield url, svc


@pytest.fixture(scope="module")
def url(server):
    return server[0]


@pytest.fixture(scope="module")
def ref(pooled):
    """The engine's own answers on the same file."""
    return Engine(pooled[None], backend="numpy", n_ctx=CTX)


def test_ollama_embed(url, ref):
    c = ollama.Client(host=url)
    r = c.embed(model=NAME, input=TEXTS)
    want = ref.embed(TEXTS)
    assert r.model == NAME + ":latest"
    np.testing.assert_allclose(np.array(r.embeddings), want.vectors, rtol=0, atol=1e-6)
    assert r.prompt_eval_count == sum(want.tokens)
    assert r.total_duration >= r.load_duration >= 0
    one = c.embed(model=NAME, input=TEXTS[1], dimensions=8)
    np.testing.assert_allclose(np.array(one.embeddings), ref.embed(TEXTS[1:], dimensions=8).vectors, atol=1e-6)
    assert c.embed(model=NAME, input=[]).embeddings == []  # Ollama: no input loads the model
    raw = httpx.post(url + "/api/embed", json={"model": NAME, "input": ""}).json()
    assert raw == {"model": NAME + ":latest", "embeddings": []}


def test_ollama_embed_truncate_and_num_ctx(url, ref):
    long = " ".join(f"word{i}" for i in range(400))
    r = httpx.post(url + "/api/embed", json={"model": NAME, "input": [long, "hi"]})
    assert r.status_code == 200, r.text
    n = len(ref.tokenizer.encode(long, add_special=True, parse_special=True))
    assert n > CTX
    assert r.json()["prompt_eval_count"] == CTX + len(ref.tokenizer.encode("hi", add_special=True))
    r = httpx.post(url + "/api/embed", json={"model": NAME, "input": [long], "truncate": False})
    assert r.status_code == 400 and "input" in r.json()["error"] and "context" in r.json()["error"]
    r = httpx.post(url + "/api/embed", json={"model": NAME, "input": long, "options": {"num_ctx": 16}})
    assert r.status_code == 200 and r.json()["prompt_eval_count"] == 16
    ids = ref.tokenizer.encode(long, add_special=True, parse_special=True)[:16]
    h = ref.backend.hidden(ids)[-1]
    np.testing.assert_allclose(r.json()["embeddings"][0], h / np.linalg.norm(h), rtol=0, atol=1e-6)


def test_ollama_legacy_embeddings(url, ref):
    c = ollama.Client(host=url)
    r = c.embeddings(model=NAME, prompt=TEXTS[0])
    np.testing.assert_allclose(r.embedding, ref.embed(TEXTS[:1]).vectors[0], rtol=0, atol=1e-6)
    assert httpx.post(url + "/api/embeddings", json={"model": NAME, "prompt": ""}).json() == {"embedding": []}
    r = httpx.post(url + "/api/embeddings", json={"model": NAME, "prompt": "word " * 600})
    assert r.status_code == 400 and "context" in r.json()["error"]


def test_openai_embeddings(url, ref):
    c = openai.OpenAI(base_url=url + "/v1", api_key="x")
    want = ref.embed(TEXTS)
    r = c.embeddings.create(model=NAME, input=TEXTS)  # the client asks for base64 and decodes it
    assert r.object == "list" and r.model == NAME + ":latest"
    assert [d.index for d in r.data] == [0, 1] and all(d.object == "embedding" for d in r.data)
    np.testing.assert_allclose(np.array([d.embedding for d in r.data]), want.vectors, rtol=0, atol=1e-6)
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(want.tokens)
    f = c.embeddings.create(model=NAME, input=TEXTS[0], encoding_format="float", dimensions=16)
    np.testing.assert_allclose(f.data[0].embedding, ref.embed(TEXTS[:1], dimensions=16).vectors[0], atol=1e-6)
    # base64 as sent: little-endian float32, the same numbers as the float form
    raw = httpx.post(url + "/v1/embeddings", json={"model": NAME, "input": TEXTS, "encoding_format": "base64"}).json()
    got = np.array([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in raw["data"]])
    assert got.shape == (2, 64)
    np.testing.assert_allclose(got, want.vectors, rtol=0, atol=1e-6)
    # token ids, one list and several: used as they are
    ids = ref.tokenizer.encode(TEXTS[0], add_special=True)
    t = c.embeddings.create(model=NAME, input=ids, encoding_format="float")
    np.testing.assert_allclose(t.data[0].embedding, want.vectors[0], atol=1e-6)
    assert t.usage.prompt_tokens == len(ids)
    t = c.embeddings.create(model=NAME, input=[ids, ids[:3]], encoding_format="float")
    h = ref.backend.hidden(ids[:3])[-1]
    np.testing.assert_allclose(t.data[1].embedding, h / np.linalg.norm(h), atol=1e-6)
    assert t.usage.prompt_tokens == len(ids) + 3


BAD = [
    ("/api/embed", {"input": 5}, "input"),
    ("/api/embed", {"input": ["a", 5]}, "input"),
    ("/api/embed", {"input": ["a", ""]}, "input[1]"),
    ("/api/embed", {"input": "a", "truncate": "no"}, "truncate"),
    ("/api/embed", {"input": "a", "dimensions": 0}, "dimensions"),
    ("/api/embed", {"input": "a", "dimensions": 65}, "dimensions"),
    ("/api/embed", {"input": "a", "dimensions": "8"}, "dimensions"),
    ("/api/embed", {"input": "a", "options": {"num_ctx": 0}}, "num_ctx"),
    ("/api/embed", {"input": "a", "options": []}, "options"),
    ("/api/embed", {"input": ["a"] * 2049}, "input"),
    ("/api/embed", {"input": "a", "model": ""}, "model"),
    ("/api/embeddings", {"prompt": ["a"]}, "prompt"),
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {}, "input"),
    ("/v1/embeddings", {"input": [[]]}, "input[0]"),
    ("/v1/embeddings", {"input": ["a", [1, 2]]}, "input"),
    ("/v1/embeddings", {"input": [1, 32000]}, "token ids"),
    ("/v1/embeddings", {"input": [-1]}, "token ids"),
    ("/v1/embeddings", {"input": [1.5]}, "input"),
    ("/v1/embeddings", {"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": "a", "dimensions": -3}, "dimensions"),
    ("/v1/embeddings", {"input": "a", "dimensions": 1.5}, "dimensions"),
]


@pytest.mark.parametrize("route,body,word", BAD, ids=[f"{r}-{w}-{i}" for i, (r, _, w) in enumerate(BAD)])
def test_bad_requests_are_400s_naming_the_field(url, route, body, word):
    r = httpx.post(url + route, json={"model": NAME, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    msg = err["message"] if route.startswith("/v1/") else err
    assert word in msg and "Traceback" not in msg


def test_unknown_model_is_a_404(url):
    for route, body in (("/api/embed", {"input": "a"}), ("/api/embeddings", {"prompt": "a"}),
                        ("/v1/embeddings", {"input": "a"})):
        assert httpx.post(url + route, json={"model": "nope", **body}).status_code == 404


def test_show_lists_embedding_for_a_file_with_a_pooling_type(url, pooled):
    from starlette.testclient import TestClient

    assert "embedding" not in httpx.post(url + "/api/show", json={"model": NAME}).json()["capabilities"]
    svc = Service(lambda: make_adapter(Engine(pooled[1], backend="numpy", n_ctx=CTX)), name=NAME).start()
    try:
        with TestClient(build_app(svc)) as c:
            assert "embedding" in c.post("/api/show", json={"model": NAME}).json()["capabilities"]
    finally:
        svc.shutdown()


def test_a_reranker_is_a_400(pooled):
    from starlette.testclient import TestClient

    svc = Service(lambda: make_adapter(Engine(pooled[4], backend="numpy", n_ctx=CTX)), name=NAME).start()
    try:
        with TestClient(build_app(svc)) as c:
            r = c.post("/api/embed", json={"model": NAME, "input": "a"})
            assert r.status_code == 400 and "reranker" in r.json()["error"]
            r = c.post("/v1/embeddings", json={"model": NAME, "input": "a"})
            assert r.status_code == 400 and "reranker" in r.json()["error"]["message"]
    finally:
        svc.shutdown()


def test_embeddings_between_the_steps_of_a_generation(pooled, ref):
    """The numpy adapter's scheduler, in this thread: a greedy generation admitted, embeddings asked
    for while it runs; the generation's tokens and the vectors are as if each ran alone."""
    prompt = ref.encode_raw("Once upon a time")
    alone = ref.generate(prompt, n_predict=100, params=SamplingParams(temperature=0))
    alone.text()
    assert len(alone.ids) >= 30  # (no early end-of-generation: the embeddings land mid-way)
    want = ref.embed(TEXTS).vectors
    ad = make_adapter(Engine(pooled[None], backend="numpy", n_ctx=CTX))
    s = Scheduler(lambda: ad, admit_tokens=8)
    s._setup()
    gen = Job(prompt, SamplingParams(temperature=0), 100, Events())
    s.submit(gen)
    _pump(s, lambda: len(gen.ids) >= 10)
    ids = [ad.tokenizer.encode(t, add_special=True, parse_special=True) for t in TEXTS]
    emb = EmbedJob(ids, Events())
    s.submit(emb)
    _pump(s, lambda: emb.state == "done")
    assert gen.state == "active" and len(gen.ids) < len(alone.ids)
    np.testing.assert_allclose(np.array([E.finish(v) for v in emb.vectors]), want, rtol=0, atol=1e-6)
    _pump(s, lambda: gen.state == "done")
    assert gen.ids == alone.ids


# ---- the command line ----------------------------------------------------------------------------
EXE = shutil.which("gguf-run", path=os.path.dirname(sys.executable)) or "gguf-run"


def cli(*args, stdin=None):
    p = subprocess.run([EXE, *args], capture_output=True, text=True, input=stdin, timeout=300,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return p.returncode, p.stdout, p.stderr


def test_cli_embed(pooled, ref):
    path = str(pooled[None])
    rc, out, err = cli("embed", path, *TEXTS, "-q", "--backend", "numpy")
    assert rc == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    np.testing.assert_allclose(np.array(rows), ref.embed(TEXTS).vectors, rtol=0, atol=1e-6)
    rc, out, err = cli("embed", path, TEXTS[0], "-", "--json", "--dimensions", "5", "-q", "--backend", "numpy",
                       stdin=TEXTS[1])
    assert rc == 0, err
    obj = json.loads(out)
    assert obj["pooling"] == "last" and obj["prompt_eval_count"] == ref.embed(TEXTS).tokens
    np.testing.assert_allclose(np.array(obj["embeddings"]), ref.embed(TEXTS, dimensions=5).vectors, atol=1e-6)


@pytest.mark.parametrize("args,words", [
    (["", "--backend", "numpy"], ["empty"]),
    (["x", "--dimensions", "65", "--backend", "numpy"], ["dimensions", "64"]),
    (["x", "--dimensions", "0"], ["dimensions"]),
    (["word " * 400, "--no-truncate", "--backend", "numpy"], ["tokens", "context"]),
    (["-", "-"], ["standard input"]),
])
def test_cli_embed_errors_are_one_line(pooled, args, words):
    rc, out, err = cli("embed", str(pooled[None]), *args, "-q", stdin="")
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err, err
    for w in words:
        assert w.lower() in lines[0].lower(), err


def test_cli_embed_reranker_is_one_line(pooled):
    rc, out, err = cli("embed", str(pooled[4]), "x", "-q", "--backend", "numpy")
    assert rc == 2 and "reranker" in err and "Traceback" not in err
