"""Log-probabilities through the server (issue 35 item 4): Ollama's ``logprobs``/``top_logprobs``,
OpenAI chat's ``logprobs``/``top_logprobs`` and /v1/completions' ``logprobs: N``, streamed and
whole, with n > 1, on the numpy backend and the default model.

The values are checked against an oracle computed apart from the server: the same file's numpy
backend evaluating prompt + answer in one call, and torch's float64 log_softmax of those logits.
That catches a wrong distribution (after temperature or a grammar's mask), an entry off by one
token, and alternatives out of order."""

from __future__ import annotations

import json

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
torch = pytest.importorskip("torch")

from gguf_runtime.cli.default_model import default_model_path  # noqa: E402
from gguf_runtime.engine.engine import Engine  # noqa: E402
from gguf_runtime.server.adapters import make_adapter  # noqa: E402
from gguf_runtime.server.app import Service  # noqa: E402
from live_server import live  # noqa: E402

NAME = "smollm2"
CTX = 512
PROMPT = "The capital of France is"
# The server evaluates the prompt at once and the answer a token at a time; the oracle evaluates both
# at once: the same math in other groupings, float32 (measured difference: under 2e-5).
TOL = 1e-3


@pytest.fixture(scope="module")
def path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def url(path):
    svc = Service(lambda: make_adapter(Engine(path, backend="numpy", n_ctx=CTX)), name=NAME).start()
    with live(svc) as u:
        yield u


@pytest.fixture(scope="module")
def oracle(path):
    """(prompt ids, answer ids) -> float64 log-probabilities of each answer position over the vocabulary."""
    eng = Engine(path, backend="numpy", n_ctx=CTX)

    def logprobs(prompt: list[int], answer: list[int]) -> np.ndarray:
        eng.backend.truncate(0)
        rows = np.asarray(eng.backend.eval(list(prompt) + list(answer), all_logits=True))
        x = torch.tensor(rows[len(prompt) - 1:len(prompt) - 1 + len(answer)], dtype=torch.float64)
        return torch.log_softmax(x, dim=-1).numpy()

    return logprobs


def check_entries(entries: list[dict], ref: np.ndarray, answer: list[int], k: int, tok_text) -> None:
    """Each entry is its token's: logprob as the oracle's, k alternatives in descending order as the
    oracle's top k (ties aside), token text and bytes of the token."""
    assert len(entries) == len(answer) == ref.shape[0] > 0
    for e, row, tid in zip(entries, ref, answer):
        assert e["token"] == tok_text(tid)
        assert bytes(e["bytes"]) == tok_text(tid, raw=True)
        assert abs(e["logprob"] - row[tid]) < TOL, (e, row[tid])
        alts = e.get("top_logprobs", [])
        assert len(alts) == k
        vals = [a["logprob"] for a in alts]
        assert vals == sorted(vals, reverse=True)
        want = np.sort(row)[::-1][:k]
        np.testing.assert_allclose(vals, want, atol=TOL)
        for a in alts:  # each alternative's value is its own token's
            assert a["logprob"] <= 0


def same_entries(a: list[dict], b: list[dict]) -> None:
    """Equal tokens and alternatives, logprobs within TOL (a second request reuses the cached prompt:
    other groupings of the same math)."""
    assert [(e["token"], [t["token"] for t in e.get("top_logprobs", [])]) for e in a] == \
        [(e["token"], [t["token"] for t in e.get("top_logprobs", [])]) for e in b]
    flat = lambda es: [v for e in es for v in [e["logprob"]] + [t["logprob"] for t in e.get("top_logprobs", [])]]  # noqa: E731
    np.testing.assert_allclose(flat(a), flat(b), atol=TOL)


@pytest.fixture(scope="module")
def tok(path):
    t = Engine(path, backend="numpy", n_ctx=64).tokenizer

    def text(tid: int, raw: bool = False):
        b = t.token_to_bytes(tid)
        return b if raw else b.decode("utf-8", "replace")

    return text


def test_ollama_generate_whole_and_streamed(url, oracle, tok):
    """Sampled at temperature 1.3 with top-k 5 (the logprobs stay the model's own distribution), the
    non-streamed reply's entries equal the oracle's; streamed with the same seed, the chunks'
    entries joined are the same list, and each chunk's entries are of tokens already in its text
    or earlier."""
    body = {"model": NAME, "prompt": PROMPT, "raw": True, "stream": False, "logprobs": True, "top_logprobs": 3,
            "options": {"num_predict": 12, "temperature": 1.3, "top_k": 5, "seed": 7}}
    r = httpx.post(url + "/api/generate", json=body, timeout=120).json()
    n_ans = r["eval_count"]
    prompt, answer = r["context"][:-n_ans], r["context"][-n_ans:]
    check_entries(r["logprobs"], oracle(prompt, answer), answer, 3, tok)
    assert "".join(e["token"] for e in r["logprobs"]) == r["response"]

    lines = [json.loads(x) for x in httpx.post(url + "/api/generate", json={**body, "stream": True},
                                                timeout=120).text.splitlines()]
    same_entries([e for x in lines for e in x.get("logprobs", [])], r["logprobs"])
    assert "".join(x["response"] for x in lines) == r["response"]
    assert sum(1 for x in lines if x.get("logprobs")) > 1  # (they come with the text, not all at the end)


