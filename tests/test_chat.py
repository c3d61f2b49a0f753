"""Chat templates: parity with transformers, the sandbox, errors, the ChatML fallback."""

from __future__ import annotations

import os

import pytest

from gguf_runtime.format.chat_template import ChatTemplate, chatml_render
from gguf_runtime.errors import TemplateError

SMOL_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi! Qu'est-ce que c'est, «ça»?"},
    {"role": "assistant", "content": "Hello! {{ 7*7 }} is just text."},
    {"role": "user", "content": "What is 2+2?\nAnswer in one word."},
]
NO_SYSTEM = CONVERSATION[1:]


# ---- the SmolLM2 file's metadata (isolated: a faster in-house reader will replace GGUFReader) ----

@pytest.fixture(scope="module")
def smol_meta(smollm2_path):
    """The metadata keys ChatTemplate.from_metadata reads, from the real GGUF file."""
    gguf = pytest.importorskip("gguf")
    fields = gguf.GGUFReader(smollm2_path).fields
    return {
        "tokenizer.chat_template": fields["tokenizer.chat_template"].contents(),
        "tokenizer.ggml.bos_token_id": fields["tokenizer.ggml.bos_token_id"].contents(),
        "tokenizer.ggml.eos_token_id": fields["tokenizer.ggml.eos_token_id"].contents(),
        "tokenizer.ggml.tokens": fields["tokenizer.ggml.tokens"].contents(),
    }


@pytest.fixture(scope="module")
def smol_template(smol_meta):
    return ChatTemplate.from_metadata(smol_meta)


@pytest.fixture(scope="session")
def hf_smol_tokenizer(smollm2_path):
    """transformers' own tokenizer built from the same GGUF (slow: ~10-15 s, once per session)."""
    transformers = pytest.importorskip("transformers")
    d, name = os.path.split(smollm2_path)
    return transformers.AutoTokenizer.from_pretrained(d, gguf_file=name)


def _hf_render(template: str, messages, add_generation_prompt: bool, **kwargs) -> str:
    """transformers' own Jinja rendering helper on a template string."""
    ctu = pytest.importorskip("transformers.utils.chat_template_utils")
    rendered, _ = ctu.render_jinja_template(conversations=[messages], chat_template=template,
                                            add_generation_prompt=add_generation_prompt, **kwargs)
    return rendered[0]


# ---- SmolLM2 ------------------------------------------------------------------------------------

def test_smol_metadata_tokens(smol_template):
    assert not smol_template.is_fallback
    assert smol_template.bos_token == "<|im_start|>"
    assert smol_template.eos_token == "<|im_end|>"


def test_smol_known_rendering(smol_template):
    """Hand-written expectation, independent of transformers."""
    expected = ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                "<|im_start|>user\nHi! Qu'est-ce que c'est, «ça»?<|im_end|>\n"
                "<|im_start|>assistant\nHello! {{ 7*7 }} is just text.<|im_end|>\n"
                "<|im_start|>user\nWhat is 2+2?\nAnswer in one word.<|im_end|>\n")
    assert smol_template.render(CONVERSATION, add_generation_prompt=False) == expected
    assert smol_template.render(CONVERSATION) == expected + "<|im_start|>assistant\n"
    no_sys = smol_template.render(NO_SYSTEM)
    assert no_sys.startswith(f"<|im_start|>system\n{SMOL_DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nHi!")
    assert no_sys.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("messages", [CONVERSATION, NO_SYSTEM], ids=["system", "no-system"])
@pytest.mark.parametrize("agp", [True, False], ids=["gen-prompt", "no-gen-prompt"])
def test_smol_matches_transformers_helper(smol_template, messages, agp):
    expected = _hf_render(smol_template.source, messages, agp,
                          bos_token=smol_template.bos_token, eos_token=smol_template.eos_token)
    assert smol_template.render(messages, add_generation_prompt=agp) == expected


