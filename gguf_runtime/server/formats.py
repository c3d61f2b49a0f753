"""Response bodies, streamed and whole: Ollama NDJSON and OpenAI JSON / server-sent events.

A format object serves one request: ``chunk(text)`` and ``final(job, load_s)`` / ``error(msg,
status)`` give the stream's pieces (``str``), ``whole(text, job, load_s)`` the ``stream: false``
body (a dict). The chat formats take a tool-call parser (tools.ToolSetup.parser) when the request
has tools: text that may be a call is held back, and each call goes out as Ollama's
``message.tool_calls`` or OpenAI's ``tool_calls`` (``delta.tool_calls`` when streamed, then
``finish_reason: "tool_calls"``) once its text is complete. A Harmony model's (gpt-oss) answers
always go through its parser, and so do a thinking template's (Qwen3, DeepSeek-R1: ThinkParser): the
analysis channel, or the ``<think>`` block, becomes Ollama's ``message.thinking`` (/api/generate:
``thinking``) or OpenAI's ``message.reasoning_content`` (``delta.reasoning_content`` when streamed,
as llama.cpp and vLLM name it), streamed as it comes.

Log-probabilities (``with_logprobs``): the scheduler's ``("logprobs", entries)`` events reach
``logprobs(entries)`` and go out with the next piece of the stream (the last with the final
chunk): Ollama's ``logprobs`` list beside each chunk's text, OpenAI chat's
``choices[].logprobs.content``, /v1/completions' ``tokens``/``token_logprobs``/``top_logprobs``/
``text_offset``. Whole bodies take every token's entry from the job.
"""

from __future__ import annotations

import json
import secrets
import time
from json.encoder import encode_basestring as _str  # a JSON string as json.dumps(ensure_ascii=False) writes it

from ..format.tool_calls import HarmonyParser, Reasoning, ThinkParser, ToolCall, ToolCallParser
from . import schemas as S
from . import tools as T

Parser = ToolCallParser | HarmonyParser | ThinkParser


def _split(events: list) -> tuple[str, str, list[ToolCall]]:
    """(reasoning, content, calls) of events, each joined."""
    return ("".join(e.text for e in events if isinstance(e, Reasoning)),
            "".join(e for e in events if isinstance(e, str)), [e for e in events if isinstance(e, ToolCall)])


def _runs(events: list) -> list[str | Reasoning | list[ToolCall]]:
    """Events with adjacent ones of a kind joined: text, [calls], Reasoning, text..."""
    out: list = []
    for e in events:
        if isinstance(e, ToolCall):
            if out and isinstance(out[-1], list):
                out[-1].append(e)
            else:
                out.append([e])
        elif isinstance(e, Reasoning):
            if out and isinstance(out[-1], Reasoning):
                out[-1] = Reasoning(out[-1].text + e.text)
            elif e.text:
                out.append(e)
        elif e:
            if out and isinstance(out[-1], str):
                out[-1] += e
            else:
                out.append(e)
    return out


def _line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"


def _token(tok, tid: int, lp: float) -> dict:
    b = tok.token_to_bytes(tid)
    return {"token": b.decode("utf-8", "replace"), "logprob": lp, "bytes": list(b)}


def token_entry(tok, entry, always_top: bool = True) -> dict:
    """A token's entry as Ollama and OpenAI chat write it: token, logprob, bytes, top_logprobs
    (Ollama leaves an empty list out)."""
    tid, lp, top = entry
    alts = [_token(tok, i, v) for i, v in top]
    return {**_token(tok, tid, lp), **({"top_logprobs": alts} if alts or always_top else {})}


def completion_logprobs(tok, entries: list, offset: int = 0) -> tuple[dict, int]:
    """/v1/completions' logprobs object of ``entries`` whose text starts at character ``offset``,
    and the offset after them. Each top_logprobs dict holds the alternatives and the chosen token
    (as vLLM's do), keyed by text."""
    texts = [tok.token_to_piece(tid) for tid, _, _ in entries]
    offsets = []
    for t in texts:
        offsets.append(offset)
        offset += len(t)
    tops = []
    for (tid, lp, top), text in zip(entries, texts):
        d = {tok.token_to_piece(i): v for i, v in top}
        d.setdefault(text, lp)
        tops.append(d)
    return {"tokens": texts, "token_logprobs": [lp for _, lp, _ in entries], "top_logprobs": tops,
            "text_offset": offsets}, offset


class _Logprobs:
    """Entries waiting to go out with the next piece (with_logprobs: the request asked for them)."""

    lp_tok = None  # the tokenizer, when logprobs were asked for

    def with_logprobs(self, tokenizer, k: int):
        if k >= 0:
            self.lp_tok, self._lp = tokenizer, []
        return self

    def logprobs(self, entries: list) -> None:
        self._lp.extend(entries)

    def _take(self) -> list:
        out, self._lp = self._lp, []
        return out


def _sse(obj: dict | str) -> str:
    return "data: " + (obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False,
                                                                     separators=(",", ":"))) + "\n\n"


