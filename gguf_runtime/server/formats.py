"""Response bodies, streamed and whole: Ollama NDJSON and OpenAI JSON / server-sent events.

A format object serves one request: ``chunk(text)`` and ``final(job, load_s)`` / ``error(msg,
status)`` give the stream's pieces (``str``), ``whole(text, job, load_s)`` the ``stream: false``
body (a dict).
"""

from __future__ import annotations

import json
import secrets
import time

from . import schemas as S


def _line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"


def _sse(obj: dict | str) -> str:
    return "data: " + (obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False,
                                                                     separators=(",", ":"))) + "\n\n"


class OllamaGenerate:
    media_type = "application/x-ndjson"
    key = "response"

    def __init__(self, model: str) -> None:
        self.model = model

    def _piece(self, text: str) -> dict:
        return {self.key: text}

    def _head(self) -> dict:
        return {"model": self.model, "created_at": S.now_rfc3339()}

    def _end(self, job, load_s: float) -> dict:
        return {**S.ollama_final(job, load_s), "context": list(job.prompt) + list(job.ids)}

    def chunk(self, text: str) -> str:
        return _line({**self._head(), **self._piece(text), "done": False})

    def final(self, job, load_s: float) -> str:
        return _line({**self._head(), **self._piece(""), **self._end(job, load_s)})

    def error(self, msg: str, status: int) -> str:
        return _line({"error": msg})

    def whole(self, text: str, job, load_s: float) -> dict:
        return {**self._head(), **self._piece(text), **self._end(job, load_s)}


class OllamaChat(OllamaGenerate):
    def _piece(self, text: str) -> dict:
        return {"message": {"role": "assistant", "content": text}}

    def _end(self, job, load_s: float) -> dict:
        return S.ollama_final(job, load_s)


class OpenAIChat:
    """/v1/chat/completions: ``chat.completion`` or ``chat.completion.chunk`` events."""

    media_type = "text/event-stream"
    prefix, obj = "chatcmpl-", "chat.completion"

    def __init__(self, model: str, include_usage: bool = False) -> None:
        self.model, self.usage = model, include_usage
        self.id = self.prefix + secrets.token_hex(12)
        self.created = int(time.time())
        self._first = True

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": "fp_gguf_run"}

    def _choice(self, text: str | None, reason: str | None) -> dict:
        delta: dict = {} if text is None else {"content": text}
        if self._first and text is not None:
            delta, self._first = {"role": "assistant", **delta}, False
        return {"index": 0, "delta": delta, "finish_reason": reason}

    def chunk(self, text: str) -> str:
        return _sse({**self._base(self.obj + ".chunk"), "choices": [self._choice(text, None)]})

    def final(self, job, load_s: float) -> str:
        out = ""
        if self._first:  # nothing was generated: still say who speaks
            out = self.chunk("")
        out += _sse({**self._base(self.obj + ".chunk"), "choices": [self._choice(None, job.reason)]})
        if self.usage:
            out += _sse({**self._base(self.obj + ".chunk"), "choices": [], "usage": S.openai_usage(job)})
        return out + _sse("[DONE]")

    def error(self, msg: str, status: int) -> str:
        kind = "invalid_request_error" if status < 500 else "server_error"
        return _sse({"error": {"message": msg, "type": kind, "param": None, "code": None}}) + _sse("[DONE]")

    def whole(self, text: str, job, load_s: float) -> dict:
        return {**self._base(self.obj), "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": job.reason}],
            "usage": S.openai_usage(job)}


class OpenAICompletion(OpenAIChat):
    """/v1/completions: ``text_completion`` objects, streamed or whole."""

    prefix, obj = "cmpl-", "text_completion"

    def _choice(self, text: str | None, reason: str | None) -> dict:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}

    def chunk(self, text: str) -> str:
        self._first = False
        return _sse({**self._base(self.obj), "choices": [self._choice(text, None)]})

    def final(self, job, load_s: float) -> str:
        out = _sse({**self._base(self.obj), "choices": [self._choice(None, job.reason)]})
        if self.usage:
            out += _sse({**self._base(self.obj), "choices": [], "usage": S.openai_usage(job)})
        return out + _sse("[DONE]")

    def whole(self, text: str, job, load_s: float) -> dict:
        return {**self._base(self.obj), "choices": [self._choice(text, job.reason)], "usage": S.openai_usage(job)}


FORMATS = {"generate": OllamaGenerate, "chat": OllamaChat, "chat.completion": OpenAIChat,
           "text_completion": OpenAICompletion}