@pytest.mark.slow
@pytest.mark.parametrize("messages", [CONVERSATION, NO_SYSTEM], ids=["system", "no-system"])
@pytest.mark.parametrize("agp", [True, False], ids=["gen-prompt", "no-gen-prompt"])
def test_smol_matches_transformers_tokenizer(smol_template, hf_smol_tokenizer, messages, agp):
    # transformers' GGUF loader carries the template over from the same metadata key.
    assert hf_smol_tokenizer.chat_template == smol_template.source
    assert hf_smol_tokenizer.bos_token == smol_template.bos_token
    assert hf_smol_tokenizer.eos_token == smol_template.eos_token
    expected = hf_smol_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=agp)
    assert smol_template.render(messages, add_generation_prompt=agp) == expected


# ---- transformers parity on the helpers templates use -------------------------------------------

RICH_TEMPLATE = """{{- bos_token }}
{%- set ns = namespace(n_user=0) %}
{%- if tools %}
<tools>{{ tools | tojson }}</tools>
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}{% set ns.n_user = ns.n_user + 1 %}{% endif %}
    {%- if message.role == 'stop' %}{% break %}{% endif %}
    {%- if message.get('skip') %}{% continue %}{% endif %}
<|{{ message['role'] }}|>
    {%- if message.content is string %}{{ message.content | trim }}
    {%- else %}{% for part in message.content %}[{{ part.type }}:{{ part.text }}]{% endfor %}{% endif %}
    {%- if message.tool_calls is defined %} calls={{ message.tool_calls | tojson(indent=2) }}{% endif %}
    {%- if message.meta %} meta={{ message.meta | tojson(separators=(',', ':'), sort_keys=true) }}{% endif %}
{{ eos_token }}
{%- endfor %}
{%- if add_generation_prompt %}
<|assistant|>{{ ns.n_user }}
{%- endif %}
"""

RICH_MESSAGES = [
    {"role": "system", "content": "  sys  "},
    {"role": "user", "content": [{"type": "text", "text": "héllo <b>&'"}]},
    {"role": "assistant", "content": "ok", "tool_calls": [{"name": "f", "arguments": {"x": "é", "y": [1, 2]}}]},
    {"role": "user", "content": "skipped", "skip": True},
    {"role": "user", "content": "m", "meta": {"b": 1, "a": "<>"}},
    {"role": "stop", "content": "never"},
    {"role": "user", "content": "after stop"},
]


@pytest.mark.parametrize("agp", [True, False])
@pytest.mark.parametrize("tools", [None, [{"type": "function", "function": {"name": "f", "description": "é"}}]])
def test_rich_template_matches_transformers(agp, tools):
    t = ChatTemplate(RICH_TEMPLATE, bos_token="<s>", eos_token="</s>")
    expected = _hf_render(RICH_TEMPLATE, RICH_MESSAGES, agp, tools=tools, bos_token="<s>", eos_token="</s>")
    got = t.render(RICH_MESSAGES, add_generation_prompt=agp, tools=tools)
    assert got == expected
    assert "héllo <b>&'" in got  # tojson/autoescape would have mangled these
    assert "calls=[\n  {\n" in got
    assert 'meta={"a":"<>","b":1}' in got


def test_globals_and_helpers():
    t = ChatTemplate("{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|{{ tools }}|"
                     "{{ date_string is string }}|{{ strftime_now('%Y') | length }}|{{ custom }}",
                     bos_token="<s>", eos_token="</s>")
    assert t.render([], add_generation_prompt=False, custom="c") == "<s>|</s>|False|None|True|4|c"


def test_messages_are_not_mutated_and_none_keys_are_dropped():
    # as apply_chat_template does (its render helper alone keeps them)
    msgs = [{"role": "user", "content": "a", "tool_calls": None}]
    t = ChatTemplate("{{ messages[0].tool_calls is defined }}")
    assert t.render(msgs) == "False"
    assert msgs == [{"role": "user", "content": "a", "tool_calls": None}]


# ---- the sandbox --------------------------------------------------------------------------------

ADVISORY_PAYLOAD = (
    '{% for x in ().__class__.__base__.__subclasses__() %}{% if "warning" in x.__name__ %}'
    '{{x()._module.__builtins__[\'__import__\'](\'os\').popen("touch MARKER")}}{%endif%}{% endfor %}'
)


