"""The streamed chunks' fast paths (formats.py builds a text chunk from strings, not json.dumps)
write exactly what the general path writes, for texts JSON must escape; and the timestamp is
RFC 3339 to the microsecond, as datetime writes it."""

from __future__ import annotations

import datetime as dt
import json
import re

import pytest

from gguf_runtime.server import schemas as S
from gguf_runtime.server.formats import FORMATS, _line, _sse

TEXTS = ["", "hi", ' "quoted" \\ back', "line\nbreak\ttab\r", "\x00\x1f ctrl", "é ü 漢字 🙂", "\u2028\u2029",
         "</script>", "a" * 300]
STAMP = re.compile(r'"created_at":"[^"]*"')


@pytest.mark.parametrize("kind", ["generate", "chat"])
@pytest.mark.parametrize("model", ["smollm2", 'we"ird/mödel:1'])
def test_ollama_text_chunk_as_json_dumps_writes_it(kind, model):
    fmt = FORMATS[kind](model)
    for text in TEXTS:
        fast = fmt.chunk(text)
        slow = _line({**fmt._head(), **fmt._piece(text), "done": False})
        assert STAMP.sub("", fast) == STAMP.sub("", slow)
        assert json.loads(fast)[fmt.key if kind == "generate" else "message"] == (
            text if kind == "generate" else {"role": "assistant", "content": text})


@pytest.mark.parametrize("index", [0, 3])
def test_openai_text_chunk_as_json_dumps_writes_it(index):
    first = FORMATS["chat.completion"]('m"odel')
    fmt = FORMATS["chat.completion"]('m"odel').as_choice(index, first)
    head = fmt.chunk("start")  # the first names the role: the general path
    assert json.loads(head[6:])["choices"][0]["delta"] == {"role": "assistant", "content": "start"}
    for text in TEXTS:
        fast = fmt.chunk(text)
        slow = _sse({**fmt._base(fmt.obj + ".chunk"), "choices": [fmt._choice(text, None)]})
        assert fast == slow
        assert json.loads(fast[6:])["choices"][0] == {"index": index, "delta": {"content": text},
                                                      "finish_reason": None}


def test_timestamp_is_rfc3339_to_the_microsecond():
    before = dt.datetime.now(dt.timezone.utc)
    got = S.now_rfc3339()
    after = dt.datetime.now(dt.timezone.utc)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", got)
    t = dt.datetime.fromisoformat(got.replace("Z", "+00:00"))
    assert before - dt.timedelta(microseconds=1) <= t <= after + dt.timedelta(microseconds=1)
