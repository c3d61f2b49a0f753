"""`gguf-run run` and `chat` with a thinking model, as `ollama run` shows one: the reasoning under
"Thinking..." and "...done thinking.", --hide-thinking, --think / --think=LEVEL / --no-think reaching
the template, and the refusals (--think on a model that does not reason, a bad level, the flags with
--raw).

The commands run in-process (cli.app.main) on a fake engine: the real chat templates of
tests/data/chat_templates render the prompt, the answer is scripted, so what is printed is known."""

from __future__ import annotations

import io
import os

import pytest

from gguf_runtime.cli import chat_cmd, run_cmd
from gguf_runtime.cli.app import main
from gguf_runtime.cli.chat_cmd import Repl
from gguf_runtime.cli.thinking import GREY, ThinkingPrinter, answer_parser, think_vars
from gguf_runtime.engine.chat_session import ChatSession
from gguf_runtime.engine.engine import Generation
from gguf_runtime.format.chat_template import ChatTemplate
from gguf_runtime.format.tool_calls import Reasoning

TEMPLATES = os.path.join(os.path.dirname(__file__), "data", "chat_templates")
QWEN3_ANSWER = ["<think>", "\nPlan", " it.", "\n</think>", "\n\n", "Hello", "."]
HARMONY_ANSWER = ["<|channel|>analysis", "<|message|>", "Plan", " it.", "<|end|>", "<|start|>assistant",
                  "<|channel|>final<|message|>", "Hello", "."]
PLAIN_ANSWER = ["Hello", " there", "."]


class Tok:
    """Characters as token ids: the prompt's text comes back from its ids."""

    token_to_id: dict = {}

    @staticmethod
    def decode(ids):
        return "".join(map(chr, ids))


class FakeEngine:
    """An Engine with a real chat template and a scripted answer; the rendered prompts are kept."""

    template_name, answer = "qwen3", QWEN3_ANSWER
    last: "FakeEngine | None" = None

    def __init__(self, path, **kw):
        self.template = ChatTemplate(open(os.path.join(TEMPLATES, self.template_name + ".jinja")).read())
        self.has_template, self.n_ctx, self.cached, self.shown = True, 4096, [], frozenset()
        self.tokenizer, self.prompts = Tok(), []
        FakeEngine.last = self

    def encode_chat(self, messages, **variables):
        self.prompts.append(self.template.render(list(messages), add_generation_prompt=True, **variables))
        return [ord(c) for c in self.prompts[-1]]

    def encode_raw(self, text):
        self.prompts.append(text)
        return [ord(c) for c in text]

    def generate(self, ids, n_predict=-1, params=None, **kw):
        gen = Generation(iter(()))

        def pieces():
            gen.stats.stop_reason = "stop"
            for p in self.answer:
                gen.stats.eval_tokens += 1
                yield p

        gen._pieces = pieces()
        return gen

    def reset(self):
        pass


@pytest.fixture
def engine(monkeypatch):
    """Sets the fake engine's template and answer: engine("qwen3", QWEN3_ANSWER)."""
    monkeypatch.setattr(run_cmd, "Engine", FakeEngine)
    monkeypatch.setattr(chat_cmd, "Engine", FakeEngine)
    monkeypatch.setattr(run_cmd, "resolve_model", lambda m: "model.gguf")
    monkeypatch.setattr(chat_cmd, "resolve_model", lambda m: "model.gguf")

    def use(template, answer):
        monkeypatch.setattr(FakeEngine, "template_name", template)
        monkeypatch.setattr(FakeEngine, "answer", answer)
    return use