def test_advisory_payload_is_stopped(tmp_path):
    marker = tmp_path / "retr0reg"
    t = ChatTemplate(ADVISORY_PAYLOAD.replace("MARKER", str(marker)), bos_token="<s>", eos_token="</s>")
    with pytest.raises(TemplateError) as ei:
        t.render([{"role": "user", "content": "hi"}])
    msg = str(ei.value)
    assert "\n" not in msg
    assert "unsafe attribute '__class__'" in msg and "was stopped" in msg and "--raw" in msg
    assert not marker.exists()


@pytest.mark.parametrize("source, attribute", [
    ("{{ self.__init__.__globals__ }}", "__init__"),
    ("{{ self.__init__ }}", "__init__"),  # bare: must not render as an empty Undefined
    ("{{ cycler.__init__.__globals__.os }}", "__init__"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "__class__"),
    ("{{ messages.append(1) }}", "append"),
    ("{{ messages[0].update(role='x') }}", "update"),
    ("{{ messages['__class__'] }}", "__class__"),
    ("{{ (messages | attr('__class__')) is defined }}", "__class__"),
    ("{% if ''.__class__ is defined %}yes{% endif %}", "__class__"),
    ("{{ '{0.__class__}'.format(1) }}", "__class__"),
    ("{{ cycler.mro() }}", "mro"),
    ("{{ raise_exception.__globals__ }}", "__globals__"),
    ("{% set ns = namespace(__class__=1) %}", "__class__"),
    ("{{ lipsum.__globals__['os'] }}", "__globals__"),
])
def test_sandbox_variants(source, attribute):
    t = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    with pytest.raises(TemplateError) as ei:
        t.render([{"role": "user", "content": "hi"}])
    msg = str(ei.value)
    assert "\n" not in msg
    assert f"unsafe attribute {attribute!r}" in msg and "was stopped" in msg and "--raw" in msg


def test_lenient_undefined_still_works():
    t = ChatTemplate("{{ messages[0].get('x', 'dflt') }}|{{ messages[0].nope is defined }}|"
                     "{{ messages[0].nope or 'none' }}|{{ undefined_name is defined }}|{{ messages[0].keys() | list }}")
    assert t.render([{"role": "user", "content": "hi"}]) == "dflt|False|none|False|['role', 'content']"


def test_message_content_is_data_not_code():
    t = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    payload = "{{ ().__class__ }}{% raw %}"
    assert t.render([{"role": "user", "content": payload}]) == payload


# ---- errors -------------------------------------------------------------------------------------

def test_raise_exception_message():
    t = ChatTemplate("{% if messages[0]['role'] != 'user' %}"
                     "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
                     "{% endif %}ok")
    assert t.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(TemplateError, match=r"roles must alternate user/assistant/user/assistant/\.\.\.$"):
        t.render([{"role": "assistant", "content": "x"}])


@pytest.mark.parametrize("source", ["{% for m in messages %}{{ m.content }}", "{% if %}", "{{ 1 + }}",
                                    "{% endfor %}", "{% generation %}x"])
def test_syntax_error(source):
    t = ChatTemplate(source)
    with pytest.raises(TemplateError, match="syntax error at line 1") as ei:
        t.render([{"role": "user", "content": "x"}])
    assert "\n" not in str(ei.value)
    with pytest.raises(TemplateError):
        t.check()


