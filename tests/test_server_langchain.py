"""langchain-ollama against `gguf-run serve` (issue 35 item 6), as its users call it: structured
output (json_schema and json_mode) on the default model parses into the asked types, OllamaEmbeddings
gives the server's /api/embed vectors, and bind_tools reaches the chat template (a template with
tools takes them into the prompt; one without answers 400 "does not support tools", raised by the
client). Numpy backend, 127.0.0.1."""

from __future__ import annotations

import os

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
lc = pytest.importorskip("langchain_ollama")

from langchain_core.tools import tool  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from gguf_runtime.cli.default_model import default_model_path  # noqa: E402
from gguf_runtime.engine.engine import Engine  # noqa: E402
from gguf_runtime.server.adapters import make_adapter  # noqa: E402
from gguf_runtime.server.app import Service  # noqa: E402
from live_server import live  # noqa: E402
from micro_models import Micro, write_micro  # noqa: E402

NAME = "smollm2"
QWEN3 = open(os.path.join(os.path.dirname(__file__), "data", "chat_templates", "qwen3.jinja"), encoding="utf-8").read()


class Person(BaseModel):
    name: str
    age: int


@tool
def get_weather(city: str) -> str:
    """Current weather of a city."""
    return "sunny"


def serve(path: str, name: str):
    return live(Service(lambda: make_adapter(Engine(path, backend="numpy", n_ctx=512)), name=name).start())


@pytest.fixture(scope="module")
def url():
    with serve(default_model_path(), NAME) as u:
        yield u


def test_structured_output(url):
    llm = lc.ChatOllama(model=NAME, base_url=url, temperature=0, num_predict=120)
    p = llm.with_structured_output(Person).invoke("Make up a person with a name and an age.")
    assert isinstance(p, Person) and p.name and isinstance(p.age, int)
    schema = {"title": "City", "type": "object", "properties": {"city": {"type": "string"},
                                                                "population": {"type": "integer"}},
              "required": ["city", "population"]}
    d = llm.with_structured_output(schema, method="json_mode").invoke(
        "Name a city and its population, as JSON with the keys city and population.")
    assert isinstance(d, dict)  # json_mode: any JSON object; the schema is the prompt's business


def test_embeddings_are_the_servers(url):
    emb = lc.OllamaEmbeddings(model=NAME, base_url=url)
    texts = ["The sky is blue", "Grass is green"]
    got = np.asarray(emb.embed_documents(texts))
    want = np.asarray(httpx.post(url + "/api/embed", json={"model": NAME, "input": texts}).json()["embeddings"])
    assert got.shape == (2, 576) and np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
    assert np.allclose(got, want, atol=1e-6)
    assert np.allclose(emb.embed_query(texts[0]), want[0], atol=1e-6)


def test_bind_tools_reaches_the_template(url, tmp_path):
    ask = "What is the weather in Paris?"
    with pytest.raises(Exception, match="does not support tools"):  # SmolLM2's template has no tools
        lc.ChatOllama(model=NAME, base_url=url, num_predict=4).bind_tools([get_weather]).invoke(ask)
    path = write_micro(Micro(arch="qwen2", vocab="qwen2", n_vocab=None, seed=5, chat_template=QWEN3),
                       tmp_path / "q.gguf")
    with serve(str(path), "qwentools") as u:
        llm = lc.ChatOllama(model="qwentools", base_url=u, temperature=0, num_predict=4)
        plain = llm.invoke(ask)
        with_tools = llm.bind_tools([get_weather]).invoke(ask)
    n = lambda m: m.response_metadata["prompt_eval_count"]  # noqa: E731
    assert n(with_tools) > n(plain) + 20  # the tool's JSON schema is in the prompt
    assert isinstance(with_tools.tool_calls, list)
