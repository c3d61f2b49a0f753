"""gpt-oss's Harmony answers through `gguf-run serve`: a micro model (Qwen2's vocabulary with
Harmony's seven special tokens added, random weights, numpy backend) carrying gpt-oss's template.
A random-weight model writes no Harmony, so its adapter plays known answers (token ids, the markers
as their special tokens, then <|call|> or <|return|> and tokens that must never be seen): the
scheduler stops at the end-of-generation token, the decoder shows the markers, and the answer comes
back as OpenAI's reasoning_content / content / tool_calls and Ollama's thinking / content /
tool_calls, streamed and whole, through the official clients. Also: reasoning and calls of the
history render into the prompt, think / reasoning_effort reach the template, a forced call runs
the real model under the Harmony grammar, /api/show lists "thinking"."""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from gguf_runtime.engine.engine import Engine  # noqa: E402
from gguf_runtime.format.tool_calls import HARMONY_MARKERS  # noqa: E402
from gguf_runtime.server.adapters import NumpyAdapter  # noqa: E402
from gguf_runtime.server.app import Service  # noqa: E402
from live_server import live  # noqa: E402

from micro_models import Micro, write_micro  # noqa: E402
from test_harmony import HARMONY_TOKENS  # noqa: E402

NAME = "harmonymicro"
TEMPLATE = open(os.path.join(os.path.dirname(__file__), "data", "chat_templates", "gpt-oss-harmony.jinja"),
                encoding="utf-8").read()
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

A = "<|channel|>analysis<|message|>"
THOUGHT = "The user asks about Paris. I should answer."
ANSWER = (A + THOUGHT + "<|end|><|start|>assistant<|channel|>final<|message|>It is sunny in Paris.", "<|return|>")
CALL = (A + "Need the weather tool.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
        '<|constrain|>json<|message|>{"city": "Paris", "days": 2}', "<|call|>")
NEVER = "NEVER SHOWN"  # tokens played after the end-of-generation token