@pytest.mark.parametrize("source, fragment", [
    ("{{ messages[0].content + 1 }}", "TypeError"),
    ("{{ nothing.at_all }}", "UndefinedError"),
    ("{{ range(10**9) | list }}", "limit"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed"),
])
def test_render_errors(source, fragment):
    with pytest.raises(TemplateError, match=fragment) as ei:
        ChatTemplate(source).render([{"role": "user", "content": "x"}])
    assert "\n" not in str(ei.value) and "chat template" in str(ei.value)


def test_non_dict_message():
    with pytest.raises(TemplateError, match="message 1"):
        ChatTemplate("x").render([{"role": "user", "content": "x"}, "oops"])


def _nest(depth: int) -> dict:
    v: object = 1
    for _ in range(depth):
        v = {"a": v}
    return v  # type: ignore[return-value]


@pytest.mark.parametrize("where", ["arguments", "tools"])
def test_deeply_nested_data_is_one_clear_error(where):
    """Messages or tools nested hundreds deep (still JSON the server parses) are a TemplateError
    naming the nesting, not a RecursionError; data 100 deep renders."""
    tpl = ChatTemplate("{{ messages | tojson }}{{ tools | tojson }}")

    def render(depth):
        msgs = [{"role": "user", "content": "hi"}]
        if where == "arguments":
            msgs.append({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": _nest(depth)}}]})
            return tpl.render(msgs)
        return tpl.render(msgs, tools=[{"type": "function", "function": {"name": "f", "parameters": _nest(depth)}}])

    assert '"a": 1' in render(100) or '"a":1' in render(100)
    for depth in (600, 5000):
        with pytest.raises(TemplateError, match="nested more than 128 levels") as ei:
            render(depth)
        assert "\n" not in str(ei.value)


def test_generation_tag_renders_body():
    assert ChatTemplate("a{% generation %}b{% endgeneration %}c").render([]) == "abc"


# ---- fallback -----------------------------------------------------------------------------------

@pytest.mark.parametrize("source", [None, "", "  \n"])
def test_fallback_chatml(source):
    t = ChatTemplate.from_metadata({"tokenizer.chat_template": source} if source is not None else {})
    assert t.is_fallback
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
            {"role": "assistant", "content": "A"}]
    body = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
    assert t.render(msgs) == body + "<|im_start|>assistant\n"
    assert t.render(msgs, add_generation_prompt=False) == body
    assert chatml_render([{"role": "user", "content": [{"type": "text", "text": "p"}]}], False) == \
        "<|im_start|>user\np<|im_end|>\n"


def test_from_metadata_token_lookup():
    meta = {"tokenizer.chat_template": "{{ bos_token }}{{ eos_token }}{{ unk_token }}",
            "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>"],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0}
    assert ChatTemplate.from_metadata(meta).render([]) == "<s></s><unk>"
    t = ChatTemplate.from_metadata(meta, token_text=lambda i: f"[{i}]")
    assert (t.bos_token, t.eos_token) == ("[1]", "[2]")
    # ids out of range or missing: empty strings, not a crash
    t = ChatTemplate.from_metadata({"tokenizer.chat_template": "x", "tokenizer.ggml.tokens": ["a"],
                                    "tokenizer.ggml.bos_token_id": 7})
    assert (t.bos_token, t.eos_token, t.is_fallback) == ("", "", False)


# ---- limits: time and size (template_limits.py) -------------------------------------------------

from hostile_models import BOMBS  # noqa: E402


@pytest.mark.parametrize("name,source", BOMBS, ids=[b[0] for b in BOMBS])
def test_template_bombs_end_in_one_line(name, source):
    """Each would hang or take gigabytes unbounded; each ends in one TemplateError line. (The
    time_limit is a hang guard far above the 2 s render limit, not a timing claim.)"""
    from gguf_samples import time_limit

    with time_limit(60):
        with pytest.raises(TemplateError) as ei:
            ChatTemplate(source).render([{"role": "user", "content": "hi"}])
    msg = str(ei.value)
    assert "\n" not in msg and ("limit" in msg or "recursed" in msg), msg


def test_limits_leave_real_templates_alone():
    """A template doing ordinary work well inside the limits renders as before."""
    t = ChatTemplate("{% for m in messages %}{{ m.role|upper }}: {{ m.content|trim }}\n{% endfor %}"
                     "{{ '%-5s|' % 'ab' }}{{ '{:>4}'.format(7) }}{{ 'x'.center(9) }}{{ range(3)|list|join(',') }}"
                     "{{ ['a', 'b']|join('-') }}{{ 2 ** 10 }}{{ [1] * 3 }}{{ 'ab' ~ 'cd' }}")
    out = t.render([{"role": "user", "content": " hi "}] * 3)
    assert out == "USER: hi\n" * 3 + "ab   |   7    x    0,1,2a-b1024[1, 1, 1]abcd"
