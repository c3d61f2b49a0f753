"""<think> reasoning (Qwen3, QwQ, DeepSeek-R1) without a server: which templates are thinking
templates, which prompts leave the answer inside a think block, and the answer split into its
reasoning and the rest (format/tool_calls.ThinkParser), whole and streamed in pieces cut at every
position: a tag cut across pieces, no tags, only the closing tag (the prompt opened the block), an
empty block, a block cut off by the end, tool calls after the block; a partial tag never goes out.
The CLI's generations print the tags where the vocabulary made them control tokens."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from gguf_runtime.engine.tool_grammar import think_ids
from gguf_runtime.format.chat_template import ChatTemplate, thinking_template
from gguf_runtime.format.tokenizer import Tokenizer
from gguf_runtime.format.tool_calls import (HarmonyParser, Reasoning, ThinkParser, ToolCall, ToolCallParser,
                                          chat_answer_parser, opens_thinking)

from micro_models import vocab_metadata, with_added_tokens

DIR = os.path.join(os.path.dirname(__file__), "data", "chat_templates")
NAMES = ["get_weather", "get_time"]
W = ToolCall("get_weather", {"city": "Paris", "days": 2})
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


def read(name: str) -> str:
    with open(os.path.join(DIR, name + ".jinja"), encoding="utf-8") as f:
        return f.read()


# ---- which templates think, which prompts open the block -------------------------------------------
# DeepSeek-R1's way (its template's lines that matter): the history's reasoning cut off at </think>,
# the generation prompt opening the block
R1 = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% set content = m['content'] %}"
      "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
      "{{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}{% else %}{{ '<｜User｜>' + m['content'] }}"
      "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}")


@pytest.mark.parametrize("name,thinks", [("qwen3", True), ("llama-3.2", False), ("mistral-nemo", False),
                                         ("gpt-oss-harmony", False)])
def test_thinking_templates_are_told_by_their_text(name, thinks):
    assert thinking_template(read(name)) is thinks
    assert ChatTemplate(read(name)).supports_thinking is thinks


def test_other_thinking_templates():
    assert thinking_template(R1)
    assert thinking_template("{{ '<|im_start|>assistant\\n<think>\\n' }}")  # QwQ's generation prompt
    assert thinking_template("{% if enable_thinking %}x{% endif %}")
    assert not thinking_template(None) and not thinking_template("{{ messages[0]['content'] }}")
    assert not ChatTemplate(None).supports_thinking  # the ChatML fallback


def test_prompts_that_open_the_block():
    qwen3 = ChatTemplate(read("qwen3"))
    ask = [{"role": "user", "content": "Hi"}]
    assert not opens_thinking(qwen3.render(ask))  # Qwen3 lets the model open it
    off = qwen3.render(ask, enable_thinking=False)
    assert off.endswith("<think>\n\n</think>\n\n") and not opens_thinking(off)  # closed, empty
    assert opens_thinking(ChatTemplate(R1).render(ask))
    assert opens_thinking("<|im_start|>assistant\n<think>\n") and not opens_thinking("<think>x</think>")


def qwen2_vocab(added: tuple[str, ...]) -> Tokenizer:
    meta = {k: v for k, v, _, _ in with_added_tokens(vocab_metadata("qwen2", None), added)}
    meta["tokenizer.ggml.token_type"] = np.asarray(meta["tokenizer.ggml.token_type"], np.int32)  # as the file reads
    return Tokenizer.from_metadata(meta)


def test_think_tags_that_are_control_tokens_are_shown():
    tok = qwen2_vocab(("<think>", "</think>"))
    ids = think_ids(tok)
    assert ids == {tok.token_to_id["<think>"], tok.token_to_id["</think>"]}
    seq = tok.encode("<think>a</think>b", add_special=False, parse_special=True)
    assert len(seq) == 4
    assert tok.decode(seq, skip_special=True) == "ab"  # hidden, unless kept
    dec = tok.stream(skip_special=True, keep=ids)
    assert "".join(dec.push(t) for t in seq) == "<think>a</think>b"
    assert think_ids(qwen2_vocab(())) == frozenset()  # text there: shown anyway


# ---- the split ------------------------------------------------------------------------------------
CASES = [  # answer, opened (the prompt ended with <think>), reasoning, content, calls
    ("<think>\nThe user greets me.\n</think>\n\nHello!", False, "The user greets me.\n", "Hello!", []),
    ("Hello there!", False, "", "Hello there!", []),  # no block: all content
    ("  \n<think>Plan.</think>Done.", False, "Plan.", "Done.", []),  # whitespace before the block
    ("The user greets me.\n</think>\n\nHello!", True, "The user greets me.\n", "Hello!", []),  # only </think>
    ("<think>\n\n</think>\n\nHello!", False, "", "Hello!", []),  # the empty block of thinking off
    ("<think>\nStill thinking", False, "Still thinking", "", []),  # cut off inside the block
    ("Still thinking", True, "Still thinking", "", []),
    ("<think>Plan.</thi", False, "Plan.</thi", "", []),  # cut off inside the closing tag
    ("<thinking>aloud</thinking>", False, "", "<thinking>aloud</thinking>", []),  # not the tag
    ("<thi", False, "", "<thi", []),
    ("Hi <think>x</think> there", False, "", "Hi <think>x</think> there", []),  # a block only opens the answer
    ("a < b and 2 > 1", True, "a < b and 2 > 1", "", []),
    ("<think>\nNeed the weather.\n</think>\n\n" + CALL, False, "Need the weather.\n", "", [W]),
    ("Need the weather.\n</think>\n\nLet me check.\n" + CALL, True, "Need the weather.\n", "Let me check.", [W]),
    ("<think>Plan.</think>See <tool", False, "Plan.", "See <tool", []),  # held by the tools parser to the end
    ("", False, "", "", []),
    ("", True, "", "", []),
]


def split(pieces: list[str], opened: bool, tools: bool) -> list:
    p = ThinkParser(ToolCallParser("hermes", NAMES) if tools else None, opened)
    return [e for piece in pieces for e in p.feed(piece)] + p.finish()


def joined(events: list) -> tuple[str, str, list[ToolCall]]:
    return ("".join(e.text for e in events if isinstance(e, Reasoning)),
            "".join(e for e in events if isinstance(e, str)), [e for e in events if isinstance(e, ToolCall)])


def cuts(answer: str):
    """The answer whole, in two pieces cut at every position, and in pieces of every size."""
    yield [answer]
    for cut in range(1, len(answer)):
        yield [answer[:cut], answer[cut:]]
        yield [answer[i:i + cut] for i in range(0, len(answer), cut)]


@pytest.mark.parametrize("tools", [False, True])
@pytest.mark.parametrize("answer,opened,reasoning,content,calls", CASES)
def test_the_answer_split_whole_and_streamed_in_any_pieces(answer, opened, reasoning, content, calls, tools):
    if calls and not tools:  # without a tools parser the call is text of the answer
        content, calls = (content + "\n" if content else "") + CALL, []
    for pieces in cuts(answer):
        events = split(pieces, opened, tools)
        assert joined(events) == (reasoning, content, calls), pieces
        kinds = [type(e) for e in events if e != ""]
        assert kinds == sorted(kinds, key=lambda k: k is not Reasoning), pieces  # the reasoning comes first


def _untagged(text: str) -> str:
    return text.replace("<think>", "").replace("</think>", "")


# the answers whose only < and > are their tags'
TAGGED = [(a, o) for a, o, _, c, calls in CASES if not calls and not set("<>") & set(_untagged(a) + c)]


@pytest.mark.parametrize("answer,opened", TAGGED)
def test_no_piece_of_a_tag_goes_out(answer, opened):
    for pieces in cuts(answer):
        for e in split(pieces, opened, False):
            text = e.text if isinstance(e, Reasoning) else e
            assert "<" not in text and ">" not in text, (pieces, e)


def test_text_goes_out_as_it_comes_and_a_possible_tag_waits():
    p = ThinkParser()
    assert p.feed(" <th") == []  # may open the block
    assert p.feed("ink>\n") == []  # the block, its leading whitespace dropped
    assert p.feed("Plan") == [Reasoning("Plan")]
    assert p.feed(".</th") == [Reasoning(".")]  # may close it
    assert p.feed("ing") == [Reasoning("</thing")]  # did not
    assert p.feed("</think>\n") == []  # the whitespace after it: dropped
    assert p.feed("\nHi") == ["Hi"]
    assert p.feed(" there") == [" there"] and p.finish() == []
    p = ThinkParser()
    assert p.feed("<x") == ["<x"]  # cannot open it: content at once


def test_opened_is_asked_at_the_first_text():
    said = []
    p = ThinkParser(opened=lambda: bool(said))  # made before the prompt is rendered
    said.append(True)
    assert p.feed("Plan.</think>Hi") == [Reasoning("Plan."), "Hi"]


@pytest.mark.parametrize("then,events", [("Hi", ["\n\n" * 200_000 + "Hi"]),
                                         ("<think>Plan.</think>Hi", [Reasoning("Plan."), "Hi"])])
def test_whitespace_before_the_answer_is_not_scanned_again_at_each_piece(then, events):
    """A model writing only newlines for a long while (a degenerate answer) before its first text:
    each piece costs its own length, not that of the whitespace held so far, which becomes content
    if no block follows (the bound is generous, the gap wide)."""
    p = ThinkParser()
    t0 = time.perf_counter()
    for _ in range(200_000):
        assert p.feed("\n\n") == []
    assert time.perf_counter() - t0 < 3
    assert p.feed(then) + p.finish() == events


# ---- the CLI's generations (gguf-run run / chat) --------------------------------------------------
def test_the_parser_a_chat_answer_needs():
    """The one choice the server (ToolSetup.parser) and the CLI (cli/thinking.answer_parser) make."""
    assert chat_answer_parser("hermes", False) is None  # plain text, as it comes
    calls = chat_answer_parser("hermes", False, NAMES)
    assert type(calls) is ToolCallParser and calls.family == "hermes" and calls.names == set(NAMES)
    think = chat_answer_parser("hermes", True, NAMES, opened=True)
    assert type(think) is ThinkParser and type(think.calls) is ToolCallParser and think.opened is True
    assert chat_answer_parser("hermes", True).calls is None
    harmony = chat_answer_parser("harmony", False)
    assert type(harmony) is HarmonyParser and not harmony.calls
    assert chat_answer_parser("harmony", True, NAMES).calls is True


def test_the_engine_prints_the_think_tags_of_a_thinking_model(tmp_path):
    """`gguf-run run` and `chat` print the answer as it comes, reasoning and tags included, also where
    the vocabulary made the tags control tokens (hidden otherwise): a micro model with Qwen3's
    template, its answer forced by a grammar to the tags around a word."""
    from gguf_runtime.engine.engine import Engine
    from micro_models import Micro, write_micro

    def forced(template: str) -> str:
        m = Micro(arch="qwen2", vocab="qwen2", n_vocab=None, seed=3, chat_template=template,
                  added_tokens=("<think>", "</think>"))
        eng = Engine(write_micro(m, tmp_path / f"{len(template)}.gguf"), backend="numpy", n_ctx=256)
        t = eng.tokenizer.token_to_id
        grammar = f'start: <[{t["<think>"]}]> "Plan." <[{t["</think>"]}]> "Hi"\n'
        gen = eng.generate(eng.encode_chat([{"role": "user", "content": "Hi"}]), n_predict=16,
                           constraint=eng.constraint("lark", grammar))
        return "".join(gen)

    assert forced(read("qwen3")) == "<think>Plan.</think>Hi"
    assert forced(read("llama-3.2")) == "Plan.Hi"  # not a thinking template: special tokens stay hidden
