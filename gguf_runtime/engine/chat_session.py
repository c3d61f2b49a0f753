"""An interactive conversation with a model: its messages, its turns, and the context they must fit.

This is the core of `gguf-run chat`, with no terminal in it (the REPL in ``cli/chat_cmd.py`` reads,
prints and handles keys). A :class:`ChatSession` keeps the messages (an optional system message,
then user/assistant pairs), renders them with the model's chat template and hands them to the
:class:`~gguf_runtime.engine.Engine`, which keeps the previous turn's tokens in the KV cache and
evaluates only the tokens after the longest common prefix: a turn prefills just the end of the
last reply, the new user message and the assistant header.

Context: before a turn, the conversation plus the new message plus room for a reply
(``reply_reserve``, by default ``min(256, n_ctx // 4)`` tokens) must fit ``n_ctx``. When it does
not, the oldest user/assistant pairs are dropped (the system message stays). Dropping old turns
changes the start of the prompt, so the whole conversation is evaluated again; to make that rare,
trimming goes on until the prompt takes at most ``trim_to`` of the context (half, as llama.cpp's
and Ollama's context shift discards half). A message that does not fit even alone raises a
one-line :class:`~gguf_runtime.errors.ContextOverflowError` and leaves the conversation as it was.

Reasoning: with ``answer_parser`` (a function of the prompt's ids returning a parser of
format/tool_calls.py, or None) a reply yields the parser's events, ``str`` content and
:class:`~gguf_runtime.format.tool_calls.Reasoning`, and its message keeps the reasoning apart as
``thinking`` (what the templates read), so the next turn renders as the template expects.
``think`` (on, off or a level; :meth:`ChatSession.set_think` changes it between turns) reaches the
template at each turn as format.chat_template.think_variables maps it, with ``template_vars``.

Interruption: a reply is an iterator; whatever has streamed is already in the history, so an
interrupted reply (Ctrl-C inside the generation, or the caller stopping the iteration and calling
:meth:`Reply.close`) keeps its partial text and the next turn works from there.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from ..errors import ContextOverflowError, GGUFRunError
from ..format.chat_template import THINK_LEVELS, THINK_VARIABLES, think_variables
from ..format.tool_calls import Reasoning
from ..sampling import SamplingParams
from .engine import check_spec

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine, Generation, GenerationStats

__all__ = ["ChatSession", "Reply", "SettingError", "PARAMETERS"]


class SettingError(GGUFRunError):
    """A `/set` with an unknown name or a bad value (one line)."""


# name -> (type, what it is); names as Ollama's `/set parameter` spells them
PARAMETERS: dict[str, tuple[type, str]] = {
    "temperature": (float, "temperature; 0 = greedy"),
    "top_k": (int, "keep the k most likely tokens; 0 = off"),
    "top_p": (float, "nucleus sampling threshold; 1 = off"),
    "min_p": (float, "drop tokens below min_p x the top probability; 0 = off"),
    "repeat_penalty": (float, "penalize recent tokens; 1 = off"),
    "repeat_last_n": (int, "tokens of history penalized; 0 = off, -1 = all"),
    "seed": (int, "random seed; 'none' = a new one each reply"),
    "num_predict": (int, "tokens per reply at most; -1 = until the end of the turn or of the context"),
}
_ALIASES = {"temp": "temperature", "n_predict": "num_predict", "top-k": "top_k", "top-p": "top_p",
            "min-p": "min_p", "repeat-penalty": "repeat_penalty", "repeat-last-n": "repeat_last_n",
            "num-predict": "num_predict", "n-predict": "num_predict"}


class Reply:
    """One assistant reply, streamed: iterate for its text pieces (with an answer parser, its events).

    Every piece is appended to the history as it arrives, so stopping early (an exception inside the
    generation, or :meth:`close`) keeps the partial reply. ``dropped`` is the number of old turns
    dropped to make room, known before the first piece.
    """

    def __init__(self, session: "ChatSession", generation: "Generation", message: dict, dropped: int,
                 n_prompt: int, parser: Any = None) -> None:
        self.session = session
        self.generation = generation
        self.message = message  # the assistant message in session history; its content grows
        self.dropped = dropped
        self.n_prompt = n_prompt  # tokens of the whole rendered conversation
        self.parser = parser  # a thinking model's answer parser: events instead of text pieces
        self._parsed = False  # the parser's finish() was called
        self.finished = False  # True once the generation ended on its own (stop, length, context)
        self.closed = False
        self._started = False
        self._it = self._stream()

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        self._started = True
        return next(self._it)

    @property
    def text(self) -> str:
        return self.message["content"]

    @property
    def stats(self) -> "GenerationStats":
        return self.generation.stats

    @property
    def stop_reason(self) -> str:
        """One of: stop (end-of-turn token), length (num_predict), context (context full), interrupted."""
        return self.generation.stats.stop_reason

    @property
    def interrupted(self) -> bool:
        return self.stop_reason == "interrupted"

    def _add(self, event: Any) -> None:
        if isinstance(event, str):
            self.message["content"] += event
        elif isinstance(event, Reasoning):
            self.message["thinking"] = self.message.get("thinking", "") + event.text

    def _stream(self) -> Iterator[Any]:
        pieces = iter(self.generation)
        parser = self.parser
        try:
            for piece in pieces:
                if parser is None:
                    self.message["content"] += piece
                    yield piece
                    continue
                for event in parser.feed(piece):
                    self._add(event)
                    yield event
            if parser is not None:
                self._parsed = True
                for event in parser.finish():
                    self._add(event)
                    yield event
            self.finished = True
        finally:
            if parser is not None and not self._parsed:  # what the parser held back stays in the history
                self._parsed = True
                for event in parser.finish():
                    self._add(event)
            if not self.finished:
                self.generation.close()  # the engine's clean-up: the cache keeps what was evaluated
                self.generation.stats.stop_reason = "interrupted"
            self.closed = True
            self.session._reply_done(self)

    def close(self) -> None:
        """Stop the reply now (the partial text stays in the history)."""
        if self.closed:
            return
        if not self._started:  # never iterated: nothing ran, nothing to clean up in the engine
            self.generation.stats.stop_reason = "interrupted"
            self.closed = True
            self._it.close()
            self.session._reply_done(self)
            return
        self._it.close()

    def read(self) -> str:
        """Run the reply to its end and return its text."""
        for _ in self:
            pass
        return self.text


class ChatSession:
    """A conversation with ``engine``: ``send(text)`` streams the reply; the history stays in the cache."""

    def __init__(self, engine: "Engine", params: Optional[SamplingParams] = None, system: Optional[str] = None,
                 n_predict: int = -1, reply_reserve: Optional[int] = None, trim_to: float = 0.5,
                 spec: str = "none", spec_k: int = 4, template_vars: Optional[dict] = None,
                 answer_parser: Optional[Callable[[list[int]], Any]] = None,
                 think: "bool | str | None" = None) -> None:
        check_spec(spec, spec_k, getattr(engine, "draft", None) is not None)
        self.spec, self.spec_k = spec, spec_k  # speculative decoding of every reply (Engine.generate)
        self.engine = engine
        self.template_vars = dict(template_vars or {})
        self.think: "bool | str | None" = None  # set_think's; None: the template's default
        self.answer_parser = answer_parser
        self.params = dataclasses.replace(params) if params is not None else SamplingParams()
        self.params.validate()
        if n_predict < -1:
            raise SettingError(f"num_predict must be -1 (no limit) or more, got {n_predict}")
        self.n_predict = n_predict
        self.system: Optional[str] = system or None
        n_ctx = engine.n_ctx
        self.reply_reserve = max(1, min(256, n_ctx // 4)) if reply_reserve is None else max(1, reply_reserve)
        self.trim_to = trim_to
        self.turns: list[dict] = []  # user, assistant, user, assistant... (always whole pairs)
        self.last: Optional[Reply] = None  # the latest reply
        self.n_replies = 0
        self.dropped_total = 0
        self._active: Optional[Reply] = None
        if think is not None:
            self.set_think(think)

    # ---- the conversation ----------------------------------------------------------------------
    @property
    def messages(self) -> list[dict]:
        """The conversation as the template sees it (copies): system message first, if any."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [dict(m) for m in self.turns]

    @property
    def n_turns(self) -> int:
        return len(self.turns) // 2

    @property
    def n_ctx(self) -> int:
        return self.engine.n_ctx

    @property
    def n_cached(self) -> int:
        """Tokens of the conversation now in the KV cache."""
        return len(self.engine.cached)

    def _render(self, turns: list[dict]) -> list[int]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return self.engine.encode_chat(head + turns, **self.template_vars)

    def send(self, text: str) -> Reply:
        """Add a user message and start the reply (iterate it for the pieces).

        Raises a one-line ``GGUFRunError`` (and changes nothing) when the message is empty, the
        template refuses the conversation, or the message does not fit the context even alone.
        """
        if not isinstance(text, str) or not text.strip():
            raise GGUFRunError("the message is empty")
        self._stop_active()
        user = {"role": "user", "content": text}
        n_ctx, reserve = self.n_ctx, self.reply_reserve
        turns = list(self.turns)
        ids = self._render(turns + [user])
        dropped = 0
        if len(ids) + reserve > n_ctx:
            target = min(n_ctx - reserve, int(n_ctx * self.trim_to))
            while turns and len(ids) > target:
                del turns[:2]
                dropped += 1
                ids = self._render(turns + [user])
            if len(ids) + reserve > n_ctx:
                raise ContextOverflowError(
                    f"the message needs {len(ids)} tokens (with the template"
                    f"{' and the system message' if self.system else ''}) but the context holds {n_ctx} "
                    f"and must keep {reserve} for the reply; shorten it or raise --ctx-size")
        spec = {"spec": self.spec, "spec_k": self.spec_k} if self.spec != "none" else {}
        generation = self.engine.generate(ids, n_predict=self.n_predict, params=dataclasses.replace(self.params),
                                          **spec)
        reply_msg = {"role": "assistant", "content": ""}
        self.turns = turns + [user, reply_msg]
        self.dropped_total += dropped
        parser = self.answer_parser(ids) if self.answer_parser is not None else None
        reply = Reply(self, generation, reply_msg, dropped, len(ids), parser)
        self._active = reply
        self.last = reply
        self.n_replies += 1
        return reply

    def chat(self, text: str) -> str:
        """Send ``text`` and return the whole reply."""
        return self.send(text).read()

    def _stop_active(self) -> None:
        if self._active is not None:
            self._active.close()
            self._active = None

    def _reply_done(self, reply: Reply) -> None:
        if self._active is reply:
            self._active = None

    def clear(self) -> None:
        """Forget the conversation (the system message stays) and empty the KV cache."""
        self._stop_active()
        self.turns = []
        self.last = None
        self.engine.reset()

    def set_system(self, text: Optional[str]) -> None:
        """Set (or with ``None``/empty, remove) the system message; the conversation stays."""
        self._stop_active()
        self.system = text if text and text.strip() else None

    # ---- settings ------------------------------------------------------------------------------
    def set_think(self, think: "bool | str | None") -> None:
        """Thinking on or off (a bool), at a level (one of THINK_LEVELS) or as the template's default
        (None) from the next turn on; the conversation stays. SettingError for another level."""
        try:
            variables = think_variables(think)
        except ValueError:
            raise SettingError(f"unknown think level '{think}'; one of: {', '.join(THINK_LEVELS)}") from None
        self._stop_active()
        kept = {k: v for k, v in self.template_vars.items() if k not in THINK_VARIABLES}
        self.template_vars, self.think = {**kept, **variables}, think

    @staticmethod
    def parameter_name(name: str) -> str:
        key = name.strip().lower()
        key = _ALIASES.get(key, key)
        if key == "num_ctx":
            raise SettingError("num_ctx is fixed when the model loads; restart with -c/--ctx-size N")
        if key not in PARAMETERS:
            raise SettingError(f"unknown parameter '{name}'; one of: {', '.join(PARAMETERS)}")
        return key

    def set(self, name: str, value: str | int | float | None) -> Any:
        """Set a sampling parameter (or ``num_predict``) from text as typed; returns the new value.

        Raises :class:`SettingError` (one line) for an unknown name or a bad value; nothing changes then.
        """
        key = self.parameter_name(name)
        kind = PARAMETERS[key][0]
        raw = value.strip() if isinstance(value, str) else value
        if raw is None or raw == "":
            raise SettingError(f"give a value: /set {key} VALUE")
        if key == "seed" and isinstance(raw, str) and raw.lower() in ("none", "random", "-1"):
            parsed: Any = None
        else:
            try:
                if kind is int:
                    if isinstance(raw, float) and not raw.is_integer():
                        raise ValueError
                    parsed = int(raw) if not isinstance(raw, str) else int(raw, 10)
                else:
                    parsed = float(raw)
            except (TypeError, ValueError):
                what = "an integer" if kind is int else "a number"
                raise SettingError(f"{key} must be {what}, got '{value}'") from None
        if key == "num_predict":
            if parsed < -1:
                raise SettingError(f"num_predict must be -1 (no limit) or more, got {parsed}")
            self.n_predict = parsed
            return parsed
        trial = dataclasses.replace(self.params, **{key: parsed})
        try:
            trial.validate()
        except ValueError as e:
            raise SettingError(str(e)) from None
        self.params = trial
        return parsed

    def get(self, name: str) -> Any:
        key = self.parameter_name(name)
        return self.n_predict if key == "num_predict" else getattr(self.params, key)

    def settings(self) -> dict[str, Any]:
        return {k: self.get(k) for k in PARAMETERS}
