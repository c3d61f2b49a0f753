"""gpt-oss's Harmony answers without a server: the template's family; answers parsed into reasoning
(the analysis channel), content (final, commentary preambles, text outside messages) and calls
(messages to functions.NAME), whole and split at every position, malformed ones falling back to
content; what streams when; a call the template writes parses back; assistant reasoning and calls
(one or several) render through the template as it expects; the forced-call grammar on a vocabulary
with Harmony's tokens; the tokenizer's handling of those tokens (end of generation, shown markers)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from gguf_runtime.engine.constraint import Constraint
from gguf_runtime.engine.tool_grammar import marker_ids, tool_call_grammar
from gguf_runtime.format.chat_template import ChatTemplate
from gguf_runtime.format.tokenizer import Tokenizer
from gguf_runtime.format.tool_calls import (HARMONY_MARKERS, HarmonyParser, Reasoning, ToolCall, ToolCallParser,
                                            answer_parser, harmony_header, parse_answer, parse_tool_calls,
                                            template_family)
from gguf_runtime.server import schemas as S
from gguf_runtime.server import tools as T

from micro_models import vocab_metadata, with_added_tokens
from test_constraint import constrained_argmax

TEMPLATE = open(os.path.join(os.path.dirname(__file__), "data", "chat_templates", "gpt-oss-harmony.jinja"),
                encoding="utf-8").read()
NAMES = ["get_weather", "get_time"]
W = ToolCall("get_weather", {"city": "Paris", "days": 2})
TM = ToolCall("get_time", {"zone": "UTC"})
# Harmony's special tokens, in o200k_harmony's order (200006 <|start|> ...)
HARMONY_TOKENS = ("<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|call|>")


def events_of(parser, pieces) -> list:
    return [e for piece in pieces for e in parser.feed(piece)] + parser.finish()


def joined(events) -> tuple[str, str, list[ToolCall]]:
    return ("".join(e.text for e in events if isinstance(e, Reasoning)),
            "".join(e for e in events if isinstance(e, str)), [e for e in events if isinstance(e, ToolCall)])


# ---- the family -----------------------------------------------------------------------------------
def test_the_harmony_template_is_its_own_family():
    t = ChatTemplate(TEMPLATE)
    assert template_family(TEMPLATE) == "harmony" and t.supports_tools
    assert isinstance(answer_parser("harmony", NAMES), HarmonyParser)
    assert isinstance(answer_parser("hermes", NAMES), ToolCallParser)
    with pytest.raises(ValueError, match="HarmonyParser"):
        ToolCallParser("harmony")


# ---- parsing --------------------------------------------------------------------------------------
A = "<|channel|>analysis<|message|>"
S_ = "<|start|>assistant"
CASES = [  # answer (after the prompt's <|start|>assistant; <|call|> / <|return|> end it), reasoning, content, calls
    (A + "The user wants 2+2.<|end|>" + S_ + "<|channel|>final<|message|>It is 4.", "The user wants 2+2.", "It is 4.",
     []),
    (A + "Think.<|end|>" + S_ + "<|channel|>final<|message|>Done.<|return|>", "Think.", "Done.", []),
    ("<|channel|>final<|message|>Hello!", "", "Hello!", []),
    # a call as OpenAI's guide writes it, the generation ended by <|call|> (an end-of-generation token: not in the text)
    (A + "Need the weather.<|end|>" + S_ + '<|channel|>commentary to=functions.get_weather <|constrain|>json'
     '<|message|>{"city": "Paris", "days": 2}', "Need the weather.", "", [W]),
    # the recipient in the role, as the template writes calls back; <|call|> kept
    (' to=functions.get_time<|channel|>commentary json<|message|>{"zone": "UTC"}<|call|>', "", "", [TM]),
    # several calls, a preamble on the commentary channel (content), no space before <|constrain|>
    (A + "Both.<|end|>" + S_ + "<|channel|>commentary<|message|>Checking both.<|end|>" + S_
     + '<|channel|>commentary to=functions.get_weather<|constrain|>json<|message|>{"city": "Paris", "days": 2}<|call|>'
     + S_ + ' to=functions.get_time<|channel|>commentary json<|message|> {"zone": "UTC"} <|call|>',
     "Both.", "Checking both.", [W, TM]),
    # a call on the analysis channel (llama.cpp and Ollama take it); arguments as a JSON string
    ('<|channel|>analysis to=functions.get_time code<|message|>"{\\"zone\\": \\"UTC\\"}"', "", "", [TM]),
    # a recipient that is not a function: the message is what its channel says
    ('<|channel|>analysis to=browser.search<|message|>{"query": "x"}<|end|>' + S_ + "<|channel|>final<|message|>ok",
     '{"query": "x"}', "ok", []),
    # a bare name of the request's tools counts as a call
    ('<|channel|>commentary to=get_time<|message|>{"zone": "UTC"}', "", "", [TM]),
    # structured final answers, a header without a channel
    ('<|channel|>final <|constrain|>json<|message|>{"a": 1}', "", '{"a": 1}', []),
    (A + "x<|end|>" + S_ + "<|message|>plain", "x", "plain", []),
    # a model that skips the header: its text is content; text between messages too
    ("The answer is 4.", "", "The answer is 4.", []),
    ("Sure.<|channel|>final<|message|>It is 4.", "", "Sure.It is 4.", []),
    ("<|channel|>final<|message|>a < b, a <| c, <|x|> stays<|end|>\n\nafter", "", "a < b, a <| c, <|x|> staysafter",
     []),
    # stray markers inside a body are left out
    ("<|channel|>final<|message|>one<|constrain|> two<|message|> three", "", "one two three", []),
    # malformed: arguments that are not JSON, or not an object, or empty: the text they are
    ('<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"zone": UTC}<|call|>', "",
     '{"zone": UTC}', []),
    ("<|channel|>commentary to=functions.get_time json<|message|>[1, 2]", "", "[1, 2]", []),
    ("<|channel|>commentary to=functions.get_time json<|message|><|call|>", "", "", []),
    # truncated (the token budget ran out): what came so far
    (A + "Let me th", "Let me th", "", []),
    (A + "Hmm.<|end|>" + S_ + '<|channel|>commentary to=functions.get_weather json<|message|>{"city": "Pa',
     "Hmm.", '{"city": "Pa', []),
    (A + "Hmm.<|end|>" + S_ + "<|channel|>fin", "Hmm.", "", []),
    ("<|channel|>analy", "", "", []),
    # not a header: two channels, a line of text in the header
    ("<|channel|>final<|channel|>final<|message|>x", "", "finalx", []),
    ("<|channel|>final and then some words<|message|>x", "", "final and then some wordsx", []),
    ("<|start|><|message|>x", "", "x", []),
]


@pytest.mark.parametrize("answer,reasoning,content,calls", CASES)
def test_parse_whole_answers(answer, reasoning, content, calls):
    assert parse_answer(answer, "harmony", NAMES) == (reasoning, content, calls)
    assert parse_tool_calls(answer, "harmony", NAMES) == (content, calls)


@pytest.mark.parametrize("answer,reasoning,content,calls", CASES)
def test_parse_streamed_answers_split_anywhere(answer, reasoning, content, calls):
    for cut in range(1, len(answer)):
        for pieces in ([answer[:cut], answer[cut:]], [answer[i:i + cut] for i in range(0, len(answer), cut)]):
            got = joined(events_of(HarmonyParser(NAMES), pieces))
            assert got == (reasoning, content, calls), (cut, pieces)


@pytest.mark.parametrize("answer,reasoning,content,calls", CASES)
def test_no_marker_reaches_reasoning_or_content(answer, reasoning, content, calls):
    for pieces in ([answer], list(answer)):  # whole, and a character at a time
        for e in events_of(HarmonyParser(NAMES), pieces):
            text = e.text if isinstance(e, Reasoning) else e if isinstance(e, str) else ""
            assert not any(m in text for m in HARMONY_MARKERS), (e, pieces[:2])


def test_without_tools_a_call_is_content():
    answer = A + "x<|end|>" + S_ + '<|channel|>commentary to=functions.get_time json<|message|>{"zone": "UTC"}'
    assert parse_answer(answer, "harmony", NAMES, calls=False) == ("x", '{"zone": "UTC"}', [])


def test_reasoning_and_content_flow_as_they_are_generated():
    p = HarmonyParser(NAMES)
    assert p.feed("<|channel|>") == [] and p.feed("analysis") == [] and p.feed("<|message|>") == []
    assert p.feed("Let") == [Reasoning("Let")]
    assert p.feed(" me think") == [Reasoning(" me think")]
    assert p.feed(" <") == [Reasoning(" ")]  # what may begin a marker waits
    assert p.feed("tag>") == [Reasoning("<tag>")]
    assert p.feed("<|end|>") == [] and p.feed("<|start|>") == [] and p.feed("assistant") == []
    assert p.feed("<|channel|>final<|message|>") == []
    assert p.feed("It is") == ["It is"]
    assert p.feed(" 4.") == [" 4."]
    assert p.finish() == []


def test_a_call_comes_out_when_its_message_ends():
    p = HarmonyParser(NAMES)
    assert p.feed(A + "Weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather json") == [
        Reasoning("Weather.")]
    assert p.feed('<|message|>{"city": "Paris", "days": 2}') == []  # held until the message ends
    assert p.feed("<|call|>") == [W]
    assert p.finish() == []
    p = HarmonyParser(NAMES)  # <|call|> ended the generation (an end-of-generation token): at the end
    assert p.feed('<|channel|>commentary to=functions.get_time json<|message|>{"zone": "UTC"}') == []
    assert p.finish() == [TM]


def test_headers():
    assert harmony_header("<|channel|>analysis", False, True) == ("analysis", None)
    assert harmony_header("assistant to=functions.f<|channel|>commentary json", True, True) == (
        "commentary", "functions.f")
    assert harmony_header("<|channel|>commentary to=functions.f <|constrain|>json", False, True) == (
        "commentary", "functions.f")
    assert harmony_header("Hello", False, False) is None  # no header opens with a word
    assert harmony_header("to", False, False) == (None, None)  # may become to=...
    assert harmony_header("to", False, True) is None
    assert harmony_header("<|chan", False, False) == (None, None)
    assert harmony_header("<|channel|>", False, True) is None  # no channel name
    assert harmony_header("<|channel|>a<|channel|>b", False, False) is None
    assert harmony_header("<|channel|>final " + "x" * 300, False, False) is None  # too long to be a header


# ---- the template: calls back and forth -----------------------------------------------------------
ASK = {"role": "user", "content": "Weather in Paris, and the time?"}


def test_a_call_the_template_writes_parses_back():
    t = ChatTemplate(TEMPLATE)
    tools = [{"type": "function", "function": {"name": n, "description": n, "parameters": {"type": "object"}}}
             for n in NAMES]
    call = {"role": "assistant", "content": "", "thinking": "The time, then.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}]}
    head = t.render([ASK], add_generation_prompt=True, tools=tools)
    full = t.render([ASK, call], add_generation_prompt=False, tools=tools)
    assert full.startswith(head) and head.endswith("<|start|>assistant")
    assert parse_answer(full[len(head):], "harmony", NAMES) == ("The time, then.", "", [TM])


def prepared(turns: list[dict]) -> list[dict]:
    """Messages as the server hands them to the template (schemas.messages, tools.link_calls, harmony_history)."""
    return T.harmony_history(T.link_calls(S.messages(turns, T.message_tool_fields), "harmony"))


OPENAI_TURNS = [ASK, {"role": "assistant", "content": None, "reasoning_content": "Two tools.", "tool_calls": [
    {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
    {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
    {"role": "tool", "tool_call_id": "call_b", "content": "13:00"},
    {"role": "tool", "tool_call_id": "call_a", "content": "sunny"}]
OLLAMA_TURNS = [ASK, {"role": "assistant", "content": "", "thinking": "Two tools.", "tool_calls": [
    {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
    {"function": {"name": "get_time", "arguments": {"zone": "CET"}}}]},
    {"role": "tool", "tool_name": "get_weather", "content": "sunny"},
    {"role": "tool", "tool_name": "get_time", "content": "13:00"}]
WANT = ("<|start|>assistant<|channel|>analysis<|message|>Two tools.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
        '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone": "CET"}<|call|>'
        '<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>"13:00"<|end|><|start|>assistant')


@pytest.mark.parametrize("turns", [OPENAI_TURNS, OLLAMA_TURNS], ids=["openai", "ollama"])
def test_reasoning_and_several_calls_render_one_call_a_message(turns):
    text = ChatTemplate(TEMPLATE).render(prepared(turns), add_generation_prompt=True)
    assert text.endswith(WANT), text[-600:]
    # the template alone renders a message's first call only, and names both results after it
    raw = ChatTemplate(TEMPLATE).render(T.link_calls(S.messages(turns, T.message_tool_fields), "harmony"))
    assert "to=functions.get_time" not in raw and raw.count("<|start|>functions.get_weather to=assistant") == 2


def test_reasoning_with_content_and_a_call_renders():
    turns = [ASK, {"role": "assistant", "content": "Let me look.", "thinking": "Weather first.", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny"}]
    msgs = prepared(turns)  # the template refuses content and thinking beside a call: both become the analysis
    text = ChatTemplate(TEMPLATE).render(msgs)
    assert "<|channel|>analysis<|message|>Weather first.\n\nLet me look.<|end|>" in text
    with pytest.raises(Exception, match="Cannot pass both content and thinking"):
        ChatTemplate(TEMPLATE).render(T.link_calls(S.messages(turns, T.message_tool_fields), "harmony"))


def test_the_rendering_equals_transformers():
    ctu = pytest.importorskip("transformers.utils.chat_template_utils")
    msgs = prepared(OLLAMA_TURNS)
    ours = ChatTemplate(TEMPLATE).render(msgs, add_generation_prompt=True, reasoning_effort="high")
    theirs, _ = ctu.render_jinja_template(conversations=[msgs], chat_template=TEMPLATE, add_generation_prompt=True,
                                          reasoning_effort="high")
    assert ours == theirs[0] and "Reasoning: high" in ours


def test_reasoning_fields_are_checked():
    got = T.message_tool_fields({"role": "assistant", "reasoning_content": "r"}, 0)
    assert got == {"thinking": "r"}
    with pytest.raises(S.ApiError, match=r"messages\[3\].thinking must be a string"):
        T.message_tool_fields({"role": "assistant", "thinking": 5}, 3)


def test_think_and_reasoning_effort():
    assert S.think_kwargs({}, True) == {} and S.think_kwargs({"think": None}, True) == {}
    assert S.think_kwargs({"think": False}, True) == {"enable_thinking": False}
    assert S.think_kwargs({"think": "low"}, True) == {"enable_thinking": True, "reasoning_effort": "low"}
    assert S.think_kwargs({"reasoning_effort": "high"}, False) == {"reasoning_effort": "high"}
    for body, ollama, words in (({"think": "max"}, True, "invalid think value"), ({"think": 1}, True, "think"),
                                ({"reasoning_effort": "extreme"}, False, "reasoning_effort")):
        with pytest.raises(S.ApiError, match=words):
            S.think_kwargs(body, ollama)


# ---- the tokenizer and the grammar, on a vocabulary with Harmony's tokens -------------------------
@pytest.fixture(scope="module")
def harmony_vocab():
    meta = {k: v for k, v, _, _ in with_added_tokens(vocab_metadata("qwen2", None), HARMONY_TOKENS)}
    meta["tokenizer.ggml.token_type"] = np.asarray(meta["tokenizer.ggml.token_type"], np.int32)  # as the file reads
    tok = Tokenizer.from_metadata(meta)
    return tok, {t: tok.token_to_id[t] for t in HARMONY_TOKENS}


def test_the_tokenizer_ends_generation_at_call_and_return_and_shows_the_markers(harmony_vocab):
    tok, ids = harmony_vocab
    assert ids["<|call|>"] in tok.eog_ids and ids["<|return|>"] in tok.eog_ids
    assert ids["<|end|>"] not in tok.eog_ids  # the analysis ends with <|end|>, the answer goes on
    text = A + "Hmm.<|end|><|start|>assistant<|channel|>final <|constrain|>json<|message|>{}"
    seq = tok.encode(text, add_special=False, parse_special=True)
    assert sum(i in ids.values() for i in seq) == 7  # each marker one token
    d = tok.stream(skip_special=True, keep=marker_ids(tok, "harmony"))
    assert "".join(d.push(i) for i in seq) + d.flush() == text
    assert marker_ids(tok, "harmony") == frozenset(ids.values())


def test_the_forced_call_grammar_on_a_vocabulary_with_harmony_tokens(harmony_vocab):
    tok, ids = harmony_vocab
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
    grammar = tool_call_grammar("harmony", tools, "get_time", tok)
    assert Constraint(tok, tok.n_vocab, grammar).allowed()[ids["<|channel|>"]]  # the marker as its one token
    for seed in range(3):
        seq = constrained_argmax(tok, tok.n_vocab, grammar, np.random.default_rng(seed), budget=200)
        text = tok.decode(seq)
        reasoning, content, calls = parse_answer(text, "harmony", ["get_time"])
        assert reasoning == content == "" and len(calls) == 1 and calls[0].name == "get_time", text
        assert calls[0].arguments["zone"] in ("UTC", "CET")
