"""`gguf-run chat`: an interactive conversation in the terminal, as `ollama run` has.

Reading, key handling and printing only; the conversation itself (template, KV-cache reuse,
context trimming, settings) is :class:`gguf_runtime.chat_session.ChatSession`.

Keys: Ctrl-C during a reply stops it (the partial reply stays in the history); Ctrl-C at the
prompt drops the line being typed (it goes to the line history: Up brings it back); Ctrl-D at an
empty prompt exits. A line starting with ``\"\"\"`` opens a multi-line message that a line ending
with ``\"\"\"`` closes. When stdin is not a terminal, lines are read as typed messages with no
prompts echoed (``printf 'hi\\n/bye\\n' | gguf-run chat``).
"""

from __future__ import annotations

import os
import signal
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, TextIO

import typer

from ..engine.chat_session import PARAMETERS, ChatSession, Reply
from ..engine.engine import Engine
from ..errors import GGUFRunError, printable
from ..format.model_info import human_count, quant_histogram
from .app import app
from .options import (TensorParallel, Backend, CacheTypeK, CacheTypeV, CtxSize, MinP, ModelArg, NoGraph, Quiet, RepeatPenalty, Seed,
                      Draft, SpecK, SpecMode, Temp, TopK, TopP, check_n_predict, kv_types, note_printer, resolve_model,
                      sampling_params, spec_choice)
from .progress import progress_bars
from .stats import print_stats
from .thinking import NoThink, Think, ThinkingPrinter, answer_parser, think_choice, think_vars, thinking_kind

PROMPT = ">>> "
CONTINUATION = "... "
BLOCK = '"""'
EXIT_HINT = "Use Ctrl + d or /bye to exit."
NO_THINKING = "this model does not support thinking (its chat template has no reasoning)"

HELP = f"""Available Commands:
  /set            Set session variables (/set alone lists them)
  /show           Show model information (/show alone lists what)
  /system TEXT    Set the system message (/system alone removes it)
  /clear          Clear session context
  /stats          Show the last reply's timings and the context in use
  /history        Show the conversation so far
  /bye, /exit     Exit
  /?, /help       Help for a command

Use {BLOCK} to begin a multi-line message.
Ctrl + c stops a reply; Ctrl + d or /bye exits."""

SET_HELP = "Available Commands:\n" + "\n".join(
    [f"  /set parameter {name:<15}{doc}" for name, (_, doc) in PARAMETERS.items()]
    + ["  /set system TEXT              Set the system message",
       "  /set verbose                  Show timings after each reply",
       "  /set quiet                    Hide timings",
       "  /set think [LEVEL]            A thinking model reasons (LEVEL: high, medium or low, which",
       "                                gpt-oss's template reads; Qwen3's just thinks)",
       "  /set nothink                  A thinking model answers without reasoning (gpt-oss reasons anyway)",
       "  /set hidethinking             Print the answers without their reasoning",
       "  /set nohidethinking           Print the reasoning too",
       "", "  /set NAME VALUE is short for /set parameter NAME VALUE."])

SHOW_HELP = """Available Commands:
  /show info          Show details for this model
  /show parameters    Show the sampling parameters in use
  /show system        Show the system message
  /show template      Show the chat template"""


# ---- reading messages ---------------------------------------------------------------------------

@dataclass
class Message:
    text: str
    command: bool  # a `/...` line (or a `/cmd \"\"\"...\"\"\"` block), else a message for the model


class MessageReader:
    """Assembles input lines into messages, with Ollama's multi-line rule.

    A line starting with ``\"\"\"`` opens a block; the block ends with the first line ending in
    ``\"\"\"`` (``\"\"\"one line\"\"\"`` is a block of one line). A command may take a block too:
    ``/system \"\"\"`` ... ``\"\"\"``. A block is a message for the model even if it starts with ``/``.
    """

    def __init__(self) -> None:
        self._lines: Optional[list[str]] = None
        self._prefix = ""

    @property
    def in_block(self) -> bool:
        return self._lines is not None

    @property
    def prompt(self) -> str:
        return CONTINUATION if self.in_block else PROMPT

    def cancel(self) -> str:
        """Drop the open block; returns its text so far."""
        text = "\n".join(self._lines or [])
        self._lines, self._prefix = None, ""
        return text

    def feed(self, line: str) -> Optional[Message]:
        """One input line (no newline); returns a complete message, or None while a block is open."""
        line = line.rstrip("\r\n")
        if self._lines is not None:
            if line.endswith(BLOCK):
                self._lines.append(line[: -len(BLOCK)])
                return self._close()
            self._lines.append(line)
            return None
        stripped = line.lstrip()
        if stripped.startswith(BLOCK):
            prefix, rest = "", stripped[len(BLOCK):]
        elif stripped.startswith("/") and BLOCK in stripped:
            i = stripped.index(BLOCK)
            prefix, rest = stripped[:i], stripped[i + len(BLOCK):]
        else:
            return Message(line, command=stripped.startswith("/"))
        self._prefix = prefix
        if rest.endswith(BLOCK):
            self._lines = [rest[: -len(BLOCK)]]
            return self._close()
        self._lines = [rest]
        return None

    def _close(self) -> Message:
        text = "\n".join(self._lines or []).strip("\n")
        prefix = self._prefix
        self._lines, self._prefix = None, ""
        if prefix:
            return Message(prefix.rstrip() + " " + text, command=True)
        return Message(text, command=False)


