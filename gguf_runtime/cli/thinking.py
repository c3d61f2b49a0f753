"""A thinking model's answer in the terminal, as `ollama run` prints it.

A thinking template's (Qwen3, DeepSeek-R1: a ``<think>`` block) or a Harmony template's (gpt-oss:
the analysis channel) answer is split as the server splits it (format/tool_calls.py's parsers):
the reasoning under a "Thinking..." line, dimmed on a terminal, closed by "...done thinking." and a
blank line, then the answer; ``--hide-thinking`` prints the answer only. ``--think`` / ``--no-think``
reach the template as ``enable_thinking`` and ``--think=LEVEL`` as ``reasoning_effort`` too, as the
server's ``think`` (format.chat_template.think_variables). Any other model's text is printed as it
comes, untouched.

``--think`` takes its value as Ollama's does: alone (on), ``--think=VALUE``, or ``--think VALUE`` when
the next word is one of the values (THINK_WORDS); ``think_argv`` rewrites each to ``--think=VALUE``
before click reads the command line, so a bare ``--think`` never takes the MODEL after it.
"""

from __future__ import annotations

from typing import Callable, Optional, TextIO

import typer

from ..errors import GGUFRunError
from ..format.chat_template import THINK_LEVELS, think_variables
from ..format.tool_calls import Reasoning, chat_answer_parser, ids_open_thinking, template_family

# ollama's readline colors: the reasoning in grey, its opening and closing lines in bold grey
GREY, BOLD, RESET = "\033[38;5;245m", "\033[1m", "\033[0m"
OPENING, CLOSING = "Thinking...\n", "...done thinking.\n\n"

THINK_WORDS = ("true", "false") + THINK_LEVELS  # --think's values, Ollama's
LEVELS_TEXT = "|".join(reversed(THINK_LEVELS))  # high|medium|low
Think = typer.Option(None, "--think", metavar="[LEVEL]", show_default=False,
                     help=f"a thinking model reasons (enable_thinking for its template); --think={LEVELS_TEXT} "
                          "(or --think high) sets its reasoning_effort too, which gpt-oss's template reads "
                          "(Qwen3's just thinks); --think=false is --no-think (default: the template's own)")
NoThink = typer.Option(False, "--no-think", help="a thinking model answers without reasoning (enable_thinking "
                                                 "false; gpt-oss reasons anyway)")


def think_argv(args: list[str], takes_value: Callable[[str, str], Optional[bool]]) -> list[str]:
    """``args`` (a command name first) with run's and chat's ``--think`` as ``--think=VALUE``: a bare
    ``--think`` is ``--think=true``, ``--think WORD`` is ``--think=WORD`` when WORD is one of
    THINK_WORDS. ``takes_value(command, option)``: whether an option reads the next word (``-p
    --think``: a prompt, left as it is); words after ``--`` pass as they are."""
    if not args or args[0] not in ("run", "chat"):
        return args
    out, i = [args[0]], 1
    while i < len(args):
        a = args[i]
        if a == "--":
            return out + args[i:]
        i += 1
        if a == "--think":
            word = args[i] if i < len(args) and args[i] in THINK_WORDS else None
            out.append(f"--think={word or 'true'}")
            i += word is not None
            continue
        out.append(a)
        if a.startswith("-") and "=" not in a and takes_value(args[0], a) and i < len(args):
            out.append(args[i])
            i += 1
    return out


def think_choice(think: Optional[str], no_think: bool) -> "bool | str | None":
    """--think's value and --no-think as one: None (neither: the template's default), true / false,
    or a level; any other value stops with one line, worded as Ollama's."""
    if think is not None and no_think:
        raise GGUFRunError("give --think or --no-think, not both")
    if no_think:
        return False
    if think is None or think in THINK_LEVELS:
        return think
    if think in ("", "true", "false"):  # ("": --think=, on as Ollama reads it)
        return think != "false"
    raise GGUFRunError(f'invalid value for --think: "{think}" (must be true, false, high, medium, or low)')


def thinking_kind(engine) -> Optional[str]:
    """"harmony" (gpt-oss), "think" (a <think> block) or None: a model whose answers hold no reasoning."""
    if not engine.has_template:
        return None
    if template_family(engine.template.source) == "harmony":
        return "harmony"
    return "think" if engine.template.supports_thinking else None


def think_vars(engine, think: "bool | str | None", name: str) -> dict:
    """The template variables of --think / --think=LEVEL / --no-think (think_choice's value; none
    when neither is given); thinking on a model with no reasoning is refused, as Ollama refuses it."""
    if think not in (None, False) and thinking_kind(engine) is None:
        raise GGUFRunError(f'"{name}" does not support thinking (its chat template has no reasoning); drop --think')
    return think_variables(think)


def answer_parser(engine, ids: list[int], constrained: bool = False):
    """The parser of an answer to the prompt ``ids``: None for a model with no reasoning. A prompt that
    ends with ``<think>`` starts the answer inside the block, unless a grammar shapes the answer."""
    kind = thinking_kind(engine)
    if kind is None:
        return None
    opened = kind == "think" and not constrained and ids_open_thinking(ids, engine.tokenizer)
    return chat_answer_parser(template_family(engine.template.source), kind == "think", opened=opened)


class ThinkingPrinter:
    """Prints an answer's events (``str`` content, :class:`Reasoning`) as they come."""

    def __init__(self, out: TextIO, hide: bool = False, color: Optional[bool] = None) -> None:
        self.out, self.hide = out, hide
        self.color = out.isatty() if color is None else color
        self.thinking = False  # the reasoning is being printed: the closing line is still due
        self.newline = True  # the reasoning printed so far ends with a newline

    def show(self, events) -> None:
        """One event or a list of them; the output is flushed."""
        for e in events if isinstance(events, list) else [events]:
            if isinstance(e, Reasoning):
                if self.hide or not e.text:
                    continue
                if not self.thinking:
                    self.thinking = True
                    self.out.write(self._styled(OPENING, BOLD))
                self.out.write(self._styled(e.text))  # colored a piece at a time: Ctrl-C leaves no color on
                self.newline = e.text.endswith("\n")
            elif isinstance(e, str) and e:
                if self.thinking:
                    self.thinking = False
                    self.out.write(("" if self.newline else "\n") + self._styled(CLOSING, BOLD))
                self.out.write(e)
        self.out.flush()

    def _styled(self, text: str, bold: str = "") -> str:
        return GREY + bold + text + RESET if self.color else text
