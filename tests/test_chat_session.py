"""ChatSession: turns, KV-cache reuse, context trimming, interruption, settings.

The logic tests use a fake engine (instant, exact token counts); the rest run the real default
model (SmolLM2-135M-Instruct) on the numpy backend at temperature 0 with short replies.
"""

from __future__ import annotations

import pytest

from gguf_runtime.engine.chat_session import ChatSession, SettingError
from gguf_runtime.engine.engine import Engine, Generation
from gguf_runtime.errors import ContextOverflowError, GGUFRunError
from gguf_runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


# ---- a fake engine: one token per word, [1] role words [2] per message, [3] generation prompt ----

class FakeEngine:
    def __init__(self, n_ctx: int = 100, reply: str = "one two three four") -> None:
        self.n_ctx = n_ctx
        self.reply = reply
        self.cached: list[int] = []
        self.resets = 0
        self.prompts: list[list[int]] = []

    def encode_chat(self, messages):
        ids: list[int] = []
        for m in messages:
            ids += [1] + [7] * len(m["content"].split()) + [2]
        return ids + [3]

    def generate(self, ids, n_predict=-1, params=None):
        assert len(ids) < self.n_ctx
        self.prompts.append(list(ids))
        gen = Generation(iter(()))
        words = self.reply.split()

        def run():
            self.cached = list(ids)
            gen.stats.prompt_tokens = len(ids)
            gen.stats.stop_reason = "stop"
            for w in words if n_predict < 0 else words[:n_predict]:
                gen.ids.append(9)
                self.cached.append(9)
                gen.stats.eval_tokens += 1
                yield w + " "

        gen._pieces = run()
        return gen

    def reset(self):
        self.resets += 1
        self.cached = []


def words(n: int) -> str:
    return " ".join(["w"] * n)


def test_turns_alternate_and_the_reply_is_kept():
    s = ChatSession(FakeEngine(), system="be brief")
    r = s.send("hello there")
    assert r.read() == "one two three four "
    assert r.stop_reason == "stop" and r.finished and not r.interrupted
    assert [m["role"] for m in s.messages] == ["system", "user", "assistant"]
    assert s.messages[2]["content"] == "one two three four "
    assert s.chat("again") == "one two three four "
    assert s.n_turns == 2 and s.last.text == "one two three four "


def test_trimming_drops_oldest_pairs_and_keeps_system():
    eng = FakeEngine(n_ctx=100)  # reserve min(256, 25) = 25; trims down to half the context (50)
    s = ChatSession(eng, system="sys")
    assert s.reply_reserve == 25
    dropped = []
    for i in range(8):
        r = s.send(f"q{i} " + words(9))  # 12 tokens; a pair is 12 + 6
        r.read()
        dropped.append(r.dropped)
        assert len(eng.prompts[-1]) + s.reply_reserve <= eng.n_ctx
    assert sum(dropped) > 0 and dropped[0] == 0
    first_drop = next(i for i, d in enumerate(dropped) if d)
    assert len(eng.prompts[first_drop]) <= 50  # trimmed to half, not just under the limit
    assert s.messages[0] == {"role": "system", "content": "sys"}
    assert not any(m["content"].startswith("q0 ") for m in s.messages)
    assert s.messages[-2]["content"].startswith("q7 ")
    assert s.dropped_total == sum(dropped)
    assert len(s.turns) % 2 == 0


def test_a_message_too_long_alone_raises_one_line_and_changes_nothing():
    s = ChatSession(FakeEngine(n_ctx=100))
    s.chat("hi")
    before = s.messages
    with pytest.raises(ContextOverflowError) as e:
        s.send(words(80))
    assert "\n" not in str(e.value) and "--ctx-size" in str(e.value)
    assert s.messages == before
    assert s.chat("still here") == "one two three four "


def test_empty_message_is_refused():
    s = ChatSession(FakeEngine())
    for text in ("", "   \n"):
        with pytest.raises(GGUFRunError):
            s.send(text)
    assert s.messages == []


def test_clear_and_system():
    eng = FakeEngine()
    s = ChatSession(eng, system="first")
    s.chat("hi")
    s.clear()
    assert eng.resets == 1 and s.messages == [{"role": "system", "content": "first"}] and s.last is None
    s.set_system("second")
    assert s.messages[0]["content"] == "second"
    s.set_system("")
    assert s.messages == []


