"""The grammar of a forced tool call (OpenAI's ``tool_choice: "required"`` or a named function):
the answer is a call in the syntax of the model's family (format/tool_calls.py), its name one of
the allowed tools and its arguments valid under that tool's ``parameters`` schema, then nothing
else (the end of generation).

Markers that are special tokens of the vocabulary (Mistral's ``[TOOL_CALLS]``, Llama's
``<|python_tag|>``) are matched as those tokens; ``marker_ids`` names them so the text decoder
shows them (a server skips special tokens otherwise, and the parser needs them). Harmony's (gpt-oss)
call is ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}``, as OpenAI's
Harmony guide writes it; a complete call leaves only end-of-generation tokens (the model's
``<|call|>``). Its markers (``<|channel|>`` ...) are user-defined tokens once the tokenizer has
fixed them up (llama.cpp's rule), text that the grammar matches by their bytes. A thinking
template's ``<think>`` and ``</think>`` are shown too where they are special (``think_ids``).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from ..errors import GrammarError
from ..format.tokenizer import Tokenizer
from ..format.tool_calls import (ARGS, CALL_ID, CHANNEL, CONSTRAIN, FAMILIES, HARMONY_MARKERS, MESSAGE, PYTHON_TAG,
                                 THINK, THINK_END, TOOL_CALL, TOOL_CALLS)
from .constraint import COMPACT, closed_objects, compile_grammar

__all__ = ["marker_ids", "think_ids", "tool_call_grammar"]


def marker_ids(tok: Tokenizer, family: str) -> frozenset[int]:
    """The special tokens of ``tok`` that spell a tool-call marker of ``family`` (Harmony: each of its
    markers the vocabulary has, control or user-defined)."""
    if family == "harmony":
        return frozenset(i for i in (tok.token_to_id.get(t) for t in HARMONY_MARKERS) if i is not None)
    texts = {"hermes": (TOOL_CALL, "</tool_call>"), "generic": (TOOL_CALL, "</tool_call>"),
             "llama3": (PYTHON_TAG,), "mistral": (TOOL_CALLS,),
             "mistral_args": (TOOL_CALLS, ARGS, CALL_ID)}.get(family, ())
    ids = (tok.token_to_id.get(t) for t in texts)
    return frozenset(i for i in ids if i is not None and tok.is_control(i))


def think_ids(tok: Tokenizer) -> frozenset[int]:
    """The control tokens of ``tok`` that spell ``<think>`` or ``</think>``: the decoder would hide
    them, and the reasoning would run into the answer with nothing to tell them apart (Qwen3's and
    DeepSeek-R1's vocabularies have them as user-defined tokens, shown anyway)."""
    ids = (tok.token_to_id.get(t) for t in (THINK, THINK_END))
    return frozenset(i for i in ids if i is not None and tok.is_control(i))


def _lit(tok: Tokenizer | None, text: str) -> str:
    """A marker in Lark: its special token when the vocabulary has one, else the text."""
    tid = tok.token_to_id.get(text) if tok is not None else None
    if tid is not None and tok.is_control(tid):
        return f"<[{tid}]>"
    return json.dumps(text)


def _json(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": COMPACT}, ensure_ascii=False)


def _params(fn: dict) -> dict:
    p = fn.get("parameters")
    return closed_objects(p) if isinstance(p, dict) and p else {"type": "object", "additionalProperties": False}


def tool_call_grammar(family: str, tools: Sequence[dict], name: str | None = None,
                      tok: Tokenizer | None = None, parallel: bool = True) -> str:
    """The compiled grammar: a call to ``name`` (or to any of ``tools`` when None); several calls in a
    row when ``parallel`` and the family writes several. ``tools`` are OpenAI-style items
    ``{"type": "function", "function": {"name", "parameters"}}``. Raises GrammarError naming the
    tool whose parameters schema cannot be used."""
    if family not in FAMILIES:
        raise GrammarError(f"unknown tool-call family {family!r}")
    fns = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not fns:
        raise GrammarError(f"no tool named {name!r} to call")
    for fn in fns:  # each schema alone first: an error names its tool
        try:
            compile_grammar("json_schema", _params(fn))
        except GrammarError as e:
            raise GrammarError(f"tool {fn['name']!r}: its parameters schema cannot constrain a call ({e})") from None
    key = "parameters" if family == "llama3" else "arguments"

    def call(fn: dict) -> dict:
        return {"type": "object", "properties": {"name": {"const": fn["name"]}, key: _params(fn)},
                "required": ["name", key], "additionalProperties": False}

    one: dict[str, Any] = call(fns[0]) if len(fns) == 1 else {"anyOf": [call(f) for f in fns]}
    if family == "hermes":
        rules = ['start: call ("\\n" call)*' if parallel else "start: call",
                 f'call: {_lit(tok, TOOL_CALL)} "\\n" body "\\n" {_lit(tok, "</tool_call>")}', f"body: {_json(one)}"]
    elif family in ("llama3", "generic"):  # one bare JSON call
        rules = ["start: body", f"body: {_json(one)}"]
    elif family == "harmony":  # one call: <|call|> ends the generation
        alts = " | ".join(f'{json.dumps("commentary to=functions." + f["name"])} " " {_lit(tok, CONSTRAIN)} "json" '
                          f'{_lit(tok, MESSAGE)} a{i}' for i, f in enumerate(fns))
        rules = [f"start: {_lit(tok, CHANNEL)} ({alts})"] + [f"a{i}: {_json(_params(f))}" for i, f in enumerate(fns)]
    elif family == "mistral":
        arr = {"type": "array", "items": one, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        rules = [f"start: {_lit(tok, TOOL_CALLS)} body", f"body: {_json(arr)}"]
    else:  # mistral_args: [TOOL_CALLS]name[ARGS]{...} for each call
        alts = " | ".join(f"{json.dumps(f['name'])} {_lit(tok, ARGS)} a{i}" for i, f in enumerate(fns))
        rules = ["start: call+" if parallel else "start: call", f"call: {_lit(tok, TOOL_CALLS)} ({alts})"]
        rules += [f"a{i}: {_json(_params(f))}" for i, f in enumerate(fns)]
    return compile_grammar("lark", "\n".join(rules) + "\n")
