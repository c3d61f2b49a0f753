"""Tool calling in a chat request (Ollama /api/chat, OpenAI /v1/chat/completions): the checked
``tools`` and ``tool_choice``, the messages' tool calls and tool results in the shape chat
templates read, and what a response needs to parse the answer (``ToolSetup``).

Both APIs send tools as ``{"type": "function", "function": {"name", "description", "parameters"}}``;
that is also what templates expect as their ``tools`` variable. Assistant messages carry
``tool_calls`` (OpenAI: ``arguments`` a JSON string, with an ``id``; Ollama: an object, no id) and
results come back as ``tool`` messages (OpenAI: ``tool_call_id``; Ollama: ``tool_name``); both
become ``{"id", "type": "function", "function": {"name", "arguments": object}}`` calls and tool
messages with ``tool_call_id`` and ``name``, paired by id, else by name, else in order. Mistral's
templates take only 9-character alphanumeric ids: other ids are mapped to such (the same id always
to the same one).

``tool_choice`` (OpenAI's; accepted on /api/chat too): "auto" (the default), "none" (the tools are
not shown to the model and no call is parsed), "required" or ``{"type": "function", "function":
{"name"}}``: the answer is constrained to a call (engine/tool_grammar.py): one call of the named
function; one or more calls for "required" (one when ``parallel_tool_calls`` is false). A model whose template
has no tools answers 400 "<model> does not support tools", as Ollama does.

A Harmony template (gpt-oss) has its answers parsed whatever the request (ToolSetup.parser: the
reasoning and the markers never reach content; calls only where tools were offered), and its
markers shown by the text decoder (ToolSetup.keep). So does a thinking template's (Qwen3,
DeepSeek-R1: chat_template.thinking_template): its ``<think>`` block is the reasoning, what follows
it the answer and its calls; whether the prompt already opened the block is known once the prompt
is rendered (ToolSetup.prompt). An assistant message's reasoning (Ollama's
``thinking``, OpenAI-style ``reasoning_content``) reaches the template as ``thinking``
(chat_template aliases it as ``reasoning_content`` too); for Harmony, ``harmony_history`` puts a
message of several calls as one message a call, each followed by its result, as the template (one
call a message) expects.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

from ..engine.tool_grammar import marker_ids, think_ids, tool_call_grammar
from ..errors import GrammarError
from ..format.tool_calls import (HarmonyParser, ThinkParser, ToolCall, ToolCallParser, chat_answer_parser,
                                 ids_open_thinking, template_family)
from .schemas import bad

MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
_ALNUM = string.ascii_letters + string.digits
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def call_id() -> str:
    """A fresh OpenAI-style call id."""
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


# ---- tools and tool_choice ------------------------------------------------------------------------
def tools_of(v: Any) -> list[dict]:
    """The request's ``tools``, checked: a list of function tools with distinct names."""
    if v is None:
        return []
    if not isinstance(v, list):
        raise bad('tools must be a list of {"type": "function", "function": {"name", "parameters"}} objects')
    if len(v) > MAX_TOOLS:
        raise bad(f"tools has {len(v)} items; at most {MAX_TOOLS} are accepted")
    out, seen = [], set()
    for i, t in enumerate(v):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad(f'{where} must be an object {{"type": "function", "function": {{...}}}}')
        if t.get("type", "function") != "function":
            raise bad(f'{where}.type must be "function", got {json.dumps(t.get("type"))[:60]}')
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise bad(f'{where}.function must be an object with a name (and description, parameters)')
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad(f"{where}.function.name must be 1 to 128 letters, digits, or _ . : -, "
                      f"got {json.dumps(name)[:80]}")
        if name in seen:
            raise bad(f"{where}.function.name {name!r} is given twice; tool names must be distinct")
        seen.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise bad(f"{where}.function.description must be a string")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad(f"{where}.function.parameters must be a JSON schema object")
        out.append({**t, "type": "function", "function": fn})
    return out


def choice_of(v: Any, tools: list[dict]) -> tuple[str, str | None]:
    """(mode, name): mode "auto", "none", "required" or "function" (name set)."""
    if v is None or v == "auto":
        return "auto", None
    if v in ("none", "required"):
        if v == "required" and not tools:
            raise bad('tool_choice "required" needs tools: give the tools the answer must call')
        return v, None
    if isinstance(v, dict) and v.get("type", "function") == "function" and isinstance(v.get("function"), dict):
        name = v["function"].get("name")
        names = [t["function"]["name"] for t in tools]
        if not isinstance(name, str) or name not in names:
            raise bad(f"tool_choice.function.name {json.dumps(name)[:80]} is not one of the tools "
                      f"({', '.join(names)[:200] or 'none given'})")
        return "function", name
    raise bad('tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}')


