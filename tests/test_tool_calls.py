"""Tool calling without a server: real templates (tests/data/chat_templates, licences in its README)
render the tools, an assistant's calls and the tool results (as transformers renders them); the
family of each template; calls parsed out of answers of each family, whole and split anywhere, with
malformed calls left as text; a call the template writes parses back to itself; forced-call
grammars (engine/tool_grammar.py) only let random logits write valid calls; the stream decoder
shows the special tokens it is told to keep."""

from __future__ import annotations

import os

import jsonschema
import numpy as np
import pytest

from gguf_runtime.engine.tool_grammar import marker_ids, tool_call_grammar
from gguf_runtime.errors import GrammarError
from gguf_runtime.format.chat_template import ChatTemplate
from gguf_runtime.format.tokenizer import Tokenizer
from gguf_runtime.format.tool_calls import ToolCall, ToolCallParser, parse_tool_calls, template_family
from gguf_runtime.server import schemas as S
from gguf_runtime.server import tools as T

from micro_models import VOCAB_DIR
from test_constraint import constrained_argmax

DIR = os.path.join(os.path.dirname(__file__), "data", "chat_templates")
FAMILY = {"qwen3": "hermes", "llama-3.2": "llama3", "mistral-nemo": "mistral", "gpt-oss-harmony": "harmony"}
END = {"qwen3": "<|im_end|>", "llama-3.2": "<|eot_id|>", "mistral-nemo": "</s>"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20,
                                                             "description": "the city's name"},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
NAMES = ["get_weather", "get_time"]
# an OpenAI conversation: a call with its id and arguments as JSON text, then its result
OPENAI_TURNS = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_Xy12AbCd34EfGh56", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
                {"role": "tool", "tool_call_id": "call_Xy12AbCd34EfGh56",
                 "content": '{"temp_c": 21.5, "sky": "clear"}'}]
