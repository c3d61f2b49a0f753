"""Ollama's keep_alive: the model unloads after its duration once idle (0: after the request; a
request with no prompt and keep_alive 0: at once), the next request loads it again, /api/ps tells
which, and a bad duration is a 400 naming it (numpy backend, a micro model, 127.0.0.1)."""

from __future__ import annotations

import datetime as dt
import math
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from gguf_runtime.engine.engine import Engine  # noqa: E402
from gguf_runtime.server import schemas as S  # noqa: E402
from gguf_runtime.server.adapters import make_adapter  # noqa: E402
from gguf_runtime.server.app import Service  # noqa: E402
from live_server import live  # noqa: E402
from micro_models import Micro, write_micro  # noqa: E402

NAME = "micro"


@pytest.mark.parametrize("v,want", [("5m", 300.0), ("1h30m", 5400.0), ("250ms", 0.25), ("2.5m", 150.0), ("0", 0.0),
                                    (0, 0.0), (300, 300.0), (-1, math.inf), ("-1", math.inf), ("-1s", math.inf),
                                    (None, None), (1e12, math.inf), (1e300, math.inf), ("99999999999h", math.inf),
                                    (S.FOREVER_S, S.FOREVER_S)])
def test_keep_alive_durations(v, want):
    assert S.keep_alive(v) == want


@pytest.mark.parametrize("v", ["5x", "", "abc", "5m3", "--5m", "nan", True, [1], {}])
def test_bad_keep_alive_is_a_400_naming_it(v):
    with pytest.raises(S.ApiError) as ei:
        S.keep_alive(v)
    assert ei.value.status == 400 and "keep_alive" in str(ei.value)


@pytest.fixture
def served(tmp_path):
    path = write_micro(Micro(n_layer=1), tmp_path / "micro.gguf")
    loads = []

    def factory():
        loads.append(time.monotonic())
        return make_adapter(Engine(str(path), backend="numpy", n_ctx=64))

    svc = Service(factory, name=NAME).start()
    with live(svc) as url:
        yield url, loads


def ps(url: str) -> list[dict]:
    return httpx.get(url + "/api/ps").json()["models"]


def until(pred, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return False


def gen(url: str, **kw) -> httpx.Response:
    body = {"model": NAME, "prompt": "hello there", "stream": False, "options": {"num_predict": 3}, **kw}
    return httpx.post(url + "/api/generate", json=body, timeout=60)


def test_keep_alive_unloads_and_the_next_request_loads_again(served):
    url, loads = served
    (m,) = ps(url)
    assert m["name"] == NAME + ":latest" and m["expires_at"].startswith("2318")  # the default: for ever
    r = gen(url, keep_alive=0)
    assert r.status_code == 200 and r.json()["done"]
    assert until(lambda: ps(url) == []), "keep_alive 0: unloaded once the request is over"
    assert httpx.get(url + "/api/scheduler").json()["loaded"] is False
    r = gen(url, keep_alive="5m")  # loads again
    assert r.status_code == 200 and r.json()["response"] and len(loads) == 2
    (m,) = ps(url)
    left = (dt.datetime.fromisoformat(m["expires_at"].replace("Z", "+00:00")) - dt.datetime.now(dt.timezone.utc))
    assert 280 < left.total_seconds() <= 300
    r = gen(url, keep_alive="1s")
    assert r.status_code == 200 and ps(url)
    assert until(lambda: ps(url) == [], timeout=6), "keep_alive 1s: unloaded a second after"
    assert httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2}).status_code == 200
    assert len(loads) == 3 and ps(url)  # an OpenAI request loads it too (and the default keeps it)


def test_empty_request_loads_or_unloads(served):
    url, loads = served
    r = httpx.post(url + "/api/generate", json={"model": NAME, "keep_alive": 0})
    assert r.json()["done_reason"] == "unload" and ps(url) == []
    r = httpx.post(url + "/api/chat", json={"model": NAME, "messages": [], "keep_alive": "10m"})
    assert r.json()["done_reason"] == "load" and ps(url) and len(loads) == 2
    r = httpx.post(url + "/api/chat", json={"model": NAME, "messages": [], "keep_alive": 0})
    assert r.json()["done_reason"] == "unload" and ps(url) == []


def test_bad_keep_alive_over_http(served):
    url, loads = served
    r = gen(url, keep_alive="soon")
    assert r.status_code == 400 and "keep_alive" in r.json()["error"]
    assert ps(url) and len(loads) == 1  # nothing unloaded, nothing loaded again


@pytest.mark.parametrize("keep,year", [(1e300, 2318), ("99999999999h", 2318), (1e9, None)])
def test_keep_alive_past_a_century_is_for_ever(served, keep, year):
    """A huge finite keep_alive is for ever (Ollama's 2318 date in /api/ps), and a long finite one
    a date that far: /api/ps answers either (it was a 500 on the date's overflow)."""
    url, _ = served
    assert gen(url, keep_alive=keep).status_code == 200
    r = httpx.get(url + "/api/ps")
    assert r.status_code == 200
    when = dt.datetime.fromisoformat(r.json()["models"][0]["expires_at"].replace("Z", "+00:00"))
    if year is not None:
        assert when.year == year
    else:
        assert 30 <= (when - dt.datetime.now(dt.timezone.utc)).days / 365 <= 32