# ---- the REPL -----------------------------------------------------------------------------------

@contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Let a clean-up finish even if Ctrl-C is pressed again meanwhile."""
    try:
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except (ValueError, OSError):  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _one_line(text: str, limit: int = 72) -> str:
    s = " ".join(text.split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


class Repl:
    def __init__(self, session: ChatSession, verbose: bool = False, quiet: bool = False,
                 stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout, stderr: TextIO = sys.stderr,
                 read_line: Optional[Callable[[str], str]] = None, hide_thinking: bool = False) -> None:
        self.session = session
        self.hide_thinking = hide_thinking  # a thinking model's reasoning is not printed
        self.verbose = verbose
        self.quiet = quiet
        self.out = stdout
        self.errout = stderr
        self.interactive = stdin.isatty()
        self.reader = MessageReader()
        self.readline = None
        if read_line is not None:
            self._input = read_line
        elif self.interactive:
            try:
                import readline  # noqa: F401 - line editing and history for input()
                self.readline = readline
            except ImportError:
                pass
            self._input = input
        else:
            self._input = lambda _prompt: self._read_pipe(stdin)

    @staticmethod
    def _read_pipe(stdin: TextIO) -> str:
        line = stdin.readline()
        if not line:
            raise EOFError
        return line

    # ---- output helpers ----------------------------------------------------------------------
    def say(self, msg: str = "") -> None:
        print(msg, file=self.out, flush=True)

    def note(self, msg: str) -> None:
        if not self.quiet:
            print(msg, file=self.errout, flush=True)

    def error(self, msg: str) -> None:
        print(f"error: {printable(msg)}", file=self.errout, flush=True)

    # ---- the loop ----------------------------------------------------------------------------
    def run(self) -> int:
        """Read and answer until /bye or Ctrl-D; returns the exit status (0)."""
        if self.interactive:
            self.note("Send a message (/? for help, Ctrl + d or /bye to exit)")
        while True:
            try:
                if self._step() == "exit":
                    return 0
            except KeyboardInterrupt:  # Ctrl-C between a reply and the prompt: back to the prompt
                with _sigint_ignored():
                    self.out.write("\n")
                    self.out.flush()

    def _step(self) -> Optional[str]:
        try:
            line = self._input(self.reader.prompt if self.interactive else "")
        except KeyboardInterrupt:
            with _sigint_ignored():
                self._on_prompt_interrupt()
            return None
        except EOFError:  # Ctrl-D
            if self.interactive:
                self.out.write("\n")
                self.out.flush()
            return "exit"
        msg = self.reader.feed(line)
        if msg is None:
            return None
        if msg.command:
            return self.command(msg.text)
        if msg.text.strip():
            self.reply(msg.text)
        return None

    def _on_prompt_interrupt(self) -> None:
        typed = ""
        if self.readline is not None:
            try:
                typed = self.readline.get_line_buffer()
            except Exception:  # noqa: BLE001 - best effort
                typed = ""
        block = self.reader.cancel() if self.reader.in_block else None
        if self.readline is not None:  # keep what was typed: Up brings it back
            for text in (block, typed):
                if text and text.strip():
                    self.readline.add_history(text if text is typed else BLOCK + text.replace("\n", " "))
        self.out.write("\n")
        if block is None and not typed:
            self.out.write(EXIT_HINT + "\n")
        self.out.flush()

    # ---- a turn ------------------------------------------------------------------------------
    def reply(self, text: str) -> None:
        try:
            reply = self.session.send(text)
        except KeyboardInterrupt:
            self.say()
            return
        except GGUFRunError as e:
            self.error(str(e))
            return
        if reply.dropped:
            self.note(f"note: context full, dropped the oldest {reply.dropped} turn(s)")
        out = self.out
        view = ThinkingPrinter(out, hide=self.hide_thinking)  # plain text goes out as it comes
        try:
            for piece in reply:
                view.show(piece)
        except KeyboardInterrupt:
            with _sigint_ignored():
                reply.close()
                out.write("\n")
                out.flush()
            return
        except GGUFRunError as e:
            with _sigint_ignored():
                reply.close()
            out.write("\n")
            out.flush()
            self.error(str(e))
            return
        out.write("\n\n")
        out.flush()
        if reply.stop_reason == "context":
            self.note(f"note: the reply filled the context ({self.session.n_ctx} tokens) and was cut off; "
                      "the next message drops the oldest turns")
        if self.verbose:
            self._print_stats(reply, self.errout)
            print(file=self.errout, flush=True)

    def _print_stats(self, reply: Reply, out: TextIO, reason: bool = False) -> None:
        print_stats(reply.stats, out=out)
        print(f"{'context:':<22}{self.session.n_cached}/{self.session.n_ctx} token(s)", file=out, flush=True)
        if reason:
            print(f"{'done reason:':<22}{reply.stop_reason}", file=out, flush=True)

    # ---- commands ----------------------------------------------------------------------------
    def command(self, line: str) -> Optional[str]:
        parts = line.strip().split(None, 1)
        name = parts[0].lower()
        rest = parts[1] if len(parts) > 1 else ""
        if name in ("/bye", "/exit"):
            return "exit"
        if name in ("/help", "/?"):
            topic = rest.strip().lower().lstrip("/")
            self.say({"set": SET_HELP, "show": SHOW_HELP}.get(topic, HELP))
        elif name == "/clear":
            self.session.clear()
            self.say("Cleared session context")
        elif name == "/system":
            self.session.set_system(rest)
            self.say("Set system message." if self.session.system else "Removed the system message.")
        elif name == "/set":
            self._set(rest)
        elif name == "/show":
            self._show(rest)
        elif name == "/stats":
            if self.session.last is None:
                self.say("No reply yet.")
            else:
                self._print_stats(self.session.last, self.out, reason=True)
        elif name == "/history":
            self._history()
        else:
            self.say(f"Unknown command '{parts[0]}'. Type /? for help")
        return None

    def _set(self, rest: str) -> None:
        words = rest.split(None, 1)
        if not words:
            self.say(SET_HELP + "\n\n" + self._think_state())
            return
        sub = words[0].lower()
        arg = words[1] if len(words) > 1 else ""
        if sub == "system":
            self.session.set_system(arg)
            self.say("Set system message." if self.session.system else "Removed the system message.")
        elif sub in ("verbose", "quiet"):
            self.verbose = sub == "verbose"
            self.say(f"Set '{sub}' mode.")
        elif sub in ("hidethinking", "nohidethinking"):
            self.hide_thinking = sub == "hidethinking"
            self.say(f"Set '{sub}' mode.")
        elif sub in ("think", "nothink"):
            self._set_think(sub, arg.strip())
        else:
            if sub == "parameter":
                words = arg.split(None, 1)
                if not words:
                    self.say(SET_HELP)
                    return
                sub, arg = words[0], (words[1] if len(words) > 1 else "")
            try:
                value = self.session.set(sub, arg.strip())
            except GGUFRunError as e:
                self.error(str(e))
                return
            key = self.session.parameter_name(sub)
            self.say(f"Set parameter '{key}' to '{'none' if value is None else value}'")

    def _set_think(self, sub: str, level: str) -> None:
        """/set think [LEVEL], /set nothink (Ollama's words): the next turns' template variables; a
        model with no reasoning keeps its setting, with one line."""
        think = False if sub == "nothink" else level or True
        if think is not False and thinking_kind(self.session.engine) is None:
            self.error(NO_THINKING)
            return
        try:
            self.session.set_think(think)
        except GGUFRunError as e:
            self.error(str(e))
            return
        self.say(f"Set 'think' mode to '{level}'." if sub == "think" and level else f"Set '{sub}' mode.")

    def _think_state(self) -> str:
        """/set's line on thinking: the mode the next turn renders with, and whether the reasoning prints."""
        if thinking_kind(self.session.engine) is None:
            return f"Thinking: {NO_THINKING}."
        t = self.session.think
        mode = "the template's default" if t is None else "on" if t is True else "off" if t is False else t
        if t is False and thinking_kind(self.session.engine) == "harmony":
            mode = "off (gpt-oss reasons anyway)"
        return f"Thinking: {mode}; reasoning {'hidden' if self.hide_thinking else 'shown'}."

    def _show(self, rest: str) -> None:
        what = rest.strip().lower()
        s, eng = self.session, self.session.engine
        if what == "info":
            cfg = eng.cfg
            params = sum(r.params for r in quant_histogram(eng.gguf))
            rows = [("file", eng.path), ("architecture", cfg.arch)]
            if cfg.name:
                rows.append(("name", cfg.name))
            if params:
                rows.append(("parameters", human_count(params)))
            rows += [("layers", str(cfg.n_layer)), ("embedding length", str(cfg.n_embd)),
                     ("context length", f"{eng.n_ctx} (trained {cfg.n_ctx_train})"),
                     ("backend", type(eng.backend).__name__),
                     ("chat template", "the model's" if eng.has_template else "ChatML (the model has none)")]
            self.say("  Model")
            for k, v in rows:
                self.say(f"    {k:<20}{v}")
        elif what in ("parameters", "params"):
            for k, v in s.settings().items():
                self.say(f"{k:<16}{'none' if v is None else v}")
        elif what == "system":
            self.say(s.system if s.system else "No system message was specified for this session.")
        elif what == "template":
            self.say(eng.template.source if eng.has_template else "ChatML (built-in: the model has no template)")
        else:
            self.say(SHOW_HELP)

    def _history(self) -> None:
        msgs = self.session.messages
        if not msgs:
            self.say("The conversation is empty.")
            return
        for i, m in enumerate(msgs, 1):
            self.say(f"{i:>3} {m['role']:<9}  {_one_line(m['content'])}")


# ---- the command --------------------------------------------------------------------------------

@app.command("chat", epilog="Examples:\n\n  gguf-run chat\n\n"
             "  gguf-run chat model.gguf --system 'You are terse.' --temp 0.3 --verbose\n\n"
             f"  In the chat: /? for help, {BLOCK} for a multi-line message, Ctrl + d or /bye to exit.")
def chat(
    model: Optional[str] = ModelArg,
    n_predict: int = typer.Option(-1, "-n", "--n-predict",
                                  help="tokens per reply at most (-1: until the end of the turn or the context)"),
    temp: float = Temp,
    top_k: int = TopK,
    top_p: float = TopP,
    min_p: float = MinP,
    repeat_penalty: float = RepeatPenalty,
    seed: Optional[int] = Seed,
    ctx_size: Optional[int] = CtxSize,
    system: Optional[str] = typer.Option(None, "--system", help="system message"),
    backend: str = Backend,
    cache_type_k: str = CacheTypeK,
    cache_type_v: str = CacheTypeV,
    tensor_parallel: int = TensorParallel,
    no_graph: bool = NoGraph,
    verbose: bool = typer.Option(False, "--verbose", help="print timings after each reply, like `ollama run --verbose`"),
    quiet: bool = Quiet,
    spec_mode: str = SpecMode,
    spec_k: int = SpecK,
    draft: Optional[str] = Draft,
    think: Optional[str] = Think,
    no_think: bool = NoThink,
    hide_thinking: bool = typer.Option(False, "--hide-thinking",
                                       help="print a thinking model's answers without their reasoning"),
) -> None:
    """Chat with a model in the terminal, as `ollama run` does (default model when MODEL is omitted)."""
    check_n_predict(n_predict)
    thinks = think_choice(think, no_think)
    spec_mode = spec_choice(spec_mode, spec_k, draft)  # (before the model loads)
    params = sampling_params(temp, top_k, top_p, min_p, repeat_penalty, seed)
    kv = kv_types(cache_type_k, cache_type_v)
    path = resolve_model(model)
    note = note_printer(quiet)
    with progress_bars(quiet) as progress:
        eng = Engine(path, backend=backend, n_ctx=ctx_size, progress=progress, note=note, use_graph=not no_graph,
                     kv_types=kv, tensor_parallel=tensor_parallel, draft=draft)
    if not eng.has_template and note:
        note("note: the model has no chat template; using a plain ChatML layout")
    think_vars(eng, thinks, model or os.path.basename(path))  # (refuses --think on a model with no reasoning)
    session = ChatSession(eng, params=params, system=system, n_predict=n_predict, spec=spec_mode, spec_k=spec_k,
                          think=thinks, answer_parser=lambda ids: answer_parser(eng, ids))
    code = Repl(session, verbose=verbose, quiet=quiet, hide_thinking=hide_thinking).run()
    if code:
        raise typer.Exit(code)