def test_close_before_iterating_and_send_over_an_unfinished_reply():
    s = ChatSession(FakeEngine(reply="a b c d e f"))
    r = s.send("hi")
    r.close()
    assert r.interrupted and r.closed
    assert [m["role"] for m in s.messages] == ["user", "assistant"] and s.messages[1]["content"] == ""
    r2 = s.send("again")
    assert next(r2) == "a "
    r3 = s.send("third")  # the unfinished reply is closed first and keeps its piece
    assert r2.interrupted and s.messages[3]["content"] == "a "
    assert r3.read() == "a b c d e f "
    assert [m["role"] for m in s.messages] == ["user", "assistant"] * 3


def test_set_parses_and_validates():
    s = ChatSession(FakeEngine(), params=GREEDY)
    assert s.set("temperature", "0.5") == 0.5 and s.params.temperature == 0.5
    assert s.set("temp", " 0 ") == 0.0 and s.params.temperature == 0.0
    assert s.set("top_k", "20") == 20 and s.params.top_k == 20
    assert s.set("TOP_P", "0.9") == 0.9
    assert s.set("min_p", "0") == 0.0
    assert s.set("repeat_penalty", "1.1") == 1.1
    assert s.set("seed", "42") == 42 and s.params.seed == 42
    assert s.set("seed", "none") is None and s.params.seed is None
    assert s.set("num_predict", "-1") == -1 and s.n_predict == -1
    assert s.set("n_predict", "16") == 16 and s.n_predict == 16
    snapshot = (s.settings(), s.n_predict)
    bad = [("temperature", "hot", "must be a number"), ("top_k", "0.5", "must be an integer"),
           ("top_k", "-1", "top_k must be >= 0"), ("top_p", "2", "top_p must be in"),
           ("min_p", "-0.1", "min_p must be in"), ("repeat_penalty", "0", "repeat_penalty must be > 0"),
           ("seed", "-5", "seed"), ("num_predict", "-2", "num_predict must be -1"),
           ("num_predict", "many", "must be an integer"), ("temperature", "", "give a value"),
           ("temperature", "nan", "finite"), ("num_ctx", "4096", "restart with -c"),
           ("bogus", "1", "unknown parameter 'bogus'")]
    for name, value, msg in bad:
        with pytest.raises(SettingError) as e:
            s.set(name, value)
        assert msg in str(e.value) and "\n" not in str(e.value), (name, value, str(e.value))
    assert (s.settings(), s.n_predict) == snapshot
    assert isinstance(SettingError("x"), GGUFRunError)
    with pytest.raises(SettingError):
        ChatSession(FakeEngine(), n_predict=-3)


def test_the_session_does_not_share_the_callers_params():
    p = SamplingParams(temperature=0.3)
    s = ChatSession(FakeEngine(), params=p)
    s.set("temperature", "0.9")
    assert p.temperature == 0.3


# ---- the real model --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(smollm2_path):
    return Engine(smollm2_path, backend="numpy", n_ctx=1024)


@pytest.fixture(scope="module")
def tiny_engine(smollm2_path):
    return Engine(smollm2_path, backend="numpy", n_ctx=96)


def test_second_turn_prefills_only_the_new_tokens(engine):
    engine.reset()
    s = ChatSession(engine, params=GREEDY, n_predict=16)
    r1 = s.send("My name is Ada. Remember it.")
    r1.read()
    assert r1.stats.prompt_tokens == r1.n_prompt  # a fresh cache: everything is new
    assert r1.text.strip() and "<|im_end|>" not in r1.text
    r2 = s.send("What is my name?")
    r2.read()
    new_msg = len(engine.tokenizer.encode("What is my name?", add_special=False))
    # the new user message, its role header, the end of the last reply and the assistant header
    assert r2.stats.prompt_tokens <= new_msg + 12, (r2.stats.prompt_tokens, new_msg)
    assert r2.stats.prompt_tokens < r2.n_prompt / 3
    assert r2.n_prompt > r1.n_prompt + r1.stats.eval_tokens
    # what is cached is the rendered conversation so far (plus the reply being cached)
    assert engine.cached[: r2.n_prompt] == engine.encode_chat(s.messages[:-1])
    assert [m["role"] for m in s.messages] == ["user", "assistant"] * 2
    assert s.messages[0]["content"] == "My name is Ada. Remember it."


def test_end_of_turn_token_stops_the_reply(engine):
    s = ChatSession(engine, params=GREEDY, n_predict=64)
    r = s.send("Say hi.")
    text = r.read()
    assert r.stop_reason == "stop", (r.stop_reason, text)
    assert r.stats.eval_tokens < 64 and "<|im_end|>" not in text and "<|im_start|>" not in text