# the same in Ollama's shape: arguments an object, no id, the result named by tool_name
OLLAMA_TURNS = [OPENAI_TURNS[0],
                {"role": "assistant", "content": "", "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
                {"role": "tool", "tool_name": "get_weather", "content": '{"temp_c": 21.5, "sky": "clear"}'}]


def template(name: str) -> ChatTemplate:
    with open(os.path.join(DIR, name + ".jinja"), encoding="utf-8") as f:
        return ChatTemplate(f.read(), bos_token="<s>", eos_token="</s>")


def prepared(turns: list[dict], name: str) -> list[dict]:
    """Messages as the server hands them to the template (schemas.messages + tools.link_calls)."""
    return T.link_calls(S.messages(turns, T.message_tool_fields), FAMILY[name])


# ---- templates ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(FAMILY))
def test_each_template_has_its_family_and_takes_tools(name):
    t = template(name)
    assert template_family(t.source) == FAMILY[name]
    assert t.supports_tools


def test_templates_without_tools_are_told_apart():
    chatml = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    assert not ChatTemplate(chatml).supports_tools
    assert not ChatTemplate("tools: {{ messages[0].content }} 'tools'").supports_tools  # the word, not the variable
    assert not ChatTemplate(None).supports_tools  # the ChatML fallback
    assert ChatTemplate("{% if tools %}{{ tools | length }}{% endif %}").supports_tools


@pytest.mark.parametrize("turns", ["openai", "ollama"])
@pytest.mark.parametrize("name", ["qwen3", "llama-3.2", "mistral-nemo"])
def test_tools_calls_and_results_render_in_each_family(name, turns):
    t = template(name)
    msgs = prepared(OPENAI_TURNS if turns == "openai" else OLLAMA_TURNS, name)
    text = t.render(msgs, add_generation_prompt=True, tools=T.tools_of(TOOLS))
    bare = t.render(msgs[:1], add_generation_prompt=True)
    for s in ("Current weather of a city", "Local time in a time zone", "the city's name", '"PST"'):
        assert s in text and s not in bare, s  # the tool schemas came through the tools variable
    assert text.count("get_weather") >= 2  # declared and called
    assert '"city": "Paris"' in text and '"days": 2' in text  # the call's arguments, as an object
    assert "21.5" in text and "clear" in text  # the tool's result
    assert text.index("Current weather") < text.index("21.5")
    if name == "mistral-nemo":  # 9-character ids, the call's and its result's the same
        (cid,) = {c["id"] for c in msgs[1]["tool_calls"]}
        assert len(cid) == 9 and cid.isalnum() and msgs[2]["tool_call_id"] == cid
        assert text.count(f'"{cid}"') == 2


@pytest.mark.parametrize("name", ["qwen3", "llama-3.2", "mistral-nemo"])
def test_rendering_equals_transformers(name):
    ctu = pytest.importorskip("transformers.utils.chat_template_utils")
    t = template(name)
    msgs = prepared(OPENAI_TURNS, name)
    ours = t.render(msgs, add_generation_prompt=True, tools=T.tools_of(TOOLS), date_string="26 Jul 2024")
    theirs, _ = ctu.render_jinja_template(conversations=[msgs], tools=TOOLS, chat_template=t.source,
                                          add_generation_prompt=True, bos_token="<s>", eos_token="</s>",
                                          date_string="26 Jul 2024")
    assert ours == theirs[0]


@pytest.mark.parametrize("name", ["qwen3", "llama-3.2", "mistral-nemo"])
def test_a_call_the_template_writes_parses_back(name):
    t = template(name)
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "abcdEFGH1", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "CET"}}}]}
    head = t.render(OPENAI_TURNS[:1], add_generation_prompt=True, tools=TOOLS)
    full = t.render([OPENAI_TURNS[0], call], add_generation_prompt=False, tools=TOOLS)
    assert full.startswith(head)
    turn = full[len(head):].split(END[name])[0]
    content, calls = parse_tool_calls(turn, FAMILY[name], NAMES)
    assert [(c.name, c.arguments) for c in calls] == [("get_time", {"zone": "CET"})], turn
    assert "get_time" not in content


# ---- parsing --------------------------------------------------------------------------------------
W = ToolCall("get_weather", {"city": "Paris", "days": 2})
TM = ToolCall("get_time", {"zone": "UTC"})
SAME = object()  # the content is the whole answer
CASES = [  # family, answer, content, calls
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
     "", [W]),
    ("hermes", 'Checking both.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}\n</tool_call>',
     "Checking both.", [W, TM]),
    ("hermes", 'Before <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call> after.',
     "Before after.", [TM]),
    ("hermes", 'Oops <tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call> done',
     'Oops <tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call> done', []),
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>', '<tool_call>\n{"arguments": {}}\n</tool_call>', []),
    ("hermes", 'A 2 < 3 <tool but no call', 'A 2 < 3 <tool but no call', []),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}', "", [TM]),  # no </tool_call>
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', "", [W]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
               '{"name": "get_time", "parameters": {"zone": "UTC"}}', "", [W, TM]),
    ("llama3", '{"name": "delete_everything", "parameters": {}}', SAME, []),
    ("llama3", '{"city": "Paris"} is the JSON you asked for.', '{"city": "Paris"} is the JSON you asked for.', []),
    ("llama3", 'It is {"name": "get_time", "parameters": {}} maybe', SAME, []),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Pa', SAME, []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}, "id": "a1b2c3d4e"}, '
                '{"name": "get_time", "arguments": {"zone": "UTC"}}]', "",
     [ToolCall("get_weather", {"city": "Paris", "days": 2}, "a1b2c3d4e"), TM]),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "UTC"}}]', "Sure.", [TM]),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": [1, 2]}]',
     '[TOOL_CALLS][{"name": "get_time", "arguments": [1, 2]}]', []),
    ("mistral_args", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]get_time[CALL_ID]'
                     'k9J2mN4pQ[ARGS]{"zone": "UTC"}', "", [W, ToolCall("get_time", {"zone": "UTC"}, "k9J2mN4pQ")]),
    ("mistral_args", 'Hmm [TOOL_CALLS]get_time then text', 'Hmm [TOOL_CALLS]get_time then text', []),
    ("generic", '{"name": "get_time", "arguments": {"zone": "UTC"}}', "", [TM]),
    ("generic", 'See <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>', "See", [TM]),
]


