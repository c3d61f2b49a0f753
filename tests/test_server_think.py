"""<think> reasoning (Qwen3, QwQ, DeepSeek-R1) through `gguf-run serve`: micro models (Qwen2's
vocabulary, random weights, numpy backend) carrying Qwen3's template, with <think> and </think> as
control tokens (the decoder must be told to show them), and a QwQ-style template whose generation
prompt opens <think> (the tags plain text there, cut across tokens). As in test_server_harmony,
the adapter plays known answers: the block comes back as Ollama's thinking and OpenAI's
reasoning_content, the rest as the answer and its tool calls, streamed (thinking and content in
chunks of their own, no piece of a tag) and whole, on /api/chat, /api/generate and
/v1/chat/completions; think false and chat_template_kwargs reach the template; a model without a
thinking template answers think with Ollama's 400; /api/show lists "thinking"; the history's
reasoning renders into the prompt."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from gguf_runtime.engine.engine import Engine  # noqa: E402
from gguf_runtime.server.app import Service  # noqa: E402
from live_server import live  # noqa: E402

from micro_models import Micro, write_micro  # noqa: E402
from test_server_harmony import Scripted  # noqa: E402

NAME, OPENED, PLAIN = "thinkmicro", "qwqmicro", "plainmicro"
QWEN3 = open(os.path.join(os.path.dirname(__file__), "data", "chat_templates", "qwen3.jinja"), encoding="utf-8").read()
GEN_PROMPT = "{{- '<|im_start|>assistant\\n' }}"
assert QWEN3.count(GEN_PROMPT) == 1
QWQ = QWEN3.replace(GEN_PROMPT, "{{- '<|im_start|>assistant\\n<think>\\n' }}")  # as QwQ's and Qwen3-2507-Thinking's
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

THOUGHT = "The user asks about Paris.\nI should answer briefly."
REPLY = "It is sunny in Paris, around twenty degrees."
ANSWER = f"<think>\n{THOUGHT}\n</think>\n\n{REPLY}"
CALL = f'<think>\n{THOUGHT}\n</think>\n\n<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n</tool_call>'
NO_THOUGHT = f"<think>\n\n</think>\n\n{REPLY}"  # what Qwen3 writes told not to think
NEVER = "NEVER SHOWN"  # tokens played after the end-of-generation token


@contextmanager
def serve(path, name):
    svc = Service(lambda: Scripted(Engine(path, backend="numpy", n_ctx=2048)), name=name).start()
    with live(svc) as url:
        yield url, svc


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("think")
    path = write_micro(Micro(arch="qwen2", vocab="qwen2", n_vocab=None, seed=7, chat_template=QWEN3,
                             added_tokens=("<think>", "</think>")), d / "t.gguf")
    with serve(path, NAME) as s:
        yield s


@pytest.fixture(scope="module")
def opened(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwq")
    path = write_micro(Micro(arch="qwen2", vocab="qwen2", n_vocab=None, seed=8, chat_template=QWQ), d / "o.gguf")
    with serve(path, OPENED) as s:
        yield s


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    d = tmp_path_factory.mktemp("plain")
    path = write_micro(Micro(arch="qwen2", vocab="qwen2", n_vocab=None, seed=9), d / "p.gguf")  # Qwen2's template
    with serve(path, PLAIN) as s:
        yield s


def player(server_):
    """(url, svc, set_): set_(text) makes the model answer ``text`` then <|im_end|> (None: sample)."""
    url, svc = server_
    adapter, tok = svc.scheduler.adapter, svc.engine.tokenizer
    svc.stream_interval = 0  # a chunk each token (the streamed tests count them)

    def set_(text: str | None) -> list[int]:
        if text is None:
            adapter.script = None
            return []
        ids = tok.encode(text, add_special=False, parse_special=True)
        adapter.script = ids + [tok.token_to_id["<|im_end|>"]] + tok.encode(NEVER, add_special=False)
        return ids

    return url, svc, set_


@pytest.fixture
def play(server):
    yield player(server)
    server[1].scheduler.adapter.script = None


@pytest.fixture
def play_opened(opened):
    yield player(opened)
    opened[1].scheduler.adapter.script = None


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def prompt_of(svc) -> str:
    return svc.engine.tokenizer.decode(svc.scheduler.adapter.prompts[-1])


def no_tags(*texts):
    for t in texts:
        assert t is None or ("<" not in t and ">" not in t and NEVER not in t), t


def openai_stream(url, model, **kw) -> tuple[list[str], list[str], list]:
    """(reasoning deltas, content deltas, every delta) of a streamed chat completion."""
    chunks = list(client(url).chat.completions.create(model=model, messages=ASK, stream=True, **kw))
    deltas = [k.choices[0].delta for k in chunks if k.choices]
    reasoning = [d.model_extra.get("reasoning_content") for d in deltas if d.model_extra.get("reasoning_content")]
    return reasoning, [d.content for d in deltas if d.content], deltas


def ollama_stream(url, api: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + api, json=body, timeout=60) as s:
        return [json.loads(x) for x in s.iter_lines() if x.strip()]


# ---- OpenAI ---------------------------------------------------------------------------------------
def test_openai_reasoning_and_answer_whole(play):
    url, svc, set_ = play
    ids = set_(ANSWER)
    r = httpx.post(url + "/v1/chat/completions", json={"model": NAME, "messages": ASK}, timeout=60).json()
    choice = r["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": REPLY, "reasoning_content": THOUGHT + "\n"}
    assert choice["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == len(ids)
    c = client(url).chat.completions.create(model=NAME, messages=ASK)  # the official client reads it
    assert c.choices[0].message.content == REPLY
    assert c.choices[0].message.model_extra["reasoning_content"] == THOUGHT + "\n"


def test_openai_reasoning_and_answer_streamed(play):
    url, svc, set_ = play
    set_(ANSWER)
    reasoning, content, deltas = openai_stream(url, NAME)
    assert "".join(reasoning) == THOUGHT + "\n" and len(reasoning) > 3  # as it was generated, token by token
    assert "".join(content) == REPLY and len(content) > 3
    assert not any(d.content and d.model_extra.get("reasoning_content") for d in deltas)  # chunks of their own
    last_reasoning = max(i for i, d in enumerate(deltas) if d.model_extra.get("reasoning_content"))
    assert last_reasoning < min(i for i, d in enumerate(deltas) if d.content)
    assert deltas[0].role == "assistant"
    no_tags(*reasoning, *content)


def test_openai_tool_call_after_the_reasoning(play):
    url, svc, set_ = play
    set_(CALL)
    ch = client(url).chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER]).choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert ch.message.model_extra["reasoning_content"] == THOUGHT + "\n"
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    set_(CALL)
    reasoning, content, deltas = openai_stream(url, NAME, tools=[WEATHER])
    assert "".join(reasoning) == THOUGHT + "\n" and not content
    (tc,) = [t for d in deltas for t in (d.tool_calls or [])]
    assert tc.function.name == "get_weather" and json.loads(tc.function.arguments) == {"city": "Paris"}


def test_openai_chat_template_kwargs_turn_thinking_off(play):
    url, svc, set_ = play
    set_(NO_THOUGHT)
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": NAME, "messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert prompt_of(svc).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert r["choices"][0]["message"] == {"role": "assistant", "content": REPLY}  # the empty block stripped
    set_(ANSWER)
    client(url).chat.completions.create(model=NAME, messages=ASK)
    assert prompt_of(svc).endswith("<|im_start|>assistant\n")  # thinking on: the template's default
    for kwargs, words in (([1], "chat_template_kwargs must be an object"),
                          ({"tools": []}, "chat_template_kwargs.tools cannot be set"),
                          ({"self": 1}, "chat_template_kwargs.self cannot be set")):
        r = httpx.post(url + "/v1/chat/completions", timeout=30,
                       json={"model": NAME, "messages": ASK, "chat_template_kwargs": kwargs})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


# ---- Ollama ---------------------------------------------------------------------------------------
def test_ollama_thinking_whole_and_streamed(play):
    url, svc, set_ = play
    set_(ANSWER)
    resp = ollama.Client(host=url).chat(model=NAME, messages=ASK)  # think left out: the thinking apart
    assert resp.message.thinking == THOUGHT + "\n" and resp.message.content == REPLY
    assert resp.done_reason == "stop"
    set_(ANSWER)
    parts = list(ollama.Client(host=url).chat(model=NAME, messages=ASK, stream=True, think=True))
    thinking = [p.message.thinking for p in parts if p.message.thinking]
    content = [p.message.content for p in parts if p.message.content]
    assert "".join(thinking) == THOUGHT + "\n" and len(thinking) > 3
    assert "".join(content) == REPLY and len(content) > 3
    assert parts[-1].done and not any(p.message.thinking and p.message.content for p in parts)
    no_tags(*thinking, *content)


def test_ollama_tool_call_after_the_thinking(play):
    url, svc, set_ = play
    set_(CALL)
    resp = ollama.Client(host=url).chat(model=NAME, messages=ASK, tools=[WEATHER])
    assert resp.message.content == "" and resp.message.thinking == THOUGHT + "\n"
    (call,) = resp.message.tool_calls
    assert call.function.name == "get_weather" and dict(call.function.arguments) == {"city": "Paris"}
    set_(CALL)
    lines = ollama_stream(url, "/api/chat", {"model": NAME, "messages": ASK, "tools": [WEATHER]})
    assert all(x["message"]["content"] == "" for x in lines), "call text streamed as content"
    assert "".join(x["message"].get("thinking", "") for x in lines) == THOUGHT + "\n"
    assert [x["message"]["tool_calls"] for x in lines if x["message"].get("tool_calls")] == [
        [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]]


def test_ollama_think_false(play):
    url, svc, set_ = play
    set_(NO_THOUGHT)
    r = httpx.post(url + "/api/chat", timeout=60,
                   json={"model": NAME, "messages": ASK, "think": False, "stream": False}).json()
    assert prompt_of(svc).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert r["message"] == {"role": "assistant", "content": REPLY}  # no thinking field, the empty block gone
    set_(NO_THOUGHT)
    lines = ollama_stream(url, "/api/chat", {"model": NAME, "messages": ASK, "think": False})
    assert "".join(x["message"]["content"] for x in lines) == REPLY
    assert not any("thinking" in x["message"] for x in lines)


def test_ollama_generate_thinking_and_response(play):
    url, svc, set_ = play
    set_(ANSWER)
    r = ollama.Client(host=url).generate(model=NAME, prompt="Weather in Paris?")
    assert r.thinking == THOUGHT + "\n" and r.response == REPLY
    set_(ANSWER)
    lines = ollama_stream(url, "/api/generate", {"model": NAME, "prompt": "Weather?"})
    thinking = [x["thinking"] for x in lines if x.get("thinking")]
    assert "".join(thinking) == THOUGHT + "\n" and len(thinking) > 3
    assert "".join(x["response"] for x in lines) == REPLY
    assert not any(x.get("thinking") and x["response"] for x in lines)
    no_tags(*thinking, *(x["response"] for x in lines))
    set_(NO_THOUGHT)
    r = httpx.post(url + "/api/generate", timeout=60,
                   json={"model": NAME, "prompt": "Weather?", "think": False, "stream": False}).json()
    assert prompt_of(svc).endswith("<think>\n\n</think>\n\n") and r["response"] == REPLY and "thinking" not in r
    set_(ANSWER)  # raw: no template, no parsing
    r = httpx.post(url + "/api/generate", json={"model": NAME, "prompt": "x", "raw": True, "stream": False},
                   timeout=60).json()
    assert "thinking" not in r and THOUGHT in r["response"]


# ---- a prompt that opened the block ---------------------------------------------------------------
OPENED_ANSWER = f"{THOUGHT}\n</think>\n\n{REPLY}"  # only the closing tag


def test_an_opened_block_whole_and_streamed(play_opened):
    url, svc, set_ = play_opened
    ids = set_(OPENED_ANSWER)
    assert len(svc.engine.tokenizer.encode("</think>", add_special=False)) > 1  # the tag cut across tokens
    assert len(ids) > 10
    r = httpx.post(url + "/v1/chat/completions", json={"model": OPENED, "messages": ASK}, timeout=60).json()
    assert prompt_of(svc).endswith("<|im_start|>assistant\n<think>\n")
    assert r["choices"][0]["message"] == {"role": "assistant", "content": REPLY, "reasoning_content": THOUGHT + "\n"}
    set_(OPENED_ANSWER)
    reasoning, content, _ = openai_stream(url, OPENED)
    assert "".join(reasoning) == THOUGHT + "\n" and "".join(content) == REPLY
    no_tags(*reasoning, *content)
    set_(OPENED_ANSWER)
    lines = ollama_stream(url, "/api/chat", {"model": OPENED, "messages": ASK})
    assert "".join(x["message"].get("thinking", "") for x in lines) == THOUGHT + "\n"
    assert "".join(x["message"]["content"] for x in lines) == REPLY
    set_(OPENED_ANSWER)
    r = ollama.Client(host=url).generate(model=OPENED, prompt="Weather in Paris?")
    assert r.thinking == THOUGHT + "\n" and r.response == REPLY


def test_an_opened_block_in_each_of_several_choices(play_opened):
    url, svc, set_ = play_opened
    set_(OPENED_ANSWER)  # (each choice plays it)
    r = client(url).chat.completions.create(model=OPENED, messages=ASK, n=2)
    assert [(c.message.content, c.message.model_extra["reasoning_content"]) for c in r.choices] == \
        [(REPLY, THOUGHT + "\n")] * 2


def test_a_grammar_answer_is_content_though_the_prompt_opened_the_block(play_opened):
    url, svc, set_ = play_opened
    set_('{"city": "Paris"}')  # (the script stands for what the grammar lets the model write)
    r = httpx.post(url + "/api/chat", timeout=60,
                   json={"model": OPENED, "messages": ASK, "format": "json", "stream": False}).json()
    assert prompt_of(svc).endswith("<think>\n")
    assert r["message"] == {"role": "assistant", "content": '{"city": "Paris"}'}


# ---- the history, the card, the refusals ----------------------------------------------------------
def test_the_history_reasoning_renders(play):
    url, svc, set_ = play
    turns = ASK + [{"role": "assistant", "content": None, "reasoning_content": "Weather tool.", "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}]
    set_(ANSWER)
    client(url).chat.completions.create(model=NAME, messages=turns, tools=[WEATHER])
    assert ("<|im_start|>assistant\n<think>\nWeather tool.\n</think>\n\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>') in prompt_of(svc)
    set_(ANSWER)  # Ollama's shape (thinking, tool_name): the same prompt
    oturns = ASK + [{"role": "assistant", "content": "", "thinking": "Weather tool.", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_name": "get_weather", "content": "sunny"}]
    ollama.Client(host=url).chat(model=NAME, messages=oturns, tools=[WEATHER])
    assert svc.scheduler.adapter.prompts[-1] == svc.scheduler.adapter.prompts[-2]


def test_show_lists_thinking(server, opened, plain):
    caps = lambda s, name: httpx.post(s[0] + "/api/show", json={"model": name}).json()["capabilities"]  # noqa: E731
    assert caps(server, NAME) == ["completion", "tools", "thinking"]
    assert caps(opened, OPENED) == ["completion", "tools", "thinking"]
    assert "thinking" not in caps(plain, PLAIN)


def test_think_on_a_model_that_cannot_think_is_a_400(plain):
    url = plain[0]
    want = f'"{PLAIN}" does not support thinking'  # Ollama's words: the model as the request names it
    for api, extra in (("/api/chat", {"messages": ASK}), ("/api/generate", {"prompt": "Hi"})):
        for think in (True, "high"):
            r = httpx.post(url + api, json={"model": PLAIN, "think": think, "stream": False, **extra}, timeout=30)
            assert r.status_code == 400 and r.json() == {"error": want}, r.text
        r = httpx.post(url + api, json={"model": PLAIN, "think": False, "stream": False, **extra,
                                        "options": {"num_predict": 1}}, timeout=60)
        assert r.status_code == 200, r.text  # think false asks nothing of it
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=url).chat(model=PLAIN + ":latest", messages=ASK, think=True)
    assert e.value.status_code == 400 and e.value.error == f'"{PLAIN}:latest" does not support thinking'