def test_interrupted_reply_keeps_its_partial_text(engine):
    engine.reset()
    s = ChatSession(engine, params=GREEDY, n_predict=12)
    s.chat("My name is Ada.")
    s.n_predict = 48
    r = s.send("Tell me a long story about a dragon.")
    got = [next(r) for _ in range(4)]
    r.close()  # what the REPL does when Ctrl-C lands while it prints
    s.n_predict = 12
    assert r.interrupted and s.messages[-1]["content"] == "".join(got) != ""
    assert len(engine.cached) == engine.backend.n_past
    r2 = s.send("Go on.")
    assert r2.read().strip()
    assert r2.stats.prompt_tokens < r2.n_prompt / 2  # the partial reply is still in the cache
    assert [m["content"] for m in s.messages[::2]] == ["My name is Ada.", "Tell me a long story about a dragon.",
                                                        "Go on."]


def test_keyboard_interrupt_inside_the_generation(engine, monkeypatch):
    engine.reset()
    s = ChatSession(engine, params=GREEDY, n_predict=12)
    s.chat("My name is Ada.")
    s.n_predict = 48
    r = s.send("Count from one to twenty.")
    real_eval, calls = engine.backend.eval, []

    def eval_then_interrupt(tokens, *a, **k):  # Ctrl-C while the backend computes the 6th token
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return real_eval(tokens, *a, **k)

    monkeypatch.setattr(engine.backend, "eval", eval_then_interrupt)
    pieces = []
    with pytest.raises(KeyboardInterrupt):
        for p in r:
            pieces.append(p)
    monkeypatch.setattr(engine.backend, "eval", real_eval)
    s.n_predict = 12
    assert len(calls) == 6 and len(pieces) >= 4
    assert r.interrupted and r.closed and s.messages[-1]["content"] == "".join(pieces) != ""
    assert len(engine.cached) == engine.backend.n_past
    r3 = s.send("What is my name?")
    assert r3.read().strip()
    assert r3.stats.prompt_tokens < r3.n_prompt / 2
    assert s.messages[0]["content"] == "My name is Ada." and len(s.messages) == 6


def test_tiny_context_fills_then_drops_the_oldest_turns(tiny_engine):
    eng = tiny_engine  # 96 tokens: reserve 24, trims down to 48
    s = ChatSession(eng, params=GREEDY, n_predict=-1)
    r = s.send("Tell me a very long story about a dragon and a knight.")
    r.read()  # runs until the end of the context, never past it
    assert r.stop_reason == "context", (r.stop_reason, r.text)
    assert len(eng.cached) <= eng.n_ctx
    s.n_predict = 12
    dropped = [r.dropped]
    for i in range(3):
        r = s.send(f"Question {i}: what is {i} plus {i}?")
        r.read()
        dropped.append(r.dropped)
        assert r.n_prompt + s.reply_reserve <= eng.n_ctx
        assert len(eng.cached) <= eng.n_ctx
    assert sum(dropped) >= 1 and dropped[0] == 0
    assert not any("dragon" in m["content"] for m in s.messages if m["role"] == "user")
    assert s.messages[-2]["content"] == "Question 2: what is 2 plus 2?"
    before = s.messages
    with pytest.raises(ContextOverflowError):
        s.send("word " * 200)
    assert s.messages == before
    assert s.chat("Hi!").strip()


def test_speculative_replies_are_the_plain_ones(engine):
    """`gguf-run chat --spec ngram`: each greedy reply is the plain session's, its stats count the
    verification steps (a reply that repeats the message: prompt lookup has matches); a bad setting
    is one line before anything runs."""
    msgs = ["Repeat after me exactly: the red fox jumps over the lazy brown dog.", "Again, the same sentence."]
    replies = {}
    for spec in ("none", "ngram"):
        engine.reset()
        s = ChatSession(engine, params=GREEDY, n_predict=24, spec=spec)
        out = []
        for m in msgs:
            r = s.send(m)
            out.append(r.read())
            if spec == "ngram":
                assert r.stats.spec_steps + r.stats.spec_plain > 0
        replies[spec] = out
    assert replies["ngram"] == replies["none"] and all(t.strip() for t in replies["none"])
    with pytest.raises(GGUFRunError, match="--spec"):
        ChatSession(engine, spec="draft")
    with pytest.raises(GGUFRunError, match="--spec-k"):
        ChatSession(engine, spec="ngram", spec_k=0)
