"""`gguf-run chat`: multi-line input rules, piped input, and a real pseudo-terminal session.

The terminal test drives the REPL as a person would (pexpect, a real pty, the default model on the
numpy backend at temperature 0): two turns, Ctrl-C in the middle of the second reply, a third
turn whose prompt still holds the first (shown by /history and by /stats: the third turn
prefills only its new tokens), Ctrl-C at an empty prompt, then /bye with exit status 0.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import pytest

from gguf_runtime.engine.chat_session import ChatSession
from gguf_runtime.cli.chat_cmd import CONTINUATION, EXIT_HINT, PROMPT, Message, MessageReader, Repl
from gguf_runtime.engine.engine import Generation

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CMD = [sys.executable, "-m", "gguf_runtime", "chat", "--backend", "numpy", "--temp", "0", "-c", "1024"]


# ---- multi-line input --------------------------------------------------------------------------------

def feed_all(lines):
    r = MessageReader()
    out = [r.feed(line) for line in lines]
    return r, out


def test_plain_lines_and_commands():
    r, out = feed_all(["hello", "/set temperature 0", "  /bye  "])
    assert out == [Message("hello", False), Message("/set temperature 0", True), Message("  /bye  ", True)]
    assert not r.in_block and r.prompt == PROMPT


def test_triple_quote_block():
    r = MessageReader()
    assert r.feed('"""') is None and r.in_block and r.prompt == CONTINUATION
    assert r.feed("first line") is None
    assert r.feed("/not a command") is None
    assert r.feed('last line"""') == Message("first line\n/not a command\nlast line", False)
    assert not r.in_block and r.prompt == PROMPT


def test_block_variants():
    _, out = feed_all(['"""one line"""'])
    assert out == [Message("one line", False)]
    _, out = feed_all(['"""start', "", "  indented", '"""'])
    assert out == [None, None, None, Message("start\n\n  indented", False)]
    _, out = feed_all(['/system """You are a pirate.', 'Speak like one."""'])
    assert out == [None, Message("/system You are a pirate.\nSpeak like one.", True)]
    _, out = feed_all(['/set system """terse"""'])
    assert out == [Message("/set system terse", True)]


def test_cancel_drops_the_block():
    r = MessageReader()
    r.feed('"""abc')
    r.feed("def")
    assert r.cancel() == "abc\ndef"
    assert not r.in_block and r.feed("x") == Message("x", False)


# ---- the REPL's logic, with a scripted keyboard and a fake engine ----------------------------------

class FakeEngine:
    n_ctx = 1000
    has_template = True

    def __init__(self):
        self.cached, self.resets = [], 0

    def encode_chat(self, messages):
        return [1] * sum(2 + len(m["content"].split()) for m in messages)

    def generate(self, ids, n_predict=-1, params=None):
        gen = Generation(iter(()))

        def run():
            gen.stats.stop_reason = "stop"
            for w in ("Hello", " there", ",", " friend", "."):
                gen.stats.eval_tokens += 1
                yield w

        gen._pieces = run()
        return gen

    def reset(self):
        self.resets += 1


class Keyboard:
    """input() replaced: returns the scripted lines, raises the scripted exceptions, then EOF."""

    def __init__(self, *items):
        self.items, self.prompts = list(items), []

    def __call__(self, prompt):
        self.prompts.append(prompt)
        item = self.items.pop(0) if self.items else EOFError()
        if isinstance(item, BaseException):
            raise item
        return item


class TTY(io.StringIO):
    def isatty(self):
        return True


class InterruptingOut(io.StringIO):
    """Ctrl-C lands while the REPL prints the n-th piece of a reply."""

    def __init__(self, at_write: str):
        super().__init__()
        self.at_write, self.armed = at_write, True

    def write(self, s):
        if self.armed and s == self.at_write:
            self.armed = False
            raise KeyboardInterrupt
        return super().write(s)


def run_repl(keys, out=None, system=None):
    out = out if out is not None else io.StringIO()
    err = io.StringIO()
    session = ChatSession(FakeEngine(), system=system)
    code = Repl(session, stdin=TTY(), stdout=out, stderr=err, read_line=keys).run()
    return code, session, out.getvalue(), err.getvalue()


