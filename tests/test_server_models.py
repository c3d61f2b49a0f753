"""Several models behind one server (serve --models): /api/tags and /v1/models list them all, a
request naming one loads it (the loaded one unloaded first, once its requests are done; one at a
time), answers are each model's own under interleaved concurrent requests, an unknown name is a
404 listing them (numpy backend, micro models, 127.0.0.1)."""

from __future__ import annotations

import threading

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from gguf_runtime.engine.engine import Engine  # noqa: E402
from gguf_runtime.server.adapters import make_adapter  # noqa: E402
from gguf_runtime.server.app import Service  # noqa: E402
from live_server import live  # noqa: E402
from micro_models import Micro, write_micro  # noqa: E402


@pytest.fixture
def served(tmp_path):
    paths = {"alpha": write_micro(Micro(n_layer=1, seed=1), tmp_path / "alpha.gguf"),
             "beta": write_micro(Micro(n_layer=2, seed=2), tmp_path / "beta.gguf")}
    loads: list[str] = []

    def loader(path):
        loads.append(str(path))
        return make_adapter(Engine(str(path), backend="numpy", n_ctx=64))

    svc = Service(lambda: loader(paths["alpha"]), name="alpha", catalog=[(k, str(p)) for k, p in paths.items()],
                  loader=loader).start()
    with live(svc) as url:
        yield url, loads, paths


def ask(url: str, model: str, prompt: str) -> str:
    r = httpx.post(url + "/api/generate", timeout=60, json={"model": model, "prompt": prompt, "raw": True,
                                                            "stream": False, "options": {"num_predict": 5,
                                                                                         "temperature": 0}})
    assert r.status_code == 200, r.text
    return r.json()["response"]


def test_models_listed_loaded_on_demand_and_swapped(served):
    url, loads, paths = served
    tags = [m["name"] for m in httpx.get(url + "/api/tags").json()["models"]]
    assert tags == ["alpha:latest", "beta:latest"]
    assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == tags
    assert [m["name"] for m in httpx.get(url + "/api/ps").json()["models"]] == ["alpha:latest"]
    assert httpx.post(url + "/api/show", json={"model": "beta"}).json()["details"]["family"] == "llama"
    r = httpx.post(url + "/api/generate", json={"model": "gamma", "prompt": "x"})
    assert r.status_code == 404 and "alpha:latest, beta:latest" in r.json()["error"]
    alone = {m: [ask(url, m, p) for p in ("one two", "three four")] for m in ("alpha", "beta")}
    assert [m["name"] for m in httpx.get(url + "/api/ps").json()["models"]] == ["beta:latest"]
    assert loads == [str(paths["alpha"]), str(paths["beta"])]
    assert alone["alpha"] != alone["beta"]  # (two different models)
    got: dict = {}

    def client(i: int) -> None:
        m, p = ("alpha", "beta")[i % 2], ("one two", "three four")[i // 2 % 2]
        got[i] = (m, p, ask(url, m, p))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for m, p, text in got.values():
        assert text == alone[m][("one two", "three four").index(p)], (m, p)
    assert len(loads) >= 3  # swapped back and forth, one model at a time


def test_a_model_that_cannot_load_leaves_the_loaded_one(served):
    """A listed file damaged since (truncated) is a 400 naming it, and the model loaded stays loaded:
    it was unloaded first, so the next request for it loaded it again."""
    url, loads, paths = served
    ask(url, "alpha", "one two")
    data = paths["beta"].read_bytes()
    paths["beta"].write_bytes(data[: len(data) // 2])
    r = httpx.post(url + "/api/generate", timeout=60, json={"model": "beta", "prompt": "x", "stream": False})
    assert r.status_code == 400 and "truncated" in r.json()["error"], r.text
    assert [m["name"] for m in httpx.get(url + "/api/ps").json()["models"]] == ["alpha:latest"]
    ask(url, "alpha", "three four")
    assert loads == [str(paths["alpha"])]  # never unloaded, never loaded again