# ---- messages -----------------------------------------------------------------------------------
def _arguments(v: Any, where: str) -> dict:
    if v is None or v == "":
        return {}
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except (ValueError, RecursionError):
            raise bad(f"{where} must be a JSON object (or its text), got text that is not JSON") from None
    if not isinstance(v, dict):
        raise bad(f"{where} must be a JSON object, got {type(v).__name__}")
    return v


def message_tool_fields(m: dict, i: int) -> dict:
    """The tool fields of chat message ``i``, checked: an assistant's ``tool_calls``, a tool result's
    ``tool_call_id`` and ``name`` (OpenAI) or ``tool_name`` (Ollama); and an assistant's reasoning
    (``thinking``, Ollama's; ``reasoning_content``, llama.cpp's and vLLM's) as ``thinking``."""
    out: dict = {}
    for key in ("thinking", "reasoning_content"):
        v = m.get(key)
        if v is not None and not isinstance(v, str):
            raise bad(f"messages[{i}].{key} must be a string")
        if v and "thinking" not in out:
            out["thinking"] = v
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise bad(f"messages[{i}].tool_calls must be a list of calls")
        norm = []
        for j, c in enumerate(calls):
            where = f"messages[{i}].tool_calls[{j}]"
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise bad(f'{where} must be {{"function": {{"name": ..., "arguments": {{...}}}}}}')
            cid = c.get("id")
            if cid is not None and not isinstance(cid, str):
                raise bad(f"{where}.id must be a string")
            norm.append({"id": cid or None, "type": "function",
                         "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments"),
                                                                                  where + ".function.arguments")}})
        if norm:
            out["tool_calls"] = norm
    for key in ("tool_call_id", "tool_name", "name"):
        v = m.get(key)
        if v is not None and not isinstance(v, str):
            raise bad(f"messages[{i}].{key} must be a string")
        if v:
            out[key] = v
    return out