def test_repl_turns_commands_and_keys():
    keys = Keyboard("hi", KeyboardInterrupt(), '"""', "a block", KeyboardInterrupt(), "/stats", "/nope",
                    "/set temperature 0.1", "/set top_k x", '"""two', 'lines"""', "/history", "/clear",
                    "/history", "/bye", "never read")
    code, session, out, err = run_repl(keys)
    assert code == 0 and keys.items == ["never read"]
    assert keys.prompts[:5] == [PROMPT, PROMPT, PROMPT, CONTINUATION, CONTINUATION]
    assert "Hello there, friend.\n\n" in out
    assert out.count(EXIT_HINT) == 1  # Ctrl-C at the empty prompt, not the one inside the block
    assert "done reason:          stop" in out and "Unknown command '/nope'. Type /? for help" in out
    assert "Set parameter 'temperature' to '0.1'" in out and session.params.temperature == 0.1
    assert "  3 user       two lines" in out and "Cleared session context" in out
    assert "The conversation is empty." in out
    assert err.splitlines()[-1] == "error: top_k must be an integer, got 'x'"
    assert session.engine.resets == 1


def test_repl_ctrl_c_while_printing_keeps_the_partial_reply():
    out = InterruptingOut(at_write=" friend")
    code, session, text, _ = run_repl(Keyboard("hi", "and now?"), out=out)
    assert code == 0
    # the history holds every piece generated, the one whose printing was cut included
    assert [m["content"] for m in session.messages] == ["hi", "Hello there, friend", "and now?",
                                                        "Hello there, friend."]
    assert session.last.stop_reason == "stop"
    assert "Hello there,\n" in text  # a newline, then the prompt


def test_repl_ctrl_d_and_piped_mode():
    code, session, out, _ = run_repl(Keyboard())
    assert code == 0 and out == "\n"
    err = io.StringIO()
    piped = io.StringIO("hello\n/bye\n")
    code = Repl(ChatSession(FakeEngine()), stdin=piped, stdout=(out := io.StringIO()), stderr=err).run()
    assert code == 0 and out.getvalue() == "Hello there, friend.\n\n" and err.getvalue() == ""


# ---- piped stdin: lines as typed, no prompts ---------------------------------------------------------