class OllamaGenerate(_Logprobs):
    media_type = "application/x-ndjson"
    key = "response"
    # a text chunk's line is built from strings (its fields as _line's json.dumps writes them): at 64
    # streams the event loop writes tens of thousands a second
    _open, _close = '"response":', ',"done":false}\n'

    def __init__(self, model: str, tools: Parser | None = None) -> None:
        self.model, self.tools = model, tools
        self._pre = '{"model":' + _str(model) + ',"created_at":"'

    def _piece(self, text: str, calls: list[ToolCall] | None = None, thinking: str = "") -> dict:
        return {self.key: text, **({"thinking": thinking} if thinking else {})}

    def _head(self) -> dict:
        return {"model": self.model, "created_at": S.now_rfc3339()}

    def _end(self, job, load_s: float) -> dict:
        return {**S.ollama_final(job, load_s), "context": list(job.prompt) + list(job.ids)}

    def _lps(self) -> dict:
        """Ollama's ``logprobs`` of the tokens not yet sent (none: no field)."""
        if self.lp_tok is None or not self._lp:
            return {}
        return {"logprobs": [token_entry(self.lp_tok, e, always_top=False) for e in self._take()]}

    def _events(self, events: list) -> str:
        return "".join(_line({**self._head(), **(self._piece(r) if isinstance(r, str) else self._piece(
            "", thinking=r.text) if isinstance(r, Reasoning) else self._piece("", r)), **self._lps(), "done": False})
            for r in _runs(events))

    def chunk(self, text: str) -> str:
        if self.tools is not None:
            return self._events(self.tools.feed(text))
        if self.lp_tok is None:
            return self._pre + S.now_rfc3339() + '",' + self._open + _str(text) + self._close
        return _line({**self._head(), **self._piece(text), **self._lps(), "done": False})

    def final(self, job, load_s: float) -> str:
        return (("" if self.tools is None else self._events(self.tools.finish()))
                + _line({**self._head(), **self._piece(""), **self._lps(), **self._end(job, load_s)}))

    def _all_lps(self, job) -> dict:
        """A whole body's ``logprobs``: every token's."""
        if self.lp_tok is not None:
            self._lp = list(job.logprobs_seen)
        return self._lps()

    def error(self, msg: str, status: int) -> str:
        return _line({"error": msg})

    def whole(self, text: str, job, load_s: float) -> dict:
        if self.tools is None:
            return {**self._head(), **self._piece(text), **self._all_lps(job), **self._end(job, load_s)}
        thinking, content, calls = _split(self.tools.feed(text) + self.tools.finish())
        return {**self._head(), **self._piece(content, calls, thinking), **self._all_lps(job), **self._end(job, load_s)}


class OllamaChat(OllamaGenerate):
    _open, _close = '"message":{"role":"assistant","content":', '},"done":false}\n'

    def _piece(self, text: str, calls: list[ToolCall] | None = None, thinking: str = "") -> dict:
        msg: dict = {"role": "assistant", "content": text}
        if thinking:
            msg["thinking"] = thinking
        if calls:
            msg["tool_calls"] = [T.ollama_call(c) for c in calls]
        return {"message": msg}

    def _end(self, job, load_s: float) -> dict:
        return S.ollama_final(job, load_s)


