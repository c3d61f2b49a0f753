"""A thinking model's answer in the terminal, as `ollama run` prints it.

A thinking template's (Qwen3, DeepSeek-R1: a ``<think>`` block) or a Harmony template's (gpt-oss:
the analysis channel) answer is split as the server splits it (format/tool_calls.py's parsers):
the reasoning under a "Thinking..." line, dimmed on a terminal, closed by "...done thinking." and a
blank line, then the answer; ``--hide-thinking`` prints the answer only. ``--think`` / ``--no-think``
reach the template as ``enable_thinking``, as the server's ``think: true / false``. Any other model's
text is printed as it comes, untouched.
"""

from __future__ import annotations

from typing import Optional, TextIO

from ..errors import GGUFRunError
from ..format.tool_calls import HarmonyParser, Reasoning, ThinkParser, ids_open_thinking, template_family

# ollama's readline colors: the reasoning in grey, its opening and closing lines in bold grey
GREY, BOLD, RESET = "\033[38;5;245m", "\033[1m", "\033[0m"
OPENING, CLOSING = "Thinking...\n", "...done thinking.\n\n"


def thinking_kind(engine) -> Optional[str]:
    """"harmony" (gpt-oss), "think" (a <think> block) or None: a model whose answers hold no reasoning."""
    if not engine.has_template:
        return None
    if template_family(engine.template.source) == "harmony":
        return "harmony"
    return "think" if engine.template.supports_thinking else None


def think_vars(engine, think: Optional[bool], name: str) -> dict:
    """The template variables of --think / --no-think (none when neither is given); --think on a
    model with no reasoning is refused, as Ollama refuses it."""
    if think and thinking_kind(engine) is None:
        raise GGUFRunError(f'"{name}" does not support thinking (its chat template has no reasoning); drop --think')
    return {} if think is None else {"enable_thinking": think}


def answer_parser(engine, ids: list[int], constrained: bool = False):
    """The parser of an answer to the prompt ``ids``: None for a model with no reasoning. A prompt that
    ends with ``<think>`` starts the answer inside the block, unless a grammar shapes the answer."""
    kind = thinking_kind(engine)
    if kind == "harmony":
        return HarmonyParser(calls=False)
    if kind == "think":
        opened = not constrained and ids_open_thinking(ids, engine.tokenizer)
        return ThinkParser(None, opened=opened)
    return None


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
