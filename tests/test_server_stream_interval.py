"""A stream writes at most once per the server's stream interval while its request runs (service.py
STREAM_INTERVAL_S), the text queued meanwhile as one chunk: on the CUDA adapter over
bench/host_serve.py's timed stand-in of the GPU (a decode step every ~0.6 ms), a 120-token stream
comes in a handful of chunks, 10 ms or more apart but for the last, and every token arrives; with
the interval 0 it comes in many more."""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import os

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from gguf_runtime.cli.default_model import default_model_path  # noqa: E402
from gguf_runtime.engine.engine import Engine  # noqa: E402
from gguf_runtime.server.adapters import make_adapter  # noqa: E402
from gguf_runtime.server.app import Service  # noqa: E402
from live_server import live  # noqa: E402

spec = importlib.util.spec_from_file_location(
    "host_serve", os.path.join(os.path.dirname(__file__), "..", "bench", "host_serve.py"))
HS = importlib.util.module_from_spec(spec)
spec.loader.exec_module(HS)


def timed_service(**kw) -> Service:
    eng = Engine(default_model_path(), backend="numpy", n_ctx=512)
    eos = set(eng.tokenizer.eog_ids)
    text = [t for t in eng.tokenizer.encode(HS.TEXT, add_special=False) if t not in eos]
    eng.backend = HS.TimedBackend(text, 512, 4, step=(0.5, 0.02), prefill=(0.0005, 1e6))
    return Service(lambda: make_adapter(eng), name="timed", **kw).start()


def lines(url: str) -> list[dict]:
    body = {"model": "timed", "prompt": "Hi", "raw": True, "options": {"num_predict": 120, "seed": 5}}
    with httpx.stream("POST", url + "/api/generate", json=body, timeout=60) as r:
        return [json.loads(x) for x in r.iter_lines() if x]


def stamp(x: dict) -> float:
    return dt.datetime.fromisoformat(x["created_at"].replace("Z", "+00:00")).timestamp()


def test_chunks_per_interval():
    svc = timed_service()
    assert svc.stream_interval == 0.01
    with live(svc) as url:
        got = lines(url)
    text = [x for x in got if not x["done"]]
    assert got[-1]["done"] and got[-1]["eval_count"] == 120
    # 120 steps of ~0.6 ms: ~72 ms of tokens, so about 8 writes at 10 ms (and the first at once)
    assert 2 <= len(text) <= 16, len(text)
    gaps = [stamp(b) - stamp(a) for a, b in zip(text, text[1:])]
    assert min(gaps[:-1]) >= 0.009, gaps  # (the last may come sooner: the request ended)
    with live(timed_service(stream_interval=0.0)) as url:  # (serve --stream-interval 0)
        every = [x for x in lines(url) if not x["done"]]
    assert len(every) > 3 * len(text), (len(every), len(text))
    assert "".join(x["response"] for x in every) == "".join(x["response"] for x in text)


def test_the_end_goes_out_at_once():
    """A pause between writes ends when the answer does: its last text and the final line do not wait
    out the interval (the client's next request would), nor do a choice's (n > 1)."""
    import time

    with live(timed_service(stream_interval=2.0)) as url:
        t0 = time.perf_counter()
        got = lines(url)
        took = time.perf_counter() - t0
        body = {"model": "timed", "prompt": "Hi", "max_tokens": 40, "n": 2, "seed": 5, "stream": True}
        t1 = time.perf_counter()
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            events = [x for x in r.iter_lines() if x.startswith("data: ")]
        took_n = time.perf_counter() - t1
    assert got[-1]["done"] and got[-1]["eval_count"] == 120
    assert len([x for x in got if not x["done"]]) <= 3  # (the first write, then what queued meanwhile)
    assert took < 1.5, took  # a 2 s pause would have held the end back
    assert events[-1] == "data: [DONE]" and took_n < 1.5, took_n
