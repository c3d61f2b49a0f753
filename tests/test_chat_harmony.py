"""gpt-oss' Harmony chat template (issue 33 item 1), as the released GGUFs carry it
(tests/data/chat_templates/gpt-oss-harmony.jinja, from gpt-oss-20b's header, Apache-2.0): our
sandboxed rendering equals transformers' own Jinja helper on conversations with a system prompt,
several turns, an assistant's reasoning and tool calls, with and without the generation prompt."""

import os

import pytest

from gguf_runtime.format.chat_template import ChatTemplate

TEMPLATE = open(os.path.join(os.path.dirname(__file__), "data", "chat_templates", "gpt-oss-harmony.jinja")).read()
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CONVERSATIONS = {
    "one turn": [{"role": "user", "content": "2+2?"}],
    "system and turns": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"},
                         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}],
    "reasoning": [{"role": "user", "content": "Why?"},
                  {"role": "assistant", "content": "Because.", "thinking": "Let me think."},
                  {"role": "user", "content": "Sure?"}],
    "tool call": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "tool_calls": [{"type": "function",
                                                        "function": {"name": "weather",
                                                                     "arguments": {"city": "Paris"}}}]},
                  {"role": "tool", "content": "{\"temp\": 21}"}],
}


def _hf_render(messages, agp: bool, **kwargs) -> str:
    ctu = pytest.importorskip("transformers.utils.chat_template_utils")
    rendered, _ = ctu.render_jinja_template(conversations=[messages], chat_template=TEMPLATE,
                                            add_generation_prompt=agp, **kwargs)
    return rendered[0]


@pytest.mark.parametrize("agp", [True, False])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_harmony_matches_transformers(name, agp):
    messages = CONVERSATIONS[name]
    tools = TOOLS if name == "tool call" else None
    got = ChatTemplate(TEMPLATE).render(messages, add_generation_prompt=agp, tools=tools)
    assert got == _hf_render(messages, agp, tools=tools)
    assert got.startswith("<|start|>system<|message|>")
    assert got.endswith("<|start|>assistant") == agp
    if name == "tool call":
        assert "to=functions.weather" in got and "namespace functions" in got
    if name == "system and turns":
        assert "<|start|>developer<|message|># Instructions\n\nYou are terse." in got