CASES = [(f, a, a if c is SAME else c, calls) for f, a, c, calls in CASES]


@pytest.mark.parametrize("family,answer,content,calls", CASES)
def test_parse_whole_answers(family, answer, content, calls):
    assert parse_tool_calls(answer, family, NAMES) == (content, calls)


@pytest.mark.parametrize("family,answer,content,calls", CASES)
def test_parse_streamed_answers_split_anywhere(family, answer, content, calls):
    for cut in range(1, len(answer)):
        for pieces in ([answer[:cut], answer[cut:]], [answer[i:i + cut] for i in range(0, len(answer), cut)]):
            p = ToolCallParser(family, NAMES)
            events = [e for piece in pieces for e in p.feed(piece)] + p.finish()
            got = ("".join(e for e in events if isinstance(e, str)), [e for e in events if isinstance(e, ToolCall)])
            assert got == (content, calls), (cut, pieces)


def test_a_call_comes_out_as_soon_as_it_is_complete():
    p = ToolCallParser("hermes", NAMES)
    assert p.feed("Let me look. <tool_") == ["Let me look."]  # the possible marker is held back
    assert p.feed('call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_c') == []
    assert p.feed("all>\n<tool_call>") == [TM]  # before the answer ends
    assert p.feed('{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>') == [W]
    assert p.finish() == []


# ---- forced calls: grammars -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def vocab():
    tok = Tokenizer.from_gguf(VOCAB_DIR / "ggml-vocab-llama-bpe.gguf")
    return tok, len(tok.tokens)


@pytest.mark.parametrize("family", ["hermes", "llama3", "mistral", "mistral_args", "harmony", "generic"])
@pytest.mark.parametrize("name", [None, "get_time"])
def test_forced_grammars_give_valid_calls_from_random_logits(vocab, family, name):
    tok, n = vocab
    grammar = tool_call_grammar(family, TOOLS, name, tok, parallel=False)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(3):
        text = tok.decode(constrained_argmax(tok, n, grammar, np.random.default_rng(seed), budget=300))
        content, calls = parse_tool_calls(text, family, NAMES)
        assert content == "" and len(calls) == 1, text
        assert name is None or calls[0].name == name
        jsonschema.validate(calls[0].arguments, schemas[calls[0].name])
        assert set(calls[0].arguments) <= set(schemas[calls[0].name]["properties"])  # no keys of its own


def test_forced_grammar_refuses_what_it_cannot_use():
    with pytest.raises(GrammarError, match="no tool named"):
        tool_call_grammar("hermes", TOOLS, "nope")
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(?<=a)b"}}}}}
    with pytest.raises(GrammarError, match="'f'"):
        tool_call_grammar("hermes", [bad], "f")


def test_special_markers_are_tokens_in_the_grammar_and_shown_by_the_decoder():
    tok = Tokenizer.from_gguf(VOCAB_DIR / "ggml-vocab-qwen2.gguf")
    im_start = tok.token_to_id["<|im_start|>"]
    assert tok.is_control(im_start)
    ids = [im_start] + tok.encode("ok", add_special=False)
    for keep, want in (((), "ok"), ((im_start,), "<|im_start|>ok")):
        d = tok.stream(skip_special=True, keep=keep)
        assert "".join(d.push(i) for i in ids) + d.flush() == want
    assert marker_ids(tok, "hermes") == frozenset()  # Qwen2's vocabulary has no <tool_call> token