class OpenAIChat(_Logprobs):
    """/v1/chat/completions: ``chat.completion`` or ``chat.completion.chunk`` events."""

    media_type = "text/event-stream"
    prefix, obj = "chatcmpl-", "chat.completion"

    def __init__(self, model: str, include_usage: bool = False, tools: Parser | None = None) -> None:
        self.model, self.usage, self.tools = model, include_usage, tools
        self.id = self.prefix + secrets.token_hex(12)
        self.created = int(time.time())
        self.index = 0  # the choice this formats (several streamed: one formatter each, one id)
        self._pre: str | None = None  # a text chunk's start (_text_chunk)
        self._first = True
        self._calls = 0  # tool calls sent so far

    def as_choice(self, index: int, first: "OpenAIChat") -> "OpenAIChat":
        """This formatter as choice ``index`` of the stream ``first`` began (its id and time)."""
        self.index, self.id, self.created = index, first.id, first.created
        return self

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": "fp_gguf_run"}

    def _lps(self) -> dict:
        """The choice's ``logprobs`` of the tokens not yet sent (a request without them: no field)."""
        if self.lp_tok is None:
            return {}
        entries = self._take()
        return {"logprobs": {"content": [token_entry(self.lp_tok, e) for e in entries]} if entries else None}

    def _choice(self, text: str | None, reason: str | None) -> dict:
        delta: dict = {} if text is None else {"content": text}
        if self._first and text is not None:
            delta, self._first = {"role": "assistant", **delta}, False
        return {"index": self.index, "delta": delta, **self._lps(), "finish_reason": reason}

    def _text_chunk(self, text: str) -> str:
        if not self._first and self.lp_tok is None:  # (as _sse would write it, from strings)
            if self._pre is None:
                self._pre = "data: " + json.dumps(self._base(self.obj + ".chunk"), ensure_ascii=False,
                                                  separators=(",", ":"))[:-1] + ',"choices":[{"index":' + \
                    str(self.index) + ',"delta":{"content":'
            return self._pre + _str(text) + '},"finish_reason":null}]}\n\n'
        return _sse({**self._base(self.obj + ".chunk"), "choices": [self._choice(text, None)]})

    def _reasoning_chunk(self, text: str) -> str:
        delta: dict = {"reasoning_content": text}
        if self._first:
            delta, self._first = {"role": "assistant", "content": None, **delta}, False
        return _sse({**self._base(self.obj + ".chunk"),
                     "choices": [{"index": self.index, "delta": delta, **self._lps(), "finish_reason": None}]})

    def _calls_chunk(self, calls: list[ToolCall]) -> str:
        delta: dict = {"tool_calls": [T.openai_call(c, self._calls + k) for k, c in enumerate(calls)]}
        self._calls += len(calls)
        if self._first:
            delta, self._first = {"role": "assistant", "content": None, **delta}, False
        return _sse({**self._base(self.obj + ".chunk"),
                     "choices": [{"index": self.index, "delta": delta, **self._lps(), "finish_reason": None}]})

    def _events(self, events: list) -> str:
        return "".join(self._text_chunk(r) if isinstance(r, str) else self._reasoning_chunk(r.text)
                       if isinstance(r, Reasoning) else self._calls_chunk(r) for r in _runs(events))

    def _reason(self, job, calls: int) -> str:
        return "tool_calls" if calls and job.reason == "stop" else job.reason

    def chunk(self, text: str) -> str:
        return self._text_chunk(text) if self.tools is None else self._events(self.tools.feed(text))

    def final(self, job, load_s: float) -> str:
        return self.end(job) + self.tail(S.openai_usage(job))

    def end(self, job) -> str:
        """The choice's last chunks: what the tool parser held back, and its finish_reason."""
        out = "" if self.tools is None else self._events(self.tools.finish())
        if self._first:  # nothing was generated: still say who speaks
            out += self._text_chunk("")
        end = self._choice(None, self._reason(job, self._calls))
        return out + _sse({**self._base(self.obj + ".chunk"), "choices": [end]})

    def tail(self, usage: dict) -> str:
        """The stream's end: the usage chunk where asked for, then [DONE]."""
        out = _sse({**self._base(self.obj + ".chunk"), "choices": [], "usage": usage}) if self.usage else ""
        return out + _sse("[DONE]")

    def error(self, msg: str, status: int) -> str:
        kind = "invalid_request_error" if status < 500 else "server_error"
        return _sse({"error": {"message": msg, "type": kind, "param": None, "code": None}}) + _sse("[DONE]")

    def whole(self, text: str, job, load_s: float) -> dict:
        calls: list[ToolCall] = []
        reasoning = ""
        if self.tools is not None:
            reasoning, text, calls = _split(self.tools.feed(text) + self.tools.finish())
        msg: dict = {"role": "assistant", "content": text if text or not calls else None}
        if reasoning:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = [T.openai_call(c) for c in calls]
        lps = None if self.lp_tok is None else {
            "content": [token_entry(self.lp_tok, e) for e in job.logprobs_seen], "refusal": None}
        return {**self._base(self.obj), "choices": [
            {"index": 0, "message": msg, "logprobs": lps, "finish_reason": self._reason(job, len(calls))}],
            "usage": S.openai_usage(job)}


class OpenAICompletion(OpenAIChat):
    """/v1/completions: ``text_completion`` objects, streamed or whole."""

    prefix, obj = "cmpl-", "text_completion"
    _offset = 0  # characters of text sent before the pending logprobs' tokens

    def _lps(self) -> dict:
        if self.lp_tok is None or not self._lp:
            return {"logprobs": None}
        lps, self._offset = completion_logprobs(self.lp_tok, self._take(), self._offset)
        return {"logprobs": lps}

    def _choice(self, text: str | None, reason: str | None) -> dict:
        return {"index": self.index, "text": text or "", **self._lps(), "finish_reason": reason}

    def chunk(self, text: str) -> str:
        self._first = False
        return _sse({**self._base(self.obj), "choices": [self._choice(text, None)]})

    def end(self, job) -> str:
        return _sse({**self._base(self.obj), "choices": [self._choice(None, job.reason)]})

    def tail(self, usage: dict) -> str:
        out = _sse({**self._base(self.obj), "choices": [], "usage": usage}) if self.usage else ""
        return out + _sse("[DONE]")

    def whole(self, text: str, job, load_s: float) -> dict:
        if self.lp_tok is not None:
            self._lp = list(job.logprobs_seen)
        return {**self._base(self.obj), "choices": [self._choice(text, job.reason)], "usage": S.openai_usage(job)}


FORMATS = {"generate": OllamaGenerate, "chat": OllamaChat, "chat.completion": OpenAIChat,
           "text_completion": OpenAICompletion}
