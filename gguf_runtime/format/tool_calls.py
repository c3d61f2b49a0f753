"""Tool calls in generated text: the syntax a chat template teaches (its family), and the calls
parsed out of a model's answer, whole or while it streams.

Families (``template_family`` tells them apart by the markers the template writes):

* ``hermes``: Qwen2.5 / Qwen3, Hermes-2-Pro / Hermes-3, QwQ: ``<tool_call>\\n{"name": ...,
  "arguments": {...}}\\n</tool_call>``, one block a call, several in a row;
* ``llama3``: Llama-3.1 / 3.2 / 3.3: the answer is a JSON call ``{"name": ..., "parameters":
  {...}}`` (optionally after ``<|python_tag|>``; several separated by ``;``);
* ``mistral``: Mistral-Nemo / Small 3.x: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``;
* ``mistral_args``: newer Mistral templates: ``[TOOL_CALLS]name[ARGS]{...}`` (optionally with
  ``[CALL_ID]id`` before ``[ARGS]``), one marker a call;
* ``harmony``: gpt-oss (OpenAI's Harmony format): the answer is a run of messages, each a header and
  a body, ``<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>
  ...<|return|>``; a call is a message to a function, ``<|channel|>commentary to=functions.NAME
  <|constrain|>json<|message|>{...}<|call|>`` (see :class:`HarmonyParser`);
* ``generic``: a template that takes ``tools`` with none of these markers: ``<tool_call>`` blocks,
  or a bare JSON call (``arguments`` or ``parameters``) as the whole answer.

:class:`ToolCallParser` takes the text as it streams and gives back events: content text that is
safe to show, and :class:`ToolCall` objects, each as soon as its text is complete. Text that may
start a call is held back until it is known; a call that turns out malformed is given back as
content (never an error). A bare JSON answer (llama3, generic) counts as a call only when it names
one of the request's tools; after a marker any name counts, as the model meant to call. Whitespace
around calls is dropped. :class:`HarmonyParser` gives :class:`Reasoning` events too (the analysis
channel); ``answer_parser`` makes the parser of a family, ``chat_answer_parser`` the one a chat
answer needs (None for plain text).

A thinking template's answers (Qwen3, QwQ, DeepSeek-R1) open with their reasoning in
``<think>...</think>``, whatever the tool-call family: :class:`ThinkParser` gives it as
:class:`Reasoning` and hands what follows to the family's parser (``opens_thinking`` tells whether
the prompt already opened the block).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Union

__all__ = ["FAMILIES", "HarmonyParser", "Reasoning", "ThinkParser", "ToolCall", "ToolCallParser", "answer_parser",
           "chat_answer_parser", "ids_open_thinking", "opens_thinking", "parse_answer", "parse_tool_calls",
           "template_family"]

FAMILIES = ("hermes", "llama3", "mistral", "mistral_args", "harmony", "generic")
TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
# Harmony's special tokens (gpt-oss): a message is START header MESSAGE body END (or CALL / RETURN,
# which also end the generation); the header names the CHANNEL, a recipient (to=...) and a CONSTRAIN type
START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, CALL, RETURN = "<|constrain|>", "<|call|>", "<|return|>"
HARMONY_MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, CALL, RETURN)
THINK, THINK_END = "<think>", "</think>"  # a thinking template's reasoning block (Qwen3, DeepSeek-R1)
# the markers of a family (text that starts a call wherever it appears)
MARKERS = {"hermes": (TOOL_CALL,), "llama3": (PYTHON_TAG,), "mistral": (TOOL_CALLS,),
           "mistral_args": (TOOL_CALLS,), "generic": (TOOL_CALL,)}
_JSON_START = ("llama3", "generic")  # a bare JSON call as the answer counts
_MAX_HELD = 1 << 20  # characters held back for one call at most (then it is content)


def template_family(source: str | None) -> str:
    """The tool-call family of a chat template's text (see the module)."""
    s = source or ""
    if CHANNEL in s and MESSAGE in s and START in s:
        return "harmony"
    if TOOL_CALLS in s:
        return "mistral_args" if ARGS in s else "mistral"
    if TOOL_CALL in s:
        return "hermes"
    if "<|start_header_id|>" in s and ('"parameters"' in s or "python_tag" in s):
        return "llama3"
    return "generic"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)
    id: str | None = None  # the id the model wrote ([CALL_ID], Mistral's "id"), if any


@dataclass(frozen=True)
class Reasoning:
    """Text of the model's reasoning (Harmony's analysis channel, a think block), as it streams."""

    text: str