def test_piped_commands_and_errors(smollm2_path):
    script = "\n".join(["/?", "/x", "/set top_k abc", "/set parameter top_p 0.5", "/show parameters",
                        "/set num_ctx 4", "/system be brief", "/history", "/stats", "/clear"]) + "\n"
    p = subprocess.run(CMD + ["--quiet"], input=script, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert PROMPT not in p.stdout
    assert "Available Commands:" in p.stdout and '"""' in p.stdout
    assert "Unknown command '/x'. Type /? for help" in p.stdout
    assert "Set parameter 'top_p' to '0.5'" in p.stdout and re.search(r"top_p\s+0\.5", p.stdout)
    assert "Set system message." in p.stdout and "system     be brief" in p.stdout
    assert "No reply yet." in p.stdout and "Cleared session context" in p.stdout
    errors = p.stderr.strip().splitlines()
    assert errors == ["error: top_k must be an integer, got 'abc'",
                      "error: num_ctx is fixed when the model loads; restart with -c/--ctx-size N"], p.stderr
    assert "Traceback" not in p.stderr


# ---- a real terminal ---------------------------------------------------------------------------------

def test_terminal_session(smollm2_path):
    pexpect = pytest.importorskip("pexpect")
    env = dict(os.environ, TERM="dumb", PYTHONUNBUFFERED="1")
    child = pexpect.spawn(CMD[0], CMD[1:] + ["-n", "24"], cwd=REPO, env=env, encoding="utf-8",
                          timeout=60, dimensions=(40, 200))
    transcript = []
    child.logfile_read = type("Log", (), {"write": lambda self, s: transcript.append(s),
                                          "flush": lambda self: None})()

    def answer(line: str) -> str:
        """Send a line; return what was printed until the next prompt."""
        child.sendline(line)
        child.expect_exact(line + "\r\n")  # the terminal's echo
        child.expect_exact(PROMPT)
        return child.before

    try:
        child.expect_exact(PROMPT, timeout=90)

        # turn 1
        reply1 = answer("My name is Ada. Remember it.")
        assert reply1.strip(), transcript

        # turn 2: a long reply, stopped by Ctrl-C once some of it has arrived
        assert "Set parameter 'num_predict' to '400'" in answer("/set num_predict 400")
        story = "Tell me a long story about a dragon."
        child.sendline(story)
        child.expect_exact(story + "\r\n")
        child.expect(r"\w+\W+\w+\W+\w+")  # a few words of the reply
        child.sendintr()
        child.expect_exact(PROMPT)
        stats = answer("/stats")
        assert re.search(r"done reason:\s+interrupted", stats), stats
        answer("/set num_predict 24")

        # turn 3 still sees turn 1
        reply3 = answer("What is my name?")
        assert reply3.strip(), transcript
        history = answer("/history")
        lines = [ln.split(None, 2) for ln in history.strip().splitlines()]
        assert [ln[1] for ln in lines] == ["user", "assistant"] * 3, history
        assert lines[0][2] == "My name is Ada. Remember it." and lines[2][2] == story, history
        assert lines[3][2].strip(), history  # the partial reply was kept
        assert lines[4][2] == "What is my name?", history
        stats = answer("/stats")
        prompt_tokens = int(re.search(r"prompt eval count:\s+(\d+)", stats).group(1))
        in_context = int(re.search(r"context:\s+(\d+)/1024", stats).group(1))
        assert prompt_tokens < 30 and in_context > 60, stats  # only the new tokens were evaluated

        # Ctrl-C at an empty prompt: a hint, not an exit; then /bye
        child.sendintr()
        child.expect_exact("Use Ctrl + d or /bye to exit.")
        child.expect_exact(PROMPT)
        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    out = "".join(transcript)
    assert child.exitstatus == 0, out
    assert "Traceback" not in out and "error:" not in out, out


def test_ctrl_c_cancels_a_block_and_ctrl_d_exits(smollm2_path):
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(CMD[0], CMD[1:] + ["--quiet"], cwd=REPO, env=dict(os.environ, TERM="dumb"),
                          encoding="utf-8", timeout=60)
    try:
        child.expect_exact(PROMPT)
        child.sendline('"""')
        child.expect_exact(CONTINUATION)
        child.sendintr()  # Ctrl-C cancels the block, no hint
        child.expect_exact(PROMPT)
        assert "Use Ctrl" not in child.before
        child.sendline('"""')
        child.expect_exact(CONTINUATION)
        child.sendeof()  # Ctrl-D, even inside a block, exits
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


# ---- `gguf-run` outside `chat`: a bare call in a terminal, Ctrl-C in `run` ---------------------------

RUN = [sys.executable, "-m", "gguf_runtime", "--backend", "numpy", "-c", "1024"]


def test_bare_gguf_run_in_a_terminal_starts_a_chat(smollm2_path):
    """No prompt and stdin a terminal: a conversation, as `ollama run MODEL` starts one."""
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(RUN[0], RUN[1:] + ["--quiet", "--temp", "0", "-n", "8"], cwd=REPO,
                          env=dict(os.environ, TERM="dumb"), encoding="utf-8", timeout=90)
    try:
        child.expect_exact(PROMPT)
        child.sendline("Hi")
        child.expect_exact("Hi\r\n")
        child.expect_exact(PROMPT)
        assert child.before.strip()  # a reply
        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_ctrl_c_in_run_exits_130_with_the_stats(smollm2_path):
    """Ctrl-C while `gguf-run -p` streams: what was written stays, --verbose prints its figures, exit 130."""
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(RUN[0], RUN[1:] + ["-p", "Tell me a long story about a dragon.", "-n", "600", "--verbose",
                                             "--quiet"], cwd=REPO, env=dict(os.environ, TERM="dumb"),
                          encoding="utf-8", timeout=90)
    try:
        child.expect(r"\w+\W+\w+\W+\w+")  # a few words of the reply
        child.sendintr()
        child.expect(r"eval count:\s+(\d+) token")
        assert int(child.match.group(1)) >= 3
        child.expect(pexpect.EOF)
        out = child.before
    finally:
        child.close(force=True)
    assert child.exitstatus == 130, (child.exitstatus, out)
    assert "Traceback" not in out and "eval rate:" in out
