"""Where the server prepares prompts (service.prepare): a small request body is rendered and
tokenized on the event loop, a large one on a prep thread; a small one that took long (a template
slow on small input) sends every later prompt to the prep threads."""

from __future__ import annotations

import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from gguf_runtime.cli.default_model import default_model_path  # noqa: E402
from gguf_runtime.engine.engine import Engine  # noqa: E402
from gguf_runtime.server import service as SV  # noqa: E402
from gguf_runtime.server.adapters import make_adapter  # noqa: E402
from gguf_runtime.server.app import Service  # noqa: E402
from live_server import live  # noqa: E402


class Counting:
    """The prep pool, counting the calls handed to it."""

    def __init__(self, pool) -> None:
        self.pool, self.calls = pool, 0

    def submit(self, *a, **kw):
        self.calls += 1
        return self.pool.submit(*a, **kw)

    def shutdown(self, *a, **kw):
        return self.pool.shutdown(*a, **kw)


@pytest.fixture()
def served():
    eng = Engine(default_model_path(), backend="numpy", n_ctx=4096)
    svc = Service(lambda: make_adapter(eng), name="tiny").start()
    svc.prep = Counting(svc.prep)
    with live(svc) as url:
        yield svc, eng, url


def ask(url, path, body):
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_small_bodies_inline_large_ones_on_a_prep_thread(served):
    svc, _, url = served
    opts = {"num_predict": 2, "temperature": 0}
    ask(url, "/api/generate", {"model": "tiny", "prompt": "Hi", "raw": True, "stream": False, "options": opts})
    ask(url, "/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "stream": False,
                           "options": opts})
    ask(url, "/v1/completions", {"model": "tiny", "prompt": ["Hi", "Ho"], "max_tokens": 2})
    assert svc.prep.calls == 0 and svc.inline_prep
    big = "word " * (SV.INLINE_PREP_BYTES // 5 + 10)
    ask(url, "/api/generate", {"model": "tiny", "prompt": big, "raw": True, "stream": False, "options": opts})
    assert svc.prep.calls == 1 and svc.inline_prep


def test_a_slow_small_prompt_sends_later_ones_to_the_prep_threads(served, monkeypatch):
    """A chat template that takes 3x the inline limit on a two-word message: that request is
    answered, and from then on even small prompts leave the event loop."""
    svc, eng, url = served
    render = eng.encode_chat

    def slow(*a, **kw):
        time.sleep(3 * SV.INLINE_PREP_MAX_S)
        return render(*a, **kw)

    monkeypatch.setattr(eng, "encode_chat", slow)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi there"}], "stream": False,
            "options": {"num_predict": 2, "temperature": 0}}
    ask(url, "/api/chat", chat)
    assert not svc.inline_prep and svc.prep.calls == 0
    ask(url, "/api/chat", chat)
    ask(url, "/api/generate", {"model": "tiny", "prompt": "Hi", "raw": True, "stream": False,
                               "options": {"num_predict": 2}})
    assert svc.prep.calls == 2
