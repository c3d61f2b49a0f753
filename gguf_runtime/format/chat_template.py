"""Chat templates: turn a list of messages into the prompt text a model was trained on.

A GGUF file carries its model's template as a Jinja string (``tokenizer.chat_template``), written
for Hugging Face transformers. We render it the way transformers does (same Jinja options, same
helper functions and filters, same clean-up of the messages), so a prompt built here is the one the
model saw in training.

The template comes from the model file, and model files are downloaded from strangers: it is
untrusted code. It runs in Jinja's ``ImmutableSandboxedEnvironment`` and any attempt to reach
Python internals (``__class__``, ``__globals__``, ``mro``, a list's ``append``...) stops the render
with a :class:`~gguf_runtime.errors.TemplateError` instead of rendering an empty string. See
GHSA-56xg-wfcc-g829 (CVE-2024-34359) for the attack this blocks.

A file without a template gets a plain ChatML layout (like llama.cpp) and ``is_fallback`` set, so
the caller can say so in one line.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from . import template_limits as TL
from .tool_calls import THINK, THINK_END
from ..errors import TemplateError

__all__ = ["THINK_LEVELS", "ChatTemplate", "chatml_render", "think_variables", "thinking_template"]

_ADVICE_UNSAFE = "use --raw, or a trusted chat template"
_ADVICE_BROKEN = "use --raw, or a working chat template"
_MAX_MSG = 300  # characters of a template's own message kept in ours


def _one_line(text: Any, limit: int = _MAX_MSG) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


# ---- the sandbox ------------------------------------------------------------------------------

class _UnsafeAccess(SecurityError):
    """The template reached for an attribute the sandbox forbids; carries its name."""

    def __init__(self, attribute: str, owner: str) -> None:
        super().__init__(f"access to attribute {attribute!r} of {owner!r} object is unsafe")
        self.attribute = attribute
        self.owner = owner


class _TemplateRaised(Exception):
    """``raise_exception(msg)`` called by the template: it refuses this conversation."""


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, except that an unsafe attribute raises at once.

    Jinja's own sandbox returns an ``Undefined`` for an unsafe attribute; rendered bare (``{{
    self.__init__ }}``) or tested (``is defined``) it would pass silently. We want the attempt to be
    seen, so it raises. Ordinary undefined names and attributes (``message.tool_calls is defined``)
    still give the normal, lenient ``Undefined`` that templates rely on.
    """

    # every operator, call and ``~`` that can build a big string or list is checked first
    # (template_limits.py); so are time and the output
    intercepted_binops = frozenset(["*", "+", "**", "%"])
    code_generator_class = TL.LimitedCodeGenerator

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise _UnsafeAccess(str(attribute), type(obj).__name__)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        return TL.binop(operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - Jinja's
        TL.check_call(__obj, args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def limited_concat(self, items: Any) -> str:
        return TL.concat(items)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker): render the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Not Jinja's tojson: that one HTML-escapes '<', '>', '&' and '\''; transformers' doesn't.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` for templates, without handing them the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


NAMESPACE_NESTING = 512  # tuples inside tuples a template may keep in a namespace


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's ``namespace()`` refusing underscore names (no smuggling dunders through it) and tuples
    nested past NAMESPACE_NESTING: a namespace is a template's only way to grow a structure across
    loop steps, and hashing a tuple nested some 10^5 deep overflows the C stack (tuple hashing
    recurses without Python's recursion limit; lists and dicts do not hash, their repr and
    comparisons stop at it)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name, value in attrs.items():
            _TemplateNamespace._check(name)
            _TemplateNamespace._shallow(value)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        _TemplateNamespace._shallow(value)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _shallow(value: Any) -> None:
        """Raise TemplateLimit where ``value`` nests tuples in tuples past NAMESPACE_NESTING."""
        stack = [(value, 0)] if isinstance(value, tuple) else []
        while stack:
            v, depth = stack.pop()
            if depth >= NAMESPACE_NESTING:
                raise TL.TemplateLimit(f"a namespace value nests tuples more than {NAMESPACE_NESTING} levels deep")
            stack.extend((x, depth + 1) for x in v if isinstance(x, tuple))

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise _UnsafeAccess(name, "namespace")


def _make_env() -> _StrictSandbox:
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.finalize = TL.check_shown  # (each {{ value }} sized before it is printed)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    env.globals["range"] = TL.LimitedRange
    env.globals["lipsum"] = TL.lipsum
    TL.limit_filters(env.filters)
    return env


# ---- what the template sees -------------------------------------------------------------------

MAX_NESTING = 128  # levels of lists and dicts in what a template is given (messages, tools, extras)


def _plain(value: Any, depth: int = 0) -> Any:
    """Rebuild ``value`` from plain JSON-like types, so the template never holds a rich object;
    data nested past MAX_NESTING is refused (the rebuild and the template's own walks recurse)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if depth >= MAX_NESTING:
        raise TemplateError(f"the chat messages or tools are nested more than {MAX_NESTING} levels deep (lists and "
                            "objects inside each other); send flatter data")
    depth += 1
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k, depth): _plain(v, depth) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_plain(v, depth) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return _plain(value.item(), depth)  # numpy scalars
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name), depth) for f in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _prepare_messages(messages: Sequence[Any]) -> list[dict]:
    """What transformers does before rendering: copy, drop None values, alias reasoning fields."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TemplateError(f"chat message {i} is a {type(m).__name__}, not a dict with 'role' and "
                                "'content'; pass messages as dicts")
        m = {k: v for k, v in _plain(m).items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _content_text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of an OpenAI-style part list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        return "".join(str(p.get("text", "")) if isinstance(p, Mapping) else str(p) for p in content)
    return str(content)


def chatml_render(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """llama.cpp's ChatML default: ``<|im_start|>role\\ncontent<|im_end|>\\n`` per message."""
    parts = [f"<|im_start|>{m.get('role', 'user')}\n{_content_text(m.get('content'))}<|im_end|>\n"
             for m in messages]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


# ---- the template -----------------------------------------------------------------------------

def thinking_template(source: str | None) -> bool:
    """Whether a template's text is a thinking template's: its model opens an answer with its
    reasoning in ``<think>...</think>``. Qwen3's writes the tags around a message's
    ``reasoning_content`` and reads ``enable_thinking``; DeepSeek-R1's strips ``</think>`` from the
    history and opens ``<think>`` in its generation prompt; QwQ's does both."""
    s = source or ""
    return THINK in s or THINK_END in s or "enable_thinking" in s


THINK_LEVELS = ("low", "medium", "high")  # Ollama's think levels, OpenAI's reasoning_effort values
THINK_VARIABLES = ("enable_thinking", "reasoning_effort")  # the template variables think_variables sets


def think_variables(think: bool | str | None) -> dict:
    """The template variables of a reasoning control as Ollama's ``think`` sends it (the server's
    ``think``, the CLI's ``--think``): none for None (the template's default), ``enable_thinking``
    for true / false (Qwen3's switch), and for a level of THINK_LEVELS ``enable_thinking`` true with
    ``reasoning_effort`` (Harmony's "Reasoning: ..." line; a template that reads only
    ``enable_thinking``, as Qwen3's, just thinks). ValueError for any other value."""
    if think is None:
        return {}
    if isinstance(think, bool):
        return {"enable_thinking": think}
    if isinstance(think, str) and think in THINK_LEVELS:
        return {"enable_thinking": True, "reasoning_effort": think}
    raise ValueError(f"invalid think value {think!r}: true, false, or one of {', '.join(THINK_LEVELS)}")


class ChatTemplate:
    """A model's chat template, rendered in a sandbox (or ChatML when the model has none).

    ``render`` raises :class:`TemplateError` (one line) when the template is broken, refuses the
    conversation (``raise_exception``) or tries to leave the sandbox.
    """

    def __init__(self, template: str | None, bos_token: str = "", eos_token: str = "",
                 special_tokens: Mapping[str, str] | None = None) -> None:
        if isinstance(template, (bytes, bytearray)):
            template = bytes(template).decode("utf-8", errors="replace")
        if not isinstance(template, str) or not template.strip():
            template = None
        self.source: str | None = template
        self.is_fallback: bool = template is None
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        # Every special token transformers passes (bos/eos/unk/pad...), names as in special_tokens_map.
        self.special_tokens: dict[str, str] = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.special_tokens["bos_token"] = self.bos_token
        self.special_tokens["eos_token"] = self.eos_token
        self._compiled: jinja2.Template | None = None
        self._tools: bool | None = None

    @property
    def supports_tools(self) -> bool:
        """Whether the template reads a ``tools`` variable (a name in its code, not in its text): what
        the Ollama API calls the "tools" capability. The ChatML fallback has none."""
        if self._tools is None:
            self._tools = False
            if self.source is not None:
                try:
                    self._tools = any(kind == "name" and value in ("tools", "custom_tools")
                                      for _, kind, value in _make_env().lex(self.source))
                except Exception:  # noqa: BLE001 - a template that does not lex renders nothing either
                    self._tools = False
        return self._tools

    @property
    def supports_thinking(self) -> bool:
        """Whether this is a thinking template (thinking_template): with Harmony's, what the Ollama
        API calls the "thinking" capability. The ChatML fallback is not one."""
        return thinking_template(self.source)

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any],
                      token_text: Callable[[int], str] | None = None) -> "ChatTemplate":
        """The template of a GGUF file's metadata, with its special tokens' text."""
        tokens = meta.get("tokenizer.ggml.tokens")

        def text_of(key: str) -> str | None:
            tid = meta.get(key)
            if tid is None or isinstance(tid, bool):
                return None
            try:
                tid = int(tid)
                if token_text is not None:
                    return str(token_text(tid))
                if tokens is not None and 0 <= tid < len(tokens):
                    t = tokens[tid]
                    return t.decode("utf-8", errors="replace") if isinstance(t, (bytes, bytearray)) else str(t)
            except (TypeError, ValueError, IndexError, KeyError):
                return None
            return None

        special = {name: text_of(f"tokenizer.ggml.{key}_token_id")
                   for name, key in (("unk_token", "unknown"), ("pad_token", "padding"))}
        return cls(meta.get("tokenizer.chat_template"),
                   bos_token=text_of("tokenizer.ggml.bos_token_id") or "",
                   eos_token=text_of("tokenizer.ggml.eos_token_id") or "",
                   special_tokens=special)

    def _template(self) -> jinja2.Template:
        if self._compiled is None:
            assert self.source is not None
            try:
                with TL.Budget.render():  # constant folding runs filters at compile time
                    self._compiled = _make_env().from_string(self.source)
            except TL.TemplateLimit as e:
                raise TemplateError(f"the model's chat template went past a limit while compiling ({e}); "
                                    f"{_ADVICE_BROKEN}") from None
            except jinja2.TemplateSyntaxError as e:
                raise TemplateError(
                    f"the model's chat template has a syntax error at line {e.lineno}: "
                    f"{_one_line(e.message)}; {_ADVICE_BROKEN}") from None
            except Exception as e:  # noqa: BLE001 - anything else the compiler trips on
                raise TemplateError(f"the model's chat template cannot be compiled "
                                    f"({type(e).__name__}: {_one_line(e)}); {_ADVICE_BROKEN}") from None
        return self._compiled

    def check(self) -> None:
        """Compile now (raise a syntax error early); a no-op for the ChatML fallback."""
        if not self.is_fallback:
            self._template()

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        msgs = _prepare_messages(messages)
        if self.is_fallback:
            return chatml_render(msgs, add_generation_prompt)
        tpl = self._template()
        context: dict[str, Any] = {
            **self.special_tokens,
            "tools": None,
            "documents": None,
            "date_string": datetime.now().strftime("%d %b %Y"),  # llama.cpp's default
        }
        context.update(_plain(extra))
        context["messages"] = msgs
        context["add_generation_prompt"] = bool(add_generation_prompt)
        size = sum(len(str(v)) for m in msgs for v in m.values())
        try:
            with TL.Budget.render(input_chars=size):
                return TL.collect(tpl.generate(**context))
        except TL.TemplateLimit as e:
            raise TemplateError(f"the model's chat template went past a limit ({e or 'time'}); "
                                f"{_ADVICE_BROKEN}") from None
        except _UnsafeAccess as e:
            raise TemplateError(
                f"the model's chat template tried to access unsafe attribute {e.attribute!r} "
                f"(on a {e.owner} object) and was stopped; {_ADVICE_UNSAFE}") from None
        except SecurityError as e:
            raise TemplateError(f"the model's chat template tried an unsafe operation ({_one_line(e)}) "
                                f"and was stopped; {_ADVICE_UNSAFE}") from None
        except _TemplateRaised as e:
            raise TemplateError(f"the model's chat template rejected the conversation: {_one_line(e)}") from None
        except jinja2.TemplateSyntaxError as e:  # e.g. a bad {% include %}-free macro call at runtime
            raise TemplateError(f"the model's chat template has a syntax error at line {e.lineno}: "
                                f"{_one_line(e.message)}; {_ADVICE_BROKEN}") from None
        except RecursionError:
            raise TemplateError(f"the model's chat template recursed too deeply; {_ADVICE_BROKEN}") from None
        except Exception as e:  # noqa: BLE001 - the template is input: any failure is the template's
            raise TemplateError(f"the model's chat template failed to render these messages "
                                f"({type(e).__name__}: {_one_line(e)}); {_ADVICE_BROKEN}") from None