class Scripted(NumpyAdapter):
    """The numpy adapter, its prompt evaluated for real, its answer the ``script``'s token ids when
    one is set (sampling otherwise); ``prompts`` keeps what each request sent."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.script: list[int] | None = None
        self.prompts: list[list[int]] = []

    def add(self, slot, prompt, params, max_new, grammar=None):
        n = super().add(slot, prompt, params, max_new, grammar)
        self.prompts.append(list(prompt))
        if self.script is not None:
            self._it.close()
            self._it = (t for t in list(self.script))
        return n

    def step(self):
        if self.script is not None:
            time.sleep(0.005)  # a token every 5 ms, as a model makes them: streamed, each is its own chunk
        return super().step()


@contextmanager
def serve(path):
    svc = Service(lambda: Scripted(Engine(path, backend="numpy", n_ctx=2048)), name=NAME).start()
    with live(svc) as url:
        yield url, svc


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("harmony")
    path = write_micro(Micro(arch="qwen2", vocab="qwen2", n_vocab=None, seed=11, chat_template=TEMPLATE,
                             added_tokens=HARMONY_TOKENS), d / "h.gguf")
    with serve(path) as s:
        yield s


@pytest.fixture
def play(server):
    """Set the answer the model gives next: (text, its end-of-generation token); None: sample."""
    url, svc = server
    adapter, tok = svc.scheduler.adapter, svc.engine.tokenizer
    svc.stream_interval = 0  # a chunk each token (the streamed tests count them)

    def set_(answer: tuple[str, str] | None) -> list[int]:
        if answer is None:
            adapter.script = None
            return []
        ids = tok.encode(answer[0], add_special=False, parse_special=True)
        adapter.script = ids + [tok.token_to_id[answer[1]]] + tok.encode(NEVER, add_special=False)
        return ids

    yield url, svc, set_
    adapter.script = None


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def no_markers(*texts):
    for t in texts:
        assert t is None or (not any(m in t for m in HARMONY_MARKERS) and NEVER not in t), t


# ---- OpenAI ---------------------------------------------------------------------------------------
def test_openai_reasoning_and_answer_whole(play):
    url, svc, set_ = play
    ids = set_(ANSWER)
    r = httpx.post(url + "/v1/chat/completions", json={"model": NAME, "messages": ASK}, timeout=60).json()
    msg, choice = r["choices"][0]["message"], r["choices"][0]
    assert msg == {"role": "assistant", "content": "It is sunny in Paris.", "reasoning_content": THOUGHT}
    assert choice["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == len(ids)  # stopped at <|return|>
    c = client(url).chat.completions.create(model=NAME, messages=ASK)  # the official client reads it
    assert c.choices[0].message.content == "It is sunny in Paris."
    assert c.choices[0].message.model_extra["reasoning_content"] == THOUGHT


def test_openai_reasoning_and_answer_streamed(play):
    url, svc, set_ = play
    set_(ANSWER)
    chunks = list(client(url).chat.completions.create(model=NAME, messages=ASK, stream=True))
    deltas = [k.choices[0].delta for k in chunks if k.choices]
    reasoning = [d.model_extra.get("reasoning_content") for d in deltas if d.model_extra.get("reasoning_content")]
    content = [d.content for d in deltas if d.content]
    assert "".join(reasoning) == THOUGHT and len(reasoning) > 3  # as it was generated, token by token
    assert "".join(content) == "It is sunny in Paris." and len(content) > 3
    assert deltas[0].role == "assistant" and chunks[-1].choices[0].finish_reason == "stop"
    last_reasoning = max(i for i, d in enumerate(deltas) if d.model_extra.get("reasoning_content"))
    assert last_reasoning < min(i for i, d in enumerate(deltas) if d.content)  # reasoning first
    no_markers(*reasoning, *content)


def test_openai_tool_call_whole_and_streamed(play):
    url, svc, set_ = play
    set_(CALL)
    r = client(url).chat.completions.create(model=NAME, messages=ASK, tools=TOOLS)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert ch.message.model_extra["reasoning_content"] == "Need the weather tool."
    (call,) = ch.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}

    set_(CALL)
    chunks = list(client(url).chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, stream=True))
    deltas = [k.choices[0].delta for k in chunks if k.choices]
    assert not any(d.content for d in deltas), "call text streamed as content"
    no_markers(*(d.model_extra.get("reasoning_content") for d in deltas))
    state = openai.lib.streaming.chat.ChatCompletionStreamState(input_tools=TOOLS)  # the client's own accumulator
    for k in chunks:
        state.handle_chunk(k)
    done = state.get_final_completion().choices[0]
    assert done.finish_reason == "tool_calls"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in done.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2})]


def test_openai_without_tools_a_call_stays_text(play):
    url, svc, set_ = play
    set_(CALL)
    r = httpx.post(url + "/v1/chat/completions", json={"model": NAME, "messages": ASK}, timeout=60).json()
    msg = r["choices"][0]["message"]
    assert msg["content"] == '{"city": "Paris", "days": 2}' and "tool_calls" not in msg
    assert r["choices"][0]["finish_reason"] == "stop"


def test_a_truncated_answer_gives_what_came(play):
    url, svc, set_ = play
    ids = set_(ANSWER)
    n = len(svc.engine.tokenizer.encode(A + THOUGHT + "<|end|>", add_special=False, parse_special=True))
    r = httpx.post(url + "/v1/chat/completions", json={"model": NAME, "messages": ASK, "max_tokens": n + 2},
                   timeout=60).json()
    ch = r["choices"][0]
    assert ch["finish_reason"] == "length" and ch["message"]["reasoning_content"] == THOUGHT
    assert ch["message"]["content"] == "" and len(ids) > n + 2


# ---- Ollama ---------------------------------------------------------------------------------------
def test_ollama_thinking_whole_and_streamed(play):
    url, svc, set_ = play
    set_(ANSWER)
    resp = ollama.Client(host=url).chat(model=NAME, messages=ASK)
    assert resp.message.thinking == THOUGHT and resp.message.content == "It is sunny in Paris."
    assert resp.done_reason == "stop"

    set_(ANSWER)
    parts = list(ollama.Client(host=url).chat(model=NAME, messages=ASK, stream=True))
    thinking = [p.message.thinking for p in parts if p.message.thinking]
    content = [p.message.content for p in parts if p.message.content]
    assert "".join(thinking) == THOUGHT and len(thinking) > 3
    assert "".join(content) == "It is sunny in Paris." and len(content) > 3
    assert parts[-1].done and not any(p.message.thinking and p.message.content for p in parts)
    no_markers(*thinking, *content)


def test_ollama_tool_call_whole_and_streamed(play):
    url, svc, set_ = play
    set_(CALL)
    resp = ollama.Client(host=url).chat(model=NAME, messages=ASK, tools=TOOLS)
    assert resp.message.content == "" and resp.message.thinking == "Need the weather tool."
    (call,) = resp.message.tool_calls
    assert call.function.name == "get_weather" and dict(call.function.arguments) == {"city": "Paris", "days": 2}

    set_(CALL)
    with httpx.stream("POST", url + "/api/chat", json={"model": NAME, "messages": ASK, "tools": TOOLS},
                      timeout=60) as s:
        lines = [json.loads(x) for x in s.iter_lines() if x.strip()]
    assert all(x["message"]["content"] == "" for x in lines), "call text streamed as content"
    with_calls = [x for x in lines if x["message"].get("tool_calls")]
    assert len(with_calls) == 1 and lines[-1]["done"] and lines[-1]["done_reason"] == "stop"
    assert with_calls[0]["message"]["tool_calls"] == [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]
    assert "".join(x["message"].get("thinking", "") for x in lines) == "Need the weather tool."


def test_ollama_generate_thinking_and_response(play):
    url, svc, set_ = play
    set_(ANSWER)
    r = ollama.Client(host=url).generate(model=NAME, prompt="Weather in Paris?")
    assert r.thinking == THOUGHT and r.response == "It is sunny in Paris."
    set_(ANSWER)
    with httpx.stream("POST", url + "/api/generate", json={"model": NAME, "prompt": "Weather?"}, timeout=60) as s:
        lines = [json.loads(x) for x in s.iter_lines() if x.strip()]
    assert "".join(x.get("thinking", "") for x in lines) == THOUGHT
    assert "".join(x["response"] for x in lines) == "It is sunny in Paris."
    set_(ANSWER)  # raw: no template, no parsing
    r = httpx.post(url + "/api/generate", json={"model": NAME, "prompt": "x", "raw": True, "stream": False},
                   timeout=60).json()
    assert "thinking" not in r and THOUGHT in r["response"]


# ---- the prompt: history, think, reasoning_effort -------------------------------------------------
def test_reasoning_and_calls_of_the_history_render(play):
    url, svc, set_ = play
    set_(ANSWER)
    turns = ASK + [{"role": "assistant", "content": None, "reasoning_content": "Weather tool.", "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}]
    client(url).chat.completions.create(model=NAME, messages=turns, tools=TOOLS)
    prompt = svc.engine.tokenizer.decode(svc.scheduler.adapter.prompts[-1])
    assert prompt.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Weather tool.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
        "<|start|>assistant"), prompt[-400:]
    # Ollama's shape (thinking, tool_name) gives the same prompt
    set_(ANSWER)
    oturns = ASK + [{"role": "assistant", "content": "", "thinking": "Weather tool.", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_name": "get_weather", "content": "sunny"}]
    ollama.Client(host=url).chat(model=NAME, messages=oturns, tools=TOOLS)
    assert svc.scheduler.adapter.prompts[-1] == svc.scheduler.adapter.prompts[-2]


def test_think_and_reasoning_effort_reach_the_template(play):
    url, svc, set_ = play
    prompt = lambda: svc.engine.tokenizer.decode(svc.scheduler.adapter.prompts[-1])  # noqa: E731
    for level in ("low", "high"):
        set_(ANSWER)
        r = ollama.Client(host=url).chat(model=NAME, messages=ASK, think=level)
        assert "Reasoning: " + level in prompt() and r.message.thinking == THOUGHT
        set_(ANSWER)
        client(url).chat.completions.create(model=NAME, messages=ASK, reasoning_effort=level)
        assert "Reasoning: " + level in prompt()
    for think in (True, False):  # gpt-oss reasons either way; its thinking comes back (as Ollama's)
        set_(ANSWER)
        r = ollama.Client(host=url).chat(model=NAME, messages=ASK, think=think)
        assert "Reasoning: medium" in prompt() and r.message.thinking == THOUGHT
    for api, body, words in (("/api/chat", {"think": "max"}, "invalid think value"),
                             ("/api/generate", {"think": "loud", "prompt": "x"}, "invalid think value"),
                             ("/v1/chat/completions", {"reasoning_effort": 3}, "reasoning_effort")):
        r = httpx.post(url + api, json={"model": NAME, "messages": ASK, "stream": False, **body}, timeout=30)
        assert r.status_code == 400 and words in r.text, r.text


# ---- the real model under the grammar, the card ---------------------------------------------------
def test_a_forced_call_runs_the_model_under_the_harmony_grammar(play):
    url, svc, set_ = play
    set_(None)
    r = client(url).chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, temperature=0, max_tokens=120,
                                            tool_choice={"type": "function", "function": {"name": "get_time"}})
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")


def test_show_lists_thinking_and_tools(server):
    url, _ = server
    caps = httpx.post(url + "/api/show", json={"model": NAME}).json()["capabilities"]
    assert caps == ["completion", "tools", "thinking"]


# ---- the shapes, through the formats alone ---------------------------------------------------------
def test_the_shapes_of_reasoning_content_and_calls():
    from types import SimpleNamespace

    from gguf_runtime.format.tool_calls import HarmonyParser
    from gguf_runtime.server.formats import OllamaChat, OllamaGenerate, OpenAIChat

    job = SimpleNamespace(reason="stop", t_submit=0.0, t_admit=0.1, t_first=0.2, t_end=0.3, prompt_eval=5,
                          ids=[1, 2, 3], prompt=[7] * 5)
    pieces = [A, "Hm", "m.<|end|><|start|>assistant", '<|channel|>commentary to=functions.get_time json<|message|>',
              '{"zone": "UTC"}']
    fmt = OpenAIChat(NAME, False, HarmonyParser(["get_time"]))
    sse = "".join(fmt.chunk(p) for p in pieces) + fmt.final(job, 0.0)
    deltas = [json.loads(x[6:])["choices"][0]["delta"] for x in sse.split("\n\n") if x.startswith("data: {")]
    assert deltas[:2] == [{"role": "assistant", "content": None, "reasoning_content": "Hm"},
                          {"reasoning_content": "m."}]
    assert deltas[2]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    assert deltas[3] == {} and json.loads(sse.split("\n\n")[-3][6:])["choices"][0]["finish_reason"] == "tool_calls"
    fmt = OllamaChat(NAME, HarmonyParser(["get_time"]))
    lines = [json.loads(x) for p in pieces for x in fmt.chunk(p).splitlines()]
    lines += [json.loads(x) for x in fmt.final(job, 0.0).splitlines()]
    assert [x["message"] for x in lines] == [
        {"role": "assistant", "content": "", "thinking": "Hm"}, {"role": "assistant", "content": "", "thinking": "m."},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_time",
                                                                          "arguments": {"zone": "UTC"}}}]},
        {"role": "assistant", "content": ""}]
    whole = OllamaGenerate(NAME, HarmonyParser(calls=False)).whole("".join(pieces), job, 0.0)
    assert (whole["thinking"], whole["response"]) == ("Hmm.", '{"zone": "UTC"}')
    whole = OpenAIChat(NAME, False, HarmonyParser()).whole(A + "Hmm.", job, 0.0)["choices"][0]
    assert whole["message"] == {"role": "assistant", "content": "", "reasoning_content": "Hmm."}
    assert whole["finish_reason"] == "stop"
