"""Tool calling through `gguf-run serve` (issue 35 item 2), on micro models with a real vocabulary
(Qwen2's) and random weights, numpy backend: the Qwen3 template (tests/data/chat_templates) for a
model with tools, the vocabulary's own Qwen2 template (no tools) for one without.

A forced call (tool_choice: a named function, or "required") comes back as a parsed call through
the OpenAI API (the official client; streamed chunks accumulated by the client's own stream state)
and the Ollama API, streamed and not, with valid arguments; tool results render into the prompt;
the response shapes of calls mixed with text (tool_choice "auto", fed through the formats); a
model without tools answers 400 "does not support tools"; junk tools and tool choices are 400s
naming the field."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
jsonschema = pytest.importorskip("jsonschema")

from gguf_runtime.engine.engine import Engine  # noqa: E402
from gguf_runtime.format.tool_calls import ToolCallParser  # noqa: E402
from gguf_runtime.server import schemas as S  # noqa: E402
from gguf_runtime.server import tools as T  # noqa: E402
from gguf_runtime.server.adapters import make_adapter  # noqa: E402
from gguf_runtime.server.app import Service  # noqa: E402
from live_server import live  # noqa: E402
from gguf_runtime.server.formats import OllamaChat, OpenAIChat  # noqa: E402

from micro_models import Micro, write_micro  # noqa: E402

NAME, PLAIN = "qwentools", "plainmodel"
QWEN3 = open(os.path.join(os.path.dirname(__file__), "data", "chat_templates", "qwen3.jinja"), encoding="utf-8").read()
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "required": ["city", "days"], "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
SCHEMA = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris for two days?"}]
PICK = {"type": "function", "function": {"name": "get_weather"}}
GREEDY = {"temperature": 0, "max_tokens": 80}


@contextmanager
def serve(path, name):
    svc = Service(lambda: make_adapter(Engine(path, backend="numpy", n_ctx=1024)), name=name).start()
    with live(svc) as url:
        yield url, svc


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("tools")
    path = write_micro(Micro(arch="qwen2", vocab="qwen2", n_vocab=None, seed=5, chat_template=QWEN3), d / "q.gguf")
    with serve(path, NAME) as s:
        yield s


@pytest.fixture(scope="module")
def url(server):
    return server[0]


@pytest.fixture(scope="module")
def plain_url(tmp_path_factory):
    d = tmp_path_factory.mktemp("plain")
    path = write_micro(Micro(arch="qwen2", vocab="qwen2", n_vocab=None, seed=6), d / "p.gguf")
    with serve(path, PLAIN) as (u, _):
        yield u


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def valid(name, arguments, want=None):
    assert name in SCHEMA and (want is None or name == want)
    jsonschema.validate(arguments, SCHEMA[name])
    assert set(arguments) <= set(SCHEMA[name]["properties"])


# ---- forced calls ---------------------------------------------------------------------------------
def test_openai_named_call_whole_and_streamed(url):
    c = client(url)
    r = c.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice=PICK, **GREEDY)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 12
    args = json.loads(call.function.arguments)
    valid(call.function.name, args, "get_weather")

    chunks = list(c.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice=PICK, stream=True,
                                            **GREEDY))
    assert not any(k.choices and k.choices[0].delta.content for k in chunks), "call text streamed as content"
    deltas = [tc for k in chunks if k.choices for tc in (k.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].id.startswith("call_")
    assert deltas[0].type == "function" and deltas[0].function.name == "get_weather"
    assert json.loads(deltas[0].function.arguments) == args  # greedy: the same call
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    state = openai.lib.streaming.chat.ChatCompletionStreamState(input_tools=TOOLS)  # the client's own accumulator
    for k in chunks:
        state.handle_chunk(k)
    done = state.get_final_completion().choices[0]
    assert done.finish_reason == "tool_calls" and done.message.role == "assistant"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in done.message.tool_calls] == \
        [("get_weather", args)]


def test_openai_required_call(url):
    r = client(url).chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, **GREEDY)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    valid(ch.message.tool_calls[0].function.name, json.loads(ch.message.tool_calls[0].function.arguments))


def test_ollama_named_call_whole_and_streamed(url):
    body = {"model": NAME, "messages": ASK, "tools": TOOLS, "tool_choice": PICK,
            "options": {"temperature": 0, "num_predict": 80}}
    r = httpx.post(url + "/api/chat", json={**body, "stream": False}, timeout=60)
    assert r.status_code == 200, r.text
    resp = ollama.ChatResponse(**r.json())  # the client's own model of the answer
    assert resp.done and resp.done_reason == "stop" and resp.message.content == ""
    (call,) = resp.message.tool_calls
    assert isinstance(call.function.arguments, dict)
    valid(call.function.name, dict(call.function.arguments), "get_weather")

    with httpx.stream("POST", url + "/api/chat", json=body, timeout=60) as s:
        lines = [json.loads(x) for x in s.iter_lines() if x.strip()]
    assert all(x["message"]["content"] == "" for x in lines), "call text streamed as content"
    with_calls = [x for x in lines if x["message"].get("tool_calls")]
    assert len(with_calls) == 1 and not with_calls[0]["done"] and lines[-1]["done"]
    assert with_calls[0]["message"]["tool_calls"] == [{"function": {"name": "get_weather",
                                                                    "arguments": dict(call.function.arguments)}}]


def test_ollama_required_call_with_the_client(url):
    # the ollama client has no tool_choice; "required" rides in the body through httpx, the answer parses
    r = httpx.post(url + "/api/chat", json={"model": NAME, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
                                            "stream": False, "options": {"temperature": 0, "num_predict": 120}},
                   timeout=60)
    (call,) = ollama.ChatResponse(**r.json()).message.tool_calls[:1]
    valid(call.function.name, dict(call.function.arguments))


def test_tool_results_render_into_the_prompt(server):
    url, svc = server
    turns = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 23 degrees"}]
    r = client(url).chat.completions.create(model=NAME, messages=turns, tools=TOOLS, temperature=0, max_tokens=1)
    msgs = T.link_calls(S.messages(turns, T.message_tool_fields), "hermes")
    want = svc.engine.encode_chat(msgs, tools=TOOLS)
    assert r.usage.prompt_tokens == len(want)
    text = svc.engine.tokenizer.decode(want)
    assert "<tool_response>\nsunny, 23 degrees\n</tool_response>" in text and "Current weather of a city" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>' in text
    # Ollama's shape of the same conversation gives the same prompt
    oturns = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "tool_name": "get_weather", "content": "sunny, 23 degrees"}]
    r = httpx.post(url + "/api/chat", json={"model": NAME, "messages": oturns, "tools": TOOLS, "stream": False,
                                            "options": {"temperature": 0, "num_predict": 1}}, timeout=60)
    assert r.json()["prompt_eval_count"] <= len(want)  # what the prefix cache left to evaluate
    oprompt = svc.engine.encode_chat(T.link_calls(S.messages(oturns, T.message_tool_fields), "hermes"), tools=TOOLS)
    assert oprompt == want


def test_show_names_the_tools_capability(url, plain_url):
    assert "tools" in httpx.post(url + "/api/show", json={"model": NAME}).json()["capabilities"]
    assert httpx.post(plain_url + "/api/show", json={"model": PLAIN}).json()["capabilities"] == ["completion"]


# ---- answers with calls and text (tool_choice auto), through the formats ---------------------------
ANSWER = ['I will check. <tool',
          '_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n<tool_call>',
          '\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>']
JOB = SimpleNamespace(reason="stop", t_submit=0.0, t_admit=0.1, t_first=0.2, t_end=0.3, prompt_eval=5, ids=[1, 2, 3],
                      prompt=[7] * 5)


def test_ollama_shapes_of_calls_and_text():
    fmt = OllamaChat(NAME, ToolCallParser("hermes", ["get_time", "get_weather"]))
    lines = [json.loads(x) for piece in ANSWER for x in fmt.chunk(piece).splitlines()]
    lines += [json.loads(x) for x in fmt.final(JOB, 0.0).splitlines()]
    assert [x["message"]["content"] for x in lines] == ["I will check.", "", "", ""]
    assert [x["message"].get("tool_calls") for x in lines] == [
        None, [{"function": {"name": "get_time", "arguments": {"zone": "UTC"}}}],
        [{"function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}}], None]
    assert [x["done"] for x in lines] == [False, False, False, True]
    whole = OllamaChat(NAME, ToolCallParser("hermes", ["get_time", "get_weather"])).whole("".join(ANSWER), JOB, 0.0)
    assert whole["message"]["content"] == "I will check." and len(whole["message"]["tool_calls"]) == 2


def test_openai_shapes_of_calls_and_text():
    fmt = OpenAIChat(NAME, False, ToolCallParser("hermes", ["get_time", "get_weather"]))
    sse = "".join(fmt.chunk(p) for p in ANSWER) + fmt.final(JOB, 0.0)
    events = [json.loads(x[6:]) for x in sse.split("\n\n") if x.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": "I will check."}
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [c["index"] for c in calls] == [0, 1] and len({c["id"] for c in calls}) == 2
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "days": 3})]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    whole = OpenAIChat(NAME, False, ToolCallParser("hermes", ["get_time"])).whole("".join(ANSWER), JOB, 0.0)
    msg = whole["choices"][0]["message"]
    assert msg["content"] == "I will check." and whole["choices"][0]["finish_reason"] == "tool_calls"
    assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == [{"zone": "UTC"},
                                                                                    {"city": "Oslo", "days": 3}]
    cut = SimpleNamespace(**{**vars(JOB), "reason": "length"})  # a call cut short stays text; the reason says why
    w = OpenAIChat(NAME, False, ToolCallParser("hermes", ["get_time"])).whole(ANSWER[0] + ANSWER[1][:30], cut, 0.0)
    assert w["choices"][0]["finish_reason"] == "length" and "tool_calls" not in w["choices"][0]["message"]
    assert w["choices"][0]["message"]["content"] == ANSWER[0] + ANSWER[1][:30]


# ---- refusals -------------------------------------------------------------------------------------
def test_a_model_without_tools_says_so(plain_url):
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=plain_url).chat(model=PLAIN, messages=ASK, tools=TOOLS)
    assert e.value.status_code == 400 and f"{PLAIN}:latest does not support tools" in e.value.error
    with pytest.raises(openai.BadRequestError) as e:
        client(plain_url).chat.completions.create(model=PLAIN, messages=ASK, tools=TOOLS)
    assert "does not support tools" in e.value.message
    # without tools, or with tool_choice "none", the model answers
    r = client(plain_url).chat.completions.create(model=PLAIN, messages=ASK, tools=TOOLS, tool_choice="none",
                                                  max_tokens=2)
    assert r.choices[0].message.tool_calls is None


BAD = [  # body fields, a word the message must name
    ({"tools": "get_weather"}, "tools must be a list"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]}, "tools[0].function.description"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice must be"),
    ({"tool_choice": "required"}, 'tool_choice "required" needs tools'),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}}}}}],
      "tool_choice": "required"}, "tool 'f'"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [
        {"function": {"name": "get_time", "arguments": "{oops"}}]}], "tools": TOOLS},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"function": {}}]}]}, "messages[1].tool_calls[0]"),
    ({"messages": ASK + [{"role": "tool", "content": "x", "tool_call_id": 5}]}, "messages[1].tool_call_id"),
]


@pytest.mark.parametrize("fields,words", BAD)
@pytest.mark.parametrize("api", ["/api/chat", "/v1/chat/completions"])
def test_junk_tools_are_400s_naming_the_field(url, api, fields, words):
    r = httpx.post(url + api, json={"model": NAME, "messages": ASK, "stream": False, **fields}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    msg = err if api == "/api/chat" else err["message"]
    assert words in msg and "\n" not in msg, msg


def test_a_forced_call_and_a_format_at_once_is_a_400(url):
    r = httpx.post(url + "/api/chat", json={"model": NAME, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
                                            "format": "json", "stream": False})
    assert r.status_code == 400 and "tool_choice" in r.json()["error"] and "format" in r.json()["error"]