def _mistral_id(cid: str) -> str:
    if _MISTRAL_ID.fullmatch(cid):
        return cid
    h = int.from_bytes(hashlib.sha256(cid.encode()).digest()[:8], "big")
    return "".join(_ALNUM[(h // 62 ** k) % 62] for k in range(9))


def link_calls(msgs: list[dict], family: str) -> list[dict]:
    """Every call with an id and every tool result with the id and name of its call (see the module)."""
    out, pending, n = [], [], 0
    fix = _mistral_id if family.startswith("mistral") else (lambda s: s)
    for m in msgs:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                n += 1
                cid = fix(c["id"] or f"call{n:05d}")  # 9 letters and digits: any template takes it
                calls.append({**c, "id": cid})
            m["tool_calls"] = calls
            pending = [(c["id"], c["function"]["name"]) for c in calls]
        elif m["role"] == "tool":
            name = m.pop("tool_name", None) or m.get("name")
            cid = m.get("tool_call_id")
            hit = next((p for p in pending if cid is not None and p[0] == fix(cid)), None) if cid else None
            hit = hit or next((p for p in pending if name and p[1] == name), None) or (pending[0] if pending else None)
            if hit is not None:
                pending.remove(hit)
            if cid:
                m["tool_call_id"] = fix(cid)
            elif hit is not None:
                m["tool_call_id"] = hit[0]
            if name or hit is not None:
                m["name"] = name or hit[1]
        out.append(m)
    return out


def harmony_history(msgs: list[dict]) -> list[dict]:
    """Messages as the Harmony template takes them: an assistant message of several calls becomes
    one message a call, each followed by its result (paired by id, as link_calls left them); its
    reasoning goes with the first. An assistant message with calls may not carry both content and
    reasoning (the template refuses): its content joins the reasoning (both are the analysis)."""
    out: list[dict] = []
    i = 0
    while i < len(msgs):
        m = msgs[i]
        i += 1
        if m.get("role") != "assistant" or not m.get("tool_calls"):
            out.append(m)
            continue
        m = dict(m)
        if m.get("content") and m.get("thinking"):
            m["thinking"], m["content"] = m["thinking"] + "\n\n" + m["content"], ""
        calls = m["tool_calls"]
        if len(calls) == 1:
            out.append(m)
            continue
        results = []
        while i < len(msgs) and msgs[i].get("role") == "tool":
            results.append(msgs[i])
            i += 1
        for k, c in enumerate(calls):
            one = {**m, "tool_calls": [c]}
            if k:
                one.pop("thinking", None)
                one["content"] = ""
            out.append(one)
            mine = [r for r in results if r.get("tool_call_id") == c["id"]]
            out += mine
            results = [r for r in results if not any(r is x for x in mine)]
        out += results  # results no call claims stay, after the calls
    return out


# ---- the request --------------------------------------------------------------------------------


@dataclass
class ToolSetup:
    """What a chat request's tools mean for its prompt, its grammar and its answer."""

    tools: list[dict] = field(default_factory=list)  # for the template (empty: no tools shown)
    family: str = "generic"
    grammar: str | None = None  # a forced call's grammar
    keep: frozenset[int] = frozenset()  # special tokens the parser must see
    think: bool = False  # a thinking template's: the answer may open with a <think> block
    opened: bool = False  # the rendered prompt ended inside a think block (ToolSetup.prompt)

    def parser(self) -> ToolCallParser | HarmonyParser | ThinkParser | None:
        """The answer's parser: None when the answer is plain text (no tools, no reasoning to split)."""
        names = [t["function"]["name"] for t in self.tools]
        # (opened is asked at the first text: a stream's parser is made before its prompt is rendered)
        return chat_answer_parser(self.family, self.think, names, opened=lambda: self.opened)

    def prompt(self, ids: list[int], tok, constrained: bool) -> list[int]:
        """The rendered prompt's ``ids``, noting whether the answer starts inside a think block: the
        prompt ends with ``<think>`` and no grammar constrains the answer (``constrained``: a
        grammar's answer is its own from the first token, reasoning it has none)."""
        if self.think and not constrained:
            self.opened = ids_open_thinking(ids, tok)
        return ids


def generate_setup(engine) -> ToolSetup:
    """The ToolSetup of a templated /api/generate answer: no tools (generate offers none), the
    reasoning apart from the response for a Harmony or a thinking template."""
    family = template_family(engine.template.source)
    keep = marker_ids(engine.tokenizer, family) if family == "harmony" else frozenset()
    return _thinking(ToolSetup(family=family, keep=keep), engine)


def _thinking(ts: ToolSetup, engine) -> ToolSetup:
    """``ts`` for a thinking template: its <think> block split from the answer, its tags shown
    (Harmony has its own reasoning)."""
    if ts.family != "harmony" and engine.template.supports_thinking:
        ts.think, ts.keep = True, ts.keep | think_ids(engine.tokenizer)
    return ts


def setup(body: dict, engine, model: str, msgs: list[dict]) -> tuple[ToolSetup, list[dict]]:
    """The request's ToolSetup and its messages as the template reads them."""
    template = engine.template
    tools = tools_of(body.get("tools"))
    mode, name = choice_of(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("parallel_tool_calls must be true or false")
    family = template_family(template.source)
    msgs = link_calls(msgs, family)
    keep = frozenset()
    if family == "harmony":
        msgs = harmony_history(msgs)
        keep = marker_ids(engine.tokenizer, family)
    if not tools or mode == "none":
        return _thinking(ToolSetup(family=family, keep=keep), engine), msgs
    if not template.supports_tools:
        raise bad(f"{model} does not support tools (its chat template has no tools); leave tools out, "
                  "or serve a model whose template takes them")
    grammar = None
    if mode in ("required", "function"):
        try:
            grammar = tool_call_grammar(family, tools, name, engine.tokenizer, parallel and mode == "required")
        except GrammarError as e:
            raise bad(f"tools cannot be forced with tool_choice {mode!r}: {e}") from None
    return _thinking(ToolSetup(tools, family, grammar, keep | marker_ids(engine.tokenizer, family)), engine), msgs


# ---- answers ------------------------------------------------------------------------------------
def openai_call(call: ToolCall, index: int | None = None) -> dict:
    out = {"id": call_id(), "type": "function",
           "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
    return out if index is None else {"index": index, **out}


def ollama_call(call: ToolCall) -> dict:
    return {"function": {"name": call.name, "arguments": call.arguments}}