def test_ollama_chat_logprobs_without_alternatives(url, oracle, tok):
    """logprobs true alone: each token's logprob, no top_logprobs field (Ollama leaves it out)."""
    body = {"model": NAME, "messages": [{"role": "user", "content": "Say hi"}], "stream": False, "logprobs": True,
            "options": {"num_predict": 6, "temperature": 0}}
    r = httpx.post(url + "/api/chat", json=body, timeout=120).json()
    entries = r["logprobs"]
    assert len(entries) == r["eval_count"] and all("top_logprobs" not in e for e in entries)
    greedy = httpx.post(url + "/api/chat", json={**body, "logprobs": False}, timeout=120).json()
    assert "logprobs" not in greedy and greedy["message"] == r["message"]


def test_openai_chat_client(url, oracle, tok):
    """The official openai client: choices[0].logprobs.content, whole and streamed (the deltas'
    entries joined equal the whole answer's), and greedy tokens are their position's most likely."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    kw = dict(model=NAME, messages=[{"role": "user", "content": "Name a color."}], max_tokens=8, temperature=0,
              logprobs=True, top_logprobs=2)
    r = client.chat.completions.create(**kw)
    content = [c.model_dump() for c in r.choices[0].logprobs.content]
    assert len(content) == r.usage.completion_tokens
    for c in content:
        assert c["top_logprobs"][0]["token"] == c["token"] and c["top_logprobs"][0]["logprob"] == c["logprob"]
    assert "".join(c["token"] for c in content) == r.choices[0].message.content
    got = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            if ch.logprobs is not None and ch.logprobs.content:
                got += [c.model_dump() for c in ch.logprobs.content]
    same_entries(got, content)


def test_openai_completions(url, oracle, tok):
    """/v1/completions' logprobs: 2 (greedy): tokens, token_logprobs as the oracle's, top_logprobs
    dicts of the 2 alternatives and the chosen token, text_offset into the text; streamed: the same,
    offsets running on across chunks. With n = 2 each choice has its own. (The answer's ids: the same
    greedy answer through /api/generate, whose context returns them.)"""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    r = client.completions.create(**kw)
    lp, text = r.choices[0].logprobs, r.choices[0].text
    assert "".join(lp.tokens) == text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    g = httpx.post(url + "/api/generate", json={"model": NAME, "prompt": PROMPT, "raw": True, "stream": False,
                                                "options": {"num_predict": 8, "temperature": 0}}, timeout=120).json()
    prompt, answer = g["context"][:-g["eval_count"]], g["context"][-g["eval_count"]:]
    assert g["response"] == text and [tok(t) for t in answer] == lp.tokens
    ref = oracle(prompt, answer)
    for t, v, d, row, tid in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, ref, answer):
        assert abs(v - row[tid]) < TOL
        assert t in d and len(d) in (2, 3)
        assert sorted(d.values(), reverse=True)[:2] == pytest.approx(np.sort(row)[::-1][:2], abs=TOL)
    toks, offs = [], []
    for chunk in client.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            if ch.logprobs is not None:
                toks += ch.logprobs.tokens
                offs += ch.logprobs.text_offset
    assert toks == lp.tokens and offs == lp.text_offset
    two = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0, n=2)
    for ch in two.choices:
        assert ch.logprobs.tokens == lp.tokens[:4] and all(len(d) == 1 for d in ch.logprobs.top_logprobs)


def test_ollama_client(url):
    """The official ollama client (0.6.1 added logprobs): chat, streamed and not, greedy: each token's
    entry with its 2 alternatives, the first of them the token itself."""
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=url)
    kw = dict(model=NAME, messages=[{"role": "user", "content": "Count to three."}], logprobs=True, top_logprobs=2,
              options={"num_predict": 6, "temperature": 0})
    r = client.chat(**kw)
    assert len(r.logprobs) == r.eval_count
    for e in r.logprobs:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token
    assert "".join(e.token for e in r.logprobs) == r.message.content
    streamed = [e.model_dump() for part in client.chat(**kw, stream=True) for e in (part.logprobs or [])]
    same_entries(streamed, [e.model_dump() for e in r.logprobs])