def cli(capsys, *args):
    rc = main(["run", "m", "-p", "Hi", "-q", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_error(result, *words):
    rc, out, err = result
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error:"), (rc, err)
    for w in words:
        assert w in lines[0], (w, err)
    assert out == ""


# ---- run ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("template,answer", [("qwen3", QWEN3_ANSWER), ("gpt-oss-harmony", HARMONY_ANSWER)])
def test_the_reasoning_is_shown_as_ollama_shows_it(engine, capsys, template, answer):
    engine(template, answer)
    rc, out, err = cli(capsys)
    assert rc == 0, err
    assert out == "Thinking...\nPlan it.\n...done thinking.\n\nHello.\n"


@pytest.mark.parametrize("template,answer", [("qwen3", QWEN3_ANSWER), ("gpt-oss-harmony", HARMONY_ANSWER)])
def test_hide_thinking_prints_the_answer_only(engine, capsys, template, answer):
    engine(template, answer)
    rc, out, err = cli(capsys, "--hide-thinking")
    assert rc == 0, err
    assert out == "Hello.\n"


def test_think_and_no_think_reach_the_template(engine, capsys):
    engine("qwen3", ["Hello."])
    assert cli(capsys, "--no-think")[0] == 0
    assert FakeEngine.last.prompts[-1].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    for args in ([], ["--think"]):
        assert cli(capsys, *args)[0] == 0
        assert FakeEngine.last.prompts[-1].endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("args,level", [([], "medium"), (["--think"], "medium"), (["--think=high"], "high"),
                                        (["--think", "low"], "low"), (["--think=true"], "medium")])
def test_a_level_reaches_a_harmony_template(engine, capsys, args, level):
    engine("gpt-oss-harmony", HARMONY_ANSWER)
    rc, out, err = cli(capsys, *args)
    assert rc == 0, err
    assert f"\nReasoning: {level}\n" in FakeEngine.last.prompts[-1]
    assert out == "Thinking...\nPlan it.\n...done thinking.\n\nHello.\n"


def test_a_level_on_qwen3_just_thinks(engine, capsys):
    engine("qwen3", ["Hello."])
    prompts = []
    for args in (["--think"], ["--think=high"], ["--think", "low"], ["--think=false"], ["--no-think"]):
        assert cli(capsys, *args)[0] == 0
        prompts.append(FakeEngine.last.prompts[-1])
    assert prompts[0] == prompts[1] == prompts[2] and prompts[0].endswith("<|im_start|>assistant\n")
    assert prompts[3] == prompts[4] and prompts[3].endswith("<think>\n\n</think>\n\n")


def test_a_bare_think_leaves_the_model_argument_alone(engine, capsys, monkeypatch):
    engine("qwen3", ["Hello."])
    asked = []
    monkeypatch.setattr(run_cmd, "resolve_model", lambda m: asked.append(m) or "model.gguf")
    assert main(["run", "--think", "m", "-p", "Hi", "-q"]) == 0, capsys.readouterr().err
    assert main(["--think", "-p", "--think", "-q"]) == 0, capsys.readouterr().err  # the prompt "--think"
    assert asked == ["m", None]
    assert "<|im_start|>user\n--think<|im_end|>" in FakeEngine.last.prompts[-1]


@pytest.mark.parametrize("args,words", [(["--think=max"], ['invalid value for --think: "max"', "high, medium, or low"]),
                                        (["--think=High"], ['"High"']), (["--think", "--no-think"], ["not both"])])
def test_a_bad_think_value_is_refused(engine, capsys, args, words):
    engine("gpt-oss-harmony", HARMONY_ANSWER)
    one_line_error(cli(capsys, *args), *words)


def test_a_model_that_does_not_reason_prints_as_before(engine, capsys):
    engine("llama-3.2", ["<think>", "x", "</think>"] + PLAIN_ANSWER)  # its text as it is, tags and all
    for args in ([], ["--hide-thinking"], ["--no-think"]):
        rc, out, err = cli(capsys, *args)
        assert (rc, out) == (0, "<think>x</think>Hello there.\n"), err


def test_think_on_a_model_that_does_not_reason_is_refused(engine, capsys):
    engine("llama-3.2", PLAIN_ANSWER)
    for args in (["--think"], ["--think=high"], ["--think", "low"]):
        one_line_error(cli(capsys, *args), '"m" does not support thinking', "drop --think")


@pytest.mark.parametrize("flag", ["--think", "--no-think", "--hide-thinking", "--think=high"])
def test_the_flags_with_raw_are_refused(engine, capsys, flag):
    engine("qwen3", QWEN3_ANSWER)
    one_line_error(cli(capsys, "--raw", flag), flag, "--raw")


def test_the_reasoning_is_dimmed_on_a_terminal():
    out = io.StringIO()
    ThinkingPrinter(out, color=True).show([Reasoning("Plan."), "Hi"])
    assert out.getvalue().startswith(GREY) and "Plan." in out.getvalue() and out.getvalue().endswith("\033[0mHi")
    out = io.StringIO()
    ThinkingPrinter(out, color=False).show([Reasoning("Plan."), "Hi"])
    assert out.getvalue() == "Thinking...\nPlan.\n...done thinking.\n\nHi"


# ---- chat -----------------------------------------------------------------------------------------
def test_chat_keeps_the_reasoning_apart_in_the_history(engine):
    engine("qwen3", QWEN3_ANSWER)
    eng = FakeEngine("model.gguf")
    session = ChatSession(eng, template_vars=think_vars(eng, True, "m"),
                          answer_parser=lambda ids: answer_parser(eng, ids))
    out, err = io.StringIO(), io.StringIO()
    keys = iter(["Hi", "Again"])

    def read_line(prompt):
        try:
            return next(keys)
        except StopIteration:
            raise EOFError from None

    assert Repl(session, stdin=io.StringIO(), stdout=out, stderr=err, read_line=read_line).run() == 0
    reply = "Thinking...\nPlan it.\n...done thinking.\n\nHello.\n\n"
    assert out.getvalue() == reply * 2
    assert session.messages[1] == {"role": "assistant", "content": "Hello.", "thinking": "Plan it.\n"}
    # the second turn: the first answer as the template writes a past one (its reasoning left out)
    assert "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nAgain" in eng.prompts[1]
    assert "Plan it." not in eng.prompts[1]


def test_chat_hide_thinking_and_refusal(engine, capsys):
    engine("qwen3", QWEN3_ANSWER)
    eng = FakeEngine("model.gguf")
    session = ChatSession(eng, answer_parser=lambda ids: answer_parser(eng, ids))
    out = io.StringIO()
    keys = iter(["Hi"])
    Repl(session, stdin=io.StringIO(), stdout=out, stderr=io.StringIO(), hide_thinking=True,
         read_line=lambda p: next(keys, None) or (_ for _ in ()).throw(EOFError())).run()
    assert out.getvalue() == "Hello.\n\n"
    assert session.messages[1]["thinking"] == "Plan it.\n"
    engine("llama-3.2", PLAIN_ANSWER)
    rc = main(["chat", "m", "--think", "-q"])
    one_line_error((rc, *capsys.readouterr()), '"m" does not support thinking')


def scripted_chat(keys, think=None, hide_thinking=False):
    """A chat of typed lines on the fake engine: (stdout, stderr, the engine's rendered prompts)."""
    eng = FakeEngine("model.gguf")
    session = ChatSession(eng, think=think, answer_parser=lambda ids: answer_parser(eng, ids))
    out, err, keys = io.StringIO(), io.StringIO(), iter(keys)
    Repl(session, stdin=io.StringIO(), stdout=out, stderr=err, hide_thinking=hide_thinking,
         read_line=lambda p: next(keys, None) or (_ for _ in ()).throw(EOFError())).run()
    return out.getvalue(), err.getvalue(), eng.prompts


def test_set_think_level_changes_the_next_turns_prompt(engine):
    engine("gpt-oss-harmony", HARMONY_ANSWER)
    out, err, prompts = scripted_chat(["Hi", "/set think high", "Again", "/set think low", "Third", "/set think",
                                       "/set think max", "Fourth"], think="medium")
    assert err == "error: unknown think level 'max'; one of: low, medium, high\n"
    assert [p.count("\nReasoning: ") for p in prompts] == [1, 1, 1, 1]
    assert [p.split("\nReasoning: ")[1].split("\n")[0] for p in prompts] == ["medium", "high", "low", "medium"]
    lines = out.splitlines()
    assert "Set 'think' mode to 'high'." in lines and "Set 'think' mode to 'low'." in lines
    assert "Set 'think' mode." in lines


def test_set_nothink_and_think_on_qwen3(engine):
    engine("qwen3", ["Hello."])
    out, err, prompts = scripted_chat(["Hi", "/set nothink", "Again", "/set think", "Third", "/set think high",
                                       "Fourth"])
    assert err == "" and "Set 'nothink' mode.\n" in out and "Set 'think' mode to 'high'.\n" in out
    assert [p.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") for p in prompts] == [False, True, False,
                                                                                              False]
    # a level on Qwen3 just thinks: the prompt as /set think's, a turn later
    assert prompts[3] == prompts[2] + "Hello.<|im_end|>\n<|im_start|>user\nFourth<|im_end|>\n<|im_start|>assistant\n"


def test_set_hidethinking_and_nohidethinking(engine):
    engine("qwen3", QWEN3_ANSWER)
    out, err, _ = scripted_chat(["Hi", "/set hidethinking", "Again", "/set nohidethinking", "Third"])
    shown = "Thinking...\nPlan it.\n...done thinking.\n\nHello.\n\n"
    assert out == shown + "Set 'hidethinking' mode.\nHello.\n\nSet 'nohidethinking' mode.\n" + shown, err


def test_set_alone_lists_the_think_state(engine):
    engine("qwen3", ["Hello."])
    out = scripted_chat(["/set", "/set think low", "/set hidethinking", "/set"])[0]
    assert "/set think [LEVEL]" in out and "/set nothink" in out and "/set hidethinking" in out
    assert "Thinking: the template's default; reasoning shown." in out
    assert out.rstrip().endswith("Thinking: low; reasoning hidden.")


def test_set_think_on_a_model_that_does_not_reason(engine):
    engine("llama-3.2", PLAIN_ANSWER)
    out, err, prompts = scripted_chat(["/set think", "/set think high", "Hi", "/set"])
    assert err.splitlines() == ["error: this model does not support thinking (its chat template has no "
                                "reasoning)"] * 2
    assert out.startswith("Hello there.\n\n") and "Thinking: this model does not support thinking" in out
    assert len(prompts) == 1 and "Reasoning" not in prompts[0]


def test_chat_think_level_reaches_the_session(engine, capsys, monkeypatch):
    engine("gpt-oss-harmony", HARMONY_ANSWER)
    seen = []

    class Repl:
        def __init__(self, session, **kw):
            seen.append((session.think, session.template_vars, kw["hide_thinking"]))

        def run(self):
            return 0
    monkeypatch.setattr(chat_cmd, "Repl", Repl)
    assert main(["chat", "m", "--think", "high", "-q", "--hide-thinking"]) == 0, capsys.readouterr().err
    assert main(["chat", "m", "--no-think", "-q"]) == 0, capsys.readouterr().err
    assert seen == [("high", {"enable_thinking": True, "reasoning_effort": "high"}, True),
                    (False, {"enable_thinking": False}, False)]


def test_set_nothink_on_gpt_oss_says_it_reasons_anyway(engine):
    engine("gpt-oss-harmony", HARMONY_ANSWER)
    out = scripted_chat(["/set nothink", "/set"])[0]
    assert "Set 'nothink' mode.\n" in out
    assert out.rstrip().endswith("Thinking: off (gpt-oss reasons anyway); reasoning shown.")