Event = Union[str, ToolCall, Reasoning]
_INVALID = object()  # an extractor's answer: this can never be a call


def _json_end(s: str, i: int) -> int | None:
    """The end (exclusive) of the JSON object or array starting at ``s[i]``; None when the text ends first."""
    depth, in_str, esc = 0, False, False
    for j in range(i, len(s)):
        c = s[j]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def _call(obj, names: frozenset[str] | None = None) -> ToolCall | None:
    """A call from a decoded {"name", "arguments" | "parameters"} object; None if it is not one."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict) and "name" not in obj:  # {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name or (names is not None and name not in names):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None
    cid = obj.get("id")
    return ToolCall(name, args, cid if isinstance(cid, str) and cid else None)


def _loads(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _INVALID


_ARGS_HEAD = re.compile(r"([^\s\[\]{}\"]{1,128})(?:\[CALL_ID\]([A-Za-z0-9_\-]{1,64}))?\[ARGS\]")
_NAME = re.compile(r"[^\s\[\]{}\"]{0,128}")
_ID = re.compile(r"[A-Za-z0-9_\-]{0,64}")


def _args_head_partial(body: str) -> bool:
    """Whether ``body`` may still become ``name[CALL_ID]id[ARGS]`` (or ``name[ARGS]``)."""
    rest = body[_NAME.match(body).end():]
    if rest.startswith(CALL_ID):
        rest = rest[len(CALL_ID):]
        rest = rest[_ID.match(rest).end():]
        return ARGS.startswith(rest)
    return CALL_ID.startswith(rest) or ARGS.startswith(rest)


class ToolCallParser:
    """Calls out of a streamed answer (see the module): ``feed(text)`` and ``finish()`` return events."""

    def __init__(self, family: str, names: Iterable[str] = ()) -> None:
        if family not in FAMILIES:
            raise ValueError(f"unknown tool-call family {family!r}")
        if family == "harmony":
            raise ValueError("Harmony answers are parsed by HarmonyParser (answer_parser makes either)")
        self.family = family
        self.names = frozenset(names)
        self.markers = MARKERS[family]
        self.buf = ""  # text not decided yet
        self.ws = ""  # whitespace after the last content, shown only if content follows
        self.at_start = True  # no content since the start or the last call: a bare JSON call may come
        self.after_call = False  # the last event was a call
        self.shown = False  # some content was given out
        self.n_calls = 0

    # ---- the stream ---------------------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        self.buf += text
        return self._drain(False)

    def finish(self) -> list[Event]:
        out = self._drain(True)
        if self.ws and not self.after_call:
            out.append(self.ws)
        self.ws = ""
        return out

    def _content(self, out: list[Event], text: str) -> None:
        if self.after_call:  # text after calls joins the text before them with the space before them
            text = text.lstrip()
            if not text:
                return
            text = (self.ws if self.shown else "") + text
            self.after_call = False
        else:
            text = self.ws + text
        body = text.rstrip()
        self.ws = text[len(body):]
        if body:
            if out and isinstance(out[-1], str):
                out[-1] += body
            else:
                out.append(body)
            self.at_start, self.shown = False, True

    def _calls(self, out: list[Event], calls: list[ToolCall]) -> None:
        out.extend(calls)
        self.n_calls += len(calls)
        self.at_start, self.after_call = True, True

    def _drain(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while self.buf:
            if self.at_start and self.family in _JSON_START:
                s = self.buf.lstrip()
                if self.after_call and self.family == "llama3":
                    s = s.lstrip(";").lstrip()
                if not s:
                    if final:
                        self._content(out, self.buf)
                        self.buf = ""
                    break
                if s[0] == "{":
                    got = self._bare_json(s, final)
                    if got is None:
                        break
                    if got is not _INVALID:
                        self._calls(out, got[0])
                        self.buf = s[got[1]:]
                        continue
                    self.at_start = False  # not a call: the text is content, scanned for markers below
            i, marker = self._find_marker()
            if marker is None:
                keep = 0 if final else self._partial_marker()
                self._content(out, self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            self._content(out, self.buf[:i])
            self.buf = self.buf[i:]
            got = self._extract(marker, final)
            if got is None:
                break
            if got is _INVALID:
                self._content(out, marker)
                self.buf = self.buf[len(marker):]
                self.at_start = False
                continue
            self._calls(out, got[0])
            self.buf = self.buf[got[1]:]
        if not final and len(self.buf) > _MAX_HELD:  # never hold a whole answer hostage
            self._content(out, self.buf)
            self.buf, self.at_start = "", False
        return out

    def _find_marker(self) -> tuple[int, str | None]:
        best, found = len(self.buf), None
        for m in self.markers:
            i = self.buf.find(m)
            if 0 <= i < best:
                best, found = i, m
        return best, found

    def _partial_marker(self) -> int:
        """How many characters at the end of the buffer may begin a marker."""
        for k in range(min(len(self.buf), max(map(len, self.markers)) - 1), 0, -1):
            tail = self.buf[-k:]
            if any(m.startswith(tail) for m in self.markers):
                return k
        return 0

    # ---- extractors: (calls, characters used), None (need more text) or _INVALID -------------
    def _bare_json(self, s: str, final: bool):
        end = _json_end(s, 0)
        if end is None:
            return _INVALID if final else None
        c = _call(_loads(s[:end]), self.names)
        return _INVALID if c is None else ([c], end)

    def _extract(self, marker: str, final: bool):
        rest = self.buf[len(marker):]
        n = len(marker)
        if marker == TOOL_CALL:
            j = rest.find(TOOL_CALL_END)
            if j < 0:
                if not final:
                    return None
                c = _call(_loads(rest.strip()))  # the answer ended before the closing tag
                return _INVALID if c is None else ([c], len(self.buf))
            c = _call(_loads(rest[:j].strip()))
            return _INVALID if c is None else ([c], n + j + len(TOOL_CALL_END))
        body = rest.lstrip()
        n += len(rest) - len(body)
        if not body:
            return _INVALID if final else None
        if body[0] in "[{":  # a JSON call or list of calls (llama3 after <|python_tag|>, mistral)
            end = _json_end(body, 0)
            if end is None:
                return _INVALID if final else None
            obj = _loads(body[:end])
            calls = [_call(o) for o in (obj if isinstance(obj, list) else [obj])]
            if not calls or None in calls:
                return _INVALID
            return calls, n + end
        if marker == TOOL_CALLS:  # [TOOL_CALLS]name[CALL_ID]id[ARGS]{...}
            m = _ARGS_HEAD.match(body)
            if m is None:
                return None if not final and _args_head_partial(body) else _INVALID
            args = body[m.end():].lstrip()
            skip = len(body) - m.end() - len(args)
            if not args:
                return _INVALID if final else None
            if args[0] != "{":
                return _INVALID
            end = _json_end(args, 0)
            if end is None:
                return _INVALID if final else None
            c = _call({"name": m.group(1), "arguments": _loads(args[:end]), "id": m.group(2)})
            return _INVALID if c is None else ([c], n + m.end() + skip + end)
        return _INVALID


# ---- Harmony (gpt-oss) ----------------------------------------------------------------------------
_HEADER_MAX = 256  # characters a message header may take (longer: it is text, not a header)
_WORD = re.compile(r"[^\s<]+")
_ENDS = (END, CALL, RETURN)  # end a message (<|call|> and <|return|> also end the generation)
_OPENS = (START, CHANNEL)  # open a message (<|channel|> alone: a header whose <|start|>role was left out)
_STRAY = (MESSAGE, CONSTRAIN)  # outside a header: dropped


def _partial_tail(s: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of ``s`` may begin one of ``markers``."""
    for k in range(min(len(s), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(s[-k:]) for m in markers):
            return k
    return 0


def _find(s: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    best, found = len(s), None
    for m in markers:
        i = s.find(m, 0, best + len(m))
        if 0 <= i < best:
            best, found = i, m
    return best, found


def harmony_header(h: str, explicit: bool, complete: bool) -> tuple[str | None, str | None] | None:
    """(channel, recipient) of a Harmony message header: the text between ``<|start|>`` and
    ``<|message|>``: a role (``explicit``: after a ``<|start|>`` the model wrote; else the prompt's
    ``<|start|>assistant`` gave it), then ``<|channel|>NAME``, a recipient ``to=...`` (before or after
    the channel), an optional content type (``json``, ``<|constrain|>json``), in any spacing. None when
    ``h`` is not a header; when not ``complete``, None only when no continuation of ``h`` can be one
    (a header so far gives what it has)."""
    if len(h) > _HEADER_MAX:
        return None
    i, n = 0, len(h)
    role, channel, recipient, expect_name = not explicit, None, None, False
    ctype = constrain = seen = False
    while i < n:
        c = h[i]
        if c.isspace():
            i += 1
            continue
        if c == "<":
            m = CHANNEL if h.startswith(CHANNEL, i) else CONSTRAIN if h.startswith(CONSTRAIN, i) else None
            if m is None:
                if not complete and any(x.startswith(h[i:]) for x in HARMONY_MARKERS):
                    return channel, recipient  # a marker on its way
                return None
            if expect_name or (m == CHANNEL and channel is not None) or (m == CONSTRAIN and (constrain or ctype)):
                return None
            if m == CHANNEL:
                channel, expect_name, role = "", True, True
            else:
                constrain = True
            seen = True
            i += len(m)
            continue
        w = _WORD.match(h, i).group()
        at_end = i + len(w) == n and not complete  # a word still being written
        i += len(w)
        if expect_name:
            channel, expect_name = w, False
        elif w.startswith("to="):
            if recipient is not None or (len(w) == 3 and not at_end):
                return None
            recipient = w[3:]
        elif not seen and not explicit:  # the prompt gave the role: a header opens with its channel or recipient
            if not (at_end and "to=".startswith(w)):
                return None
        elif not role:
            role = True
        elif ctype:
            return None
        else:
            ctype = True
        seen = True
    if complete and (expect_name or not seen):
        return None
    return channel, recipient


class HarmonyParser:
    """A Harmony answer (gpt-oss) as it streams: ``feed(text)`` and ``finish()`` return events: content
    (``str``: the final and commentary channels, and text outside any message), :class:`Reasoning`
    (the analysis channel) and :class:`ToolCall` (a message to ``functions.NAME``, or to a name of the
    request's tools, its body the JSON arguments; out when its message ends: ``<|call|>``, which also
    ends the generation, so at the end of the answer).

    The answer continues the prompt's ``<|start|>assistant``, so it opens with a header
    (``<|channel|>analysis<|message|>``); an answer that opens otherwise is content (a model that
    skipped the header). Markers never reach content or reasoning: a header is held until its
    ``<|message|>``, the tail of a body that may begin a marker until it is known. What does not
    parse falls back to content, never an error: a header that cannot be one is content (its markers
    left out), the arguments of a call that are not a JSON object too, and so are a call's when
    ``calls`` is false (the request offered no tools). A header cut off by the end of the answer says
    nothing and is dropped."""

    family = "harmony"

    def __init__(self, names: Iterable[str] = (), calls: bool = True) -> None:
        self.names = frozenset(names)
        self.calls = calls
        self.buf = ""
        self.state = "header"  # header, body, between (after a message), raw (text outside messages)
        self.explicit = False  # the header follows a <|start|> of the answer's own
        self.kind = "content"  # the body's: content, reasoning, call
        self.name = ""  # the call's
        self.args = ""  # the call's body so far
        self.n_calls = 0

    # ---- the stream ---------------------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        self.buf += text
        return self._drain(False)

    def finish(self) -> list[Event]:
        return self._drain(True)

    @staticmethod
    def _out(out: list[Event], kind: str, text: str) -> None:
        if not text:
            return
        if kind == "reasoning":
            if out and isinstance(out[-1], Reasoning):
                out[-1] = Reasoning(out[-1].text + text)
            else:
                out.append(Reasoning(text))
        elif out and isinstance(out[-1], str):
            out[-1] += text
        else:
            out.append(text)

    def _drain(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            step = getattr(self, "_" + self.state)(out, final)
            if not step:
                return out

    def _header(self, out: list[Event], final: bool) -> bool:
        i, m = _find(self.buf, (MESSAGE,) + _ENDS + (START,))
        h = self.buf[:i]
        if m == MESSAGE:
            got = harmony_header(h, self.explicit, complete=True)
            if got is None:
                return self._not_a_header(out, h, False)
            self._open(*got)
            self.buf = self.buf[i + len(MESSAGE):]
            return True
        if harmony_header(h, self.explicit, complete=False) is None:
            return self._not_a_header(out, h, m is None)
        if m is None and not final:
            return False  # wait for the rest of the header
        self.buf = self.buf[i:]  # a header cut short (by a marker, or the end): dropped
        self.state = "between"
        return bool(self.buf)

    def _not_a_header(self, out: list[Event], h: str, open_: bool) -> bool:
        """Text ``h`` where a header should be: content up to the next <|channel|> (a header may start
        there; ``open_``: nothing ended ``h`` yet, so its tail may begin a marker)."""
        j = h.find(CHANNEL, 1)
        if j < 0:
            j = len(h) - (_partial_tail(h, HARMONY_MARKERS) if open_ else 0)
        self.state = "raw"
        if j <= 0:  # nothing to give (a <|message|> with no header before it): the raw text follows
            return True
        text = h[:j]
        for mk in (CHANNEL, CONSTRAIN):
            text = text.replace(mk, "")
        self._out(out, "content", text)
        self.buf = self.buf[j:]
        return True

    def _open(self, channel: str | None, recipient: str | None) -> None:
        name = None
        if recipient is not None:
            if recipient.startswith("functions.") and len(recipient) > len("functions."):
                name = recipient[len("functions."):]
            elif recipient in self.names:
                name = recipient
        if name is not None:
            self.kind, self.name, self.args = ("call" if self.calls else "content"), name, ""
        else:
            self.kind = "reasoning" if channel == "analysis" else "content"
        self.state = "body"

    def _body(self, out: list[Event], final: bool) -> bool:
        i, m = _find(self.buf, _ENDS + _OPENS + _STRAY)
        if m is None:
            keep = 0 if final else _partial_tail(self.buf, HARMONY_MARKERS)
            text, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        else:
            text = self.buf[:i]
            self.buf = self.buf[i + len(m):] if m in _STRAY else self.buf[i:]
        if self.kind != "call":
            self._out(out, self.kind, text)
        else:
            self.args += text
            if len(self.args) > _MAX_HELD:  # never hold a whole answer hostage
                self.kind = "content"
                self._out(out, "content", self.args)
        if m in _STRAY:
            return True
        if m is None and not final:
            return False
        if self.kind == "call":
            self._call(out)
        self.state = "between"
        return bool(self.buf)

    def _call(self, out: list[Event]) -> None:
        body = self.args.strip()
        c = _call({"name": self.name, "arguments": _loads(body)}) if body else None
        if c is None:
            self._out(out, "content", self.args)  # not a JSON object: the text it is
        else:
            out.append(c)
            self.n_calls += 1
        self.args = ""

    def _between(self, out: list[Event], final: bool) -> bool:
        self.buf = self.buf.lstrip()
        for m in _ENDS + _STRAY:
            if self.buf.startswith(m):
                self.buf = self.buf[len(m):]
                return True
        if self.buf.startswith(START):
            self.buf, self.state, self.explicit = self.buf[len(START):], "header", True
            return True
        if self.buf.startswith(CHANNEL):
            self.state, self.explicit = "header", False
            return True
        if not self.buf or (not final and any(m.startswith(self.buf) for m in HARMONY_MARKERS)):
            return False
        self.state = "raw"
        return True

    def _raw(self, out: list[Event], final: bool) -> bool:
        i, m = _find(self.buf, HARMONY_MARKERS)
        if m is None:
            keep = 0 if final else _partial_tail(self.buf, HARMONY_MARKERS)
            self._out(out, "content", self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        self._out(out, "content", self.buf[:i])
        self.buf = self.buf[i + len(m):] if m in _STRAY else self.buf[i:]
        if m not in _STRAY:
            self.state = "between"
        return True


# ---- <think> reasoning (Qwen3, QwQ, DeepSeek-R1) --------------------------------------------------
def opens_thinking(prompt: str) -> bool:
    """Whether a prompt's text ends inside a think block: its generation prompt wrote ``<think>``
    (DeepSeek-R1's, QwQ's), so the answer starts with the reasoning and only ``</think>`` appears."""
    return prompt.rstrip().endswith(THINK)


PROMPT_TAIL = 16  # a prompt's last tokens whose text tells whether it opened a think block


def ids_open_thinking(ids: list[int], tok) -> bool:
    """opens_thinking of a tokenized prompt (``tok``: its tokenizer), from its last tokens' text."""
    return opens_thinking(tok.decode(ids[-PROMPT_TAIL:]))


class ThinkParser:
    """A thinking template's answer as it streams: ``feed(text)`` and ``finish()`` return events:
    :class:`Reasoning` (the think block's text), then what follows the block, through ``calls`` (a
    :class:`ToolCallParser`: the request's tool calls) or as content (``str``).

    As Ollama's thinking parser does: the block counts only where it opens the answer (after
    whitespace), and whitespace right after ``<think>`` and after ``</think>`` is dropped (so the
    empty block Qwen3 writes when told not to think leaves only the answer); an answer that does
    not open with ``<think>`` is content, tags and all. ``opened`` (a bool, or a function asked at
    the first text: the prompt is rendered after the parser is made): the prompt ended with
    ``<think>``, the answer starts inside the block. A tag is never given out in part: text that may
    begin one is held until it is known. A block the answer never closes is reasoning to its end."""

    def __init__(self, calls: ToolCallParser | None = None, opened: bool | Callable[[], bool] = False) -> None:
        self.calls = calls
        self.opened = opened
        self.buf = ""
        self.lead: list[str] = []  # start: the whitespace before the answer's first other text
        self.state = ""  # start (before <think>), think, after (the whitespace after </think>), content
        self.strip = False  # in the block: whitespace still to drop (right after <think>)

    # ---- the stream ---------------------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        self.buf += text
        return self._drain(False)

    def finish(self) -> list[Event]:
        out = self._drain(True)
        if self.calls is not None:
            out += self.calls.finish()
        return out

    def _drain(self, final: bool) -> list[Event]:
        if not self.state:
            opened = self.opened() if callable(self.opened) else self.opened
            self.state, self.strip = ("think", True) if opened else ("start", False)
        out: list[Event] = []
        while getattr(self, "_" + self.state)(out, final):
            pass
        return out

    def _start(self, out: list[Event], final: bool) -> bool:
        s = self.buf.lstrip()
        if s.startswith(THINK):
            self.buf, self.lead, self.state, self.strip = s[len(THINK):], [], "think", True
            return True
        if THINK.startswith(s) and not final:  # whitespace, or a tag on its way
            if len(s) < len(self.buf):  # the whitespace set apart: not scanned again at the next piece
                self.lead.append(self.buf[:len(self.buf) - len(s)])
                self.buf = s
            return False
        self.buf, self.lead, self.state = "".join(self.lead) + self.buf, [], "content"  # no block: as it came
        return True

    def _think(self, out: list[Event], final: bool) -> bool:
        if self.strip:
            self.buf = self.buf.lstrip()
            if not self.buf:
                return False
            self.strip = False
        i = self.buf.find(THINK_END)
        if i >= 0:
            _reason(out, self.buf[:i])
            self.buf, self.state = self.buf[i + len(THINK_END):], "after"
            return True
        keep = 0 if final else _partial_tail(self.buf, (THINK_END,))
        _reason(out, self.buf[:len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _after(self, out: list[Event], final: bool) -> bool:
        self.buf = self.buf.lstrip()
        if not self.buf:
            return False
        self.state = "content"
        return True

    def _content(self, out: list[Event], final: bool) -> bool:
        text, self.buf = self.buf, ""
        if self.calls is not None:
            out += self.calls.feed(text)
        elif text:
            out.append(text)
        return False


def _reason(out: list[Event], text: str) -> None:
    if text:
        out.append(Reasoning(text))


def chat_answer_parser(family: str, thinking: bool, names: Iterable[str] = (), opened: bool | Callable[[], bool] = False
                       ) -> "HarmonyParser | ThinkParser | ToolCallParser | None":
    """The parser a chat answer needs, for the server and the CLI: a Harmony template's (its calls
    counted when the request offers tools, ``names``), a thinking template's (``thinking``:
    ThinkParser; ``opened`` as its own) around the family's tool-call parser when tools are offered,
    that parser alone, or None: plain text, passed on as it comes."""
    names = list(names)
    if family == "harmony":
        return HarmonyParser(names, calls=bool(names))
    calls = ToolCallParser(family, names) if names else None
    return ThinkParser(calls, opened=opened) if thinking else calls


def answer_parser(family: str, names: Iterable[str] = (), calls: bool = True) -> "ToolCallParser | HarmonyParser":
    """The streaming parser of a family's answers (``calls``: Harmony's calls count; the other
    families are parsed only for calls)."""
    return HarmonyParser(names, calls) if family == "harmony" else ToolCallParser(family, names)


def parse_answer(text: str, family: str, names: Iterable[str] = (),
                 calls: bool = True) -> tuple[str, str, list[ToolCall]]:
    """(reasoning, content, calls) of a whole answer: what the stream would give, joined."""
    p = answer_parser(family, names, calls)
    events = p.feed(text) + p.finish()
    return ("".join(e.text for e in events if isinstance(e, Reasoning)),
            "".join(e for e in events if isinstance(e, str)), [e for e in events if isinstance(e, ToolCall)])


def parse_tool_calls(text: str, family: str, names: Iterable[str] = ()) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole answer: what the stream would give, joined (Harmony's reasoning left out)."""
    _, content, calls = parse_answer(text, family, names)
    return content, calls
