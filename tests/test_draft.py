"""Speculative decoding with a draft model (engine/draft.py, `--spec draft --draft FILE`): the draft's
greedy continuation proposed k tokens at a time, the target's greedy text unchanged, the draft's
cache following the sequence across calls; a draft of another vocabulary refused in one line."""

from __future__ import annotations

import pytest

from gguf_runtime.engine.engine import Engine
from gguf_runtime.errors import GGUFRunError
from gguf_runtime.sampling import SamplingParams

from micro_models import Micro, write_micro
from test_cli import assert_one_line_error, run

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("draft")
    target = write_micro(Micro(n_embd=64, n_ff=128, n_head=4, n_head_kv=2, n_layer=2, seed=1), d / "target.gguf")
    small = write_micro(Micro(n_embd=32, n_ff=64, n_head=2, n_head_kv=1, n_layer=1, seed=2), d / "small.gguf")
    other = write_micro(Micro(vocab="gpt-2", n_vocab=4096, seed=1), d / "other.gguf")
    return target, small, other


def test_a_draft_of_the_same_model_is_always_right(files):
    """The target as its own draft: every proposal kept (k grows), the plain greedy text."""
    target, _, _ = files
    eng = Engine(target, backend="numpy", n_ctx=256, draft=target)
    prompt = eng.encode_raw("one two three four five")
    plain = eng.generate(prompt, 40, params=GREEDY).text()
    gen = eng.generate(prompt, 40, params=GREEDY, spec="draft", spec_k=4)
    assert gen.text() == plain
    st = gen.stats
    assert st.spec_accepted == st.spec_proposed > 0 and (st.spec_accepted + st.spec_steps) / st.spec_steps > 4


def test_a_smaller_draft_keeps_the_greedy_text_across_calls(files):
    """A smaller model of the same vocabulary: the target's greedy text whatever it proposes, in a
    second call that shares the first's prefix too (the draft's cache keeps it, evaluates the rest)."""
    target, small, _ = files
    eng = Engine(target, backend="numpy", n_ctx=256, draft=small)
    ref = Engine(target, backend="numpy", n_ctx=256)
    p1 = eng.encode_raw("the cat sat on the mat and the cat")
    p2 = p1 + eng.encode_raw(" and then")[1:]
    for p in (p1, p2, p1):
        want = ref.generate(p, 30, params=GREEDY).text()
        gen = eng.generate(p, 30, params=GREEDY, spec="draft", spec_k=3)
        assert gen.text() == want and gen.stats.spec_steps > 0
        held = eng.draft.held
        assert held == (p + gen.ids)[:len(held)]  # what the draft holds is the sequence's prefix
    # sampled: runs to its budget, the proposals checked by speculative sampling
    gen = eng.generate(p1, 20, params=SamplingParams(temperature=0.9, seed=3), spec="draft")
    gen.text()
    assert len(gen.ids) == 20 or gen.stats.stop_reason == "stop"


def test_a_draft_of_another_vocabulary_is_one_line(files):
    target, _, other = files
    with pytest.raises(GGUFRunError, match="same family"):
        Engine(target, backend="numpy", n_ctx=64, draft=other)
    eng = Engine(target, backend="numpy", n_ctx=64)
    with pytest.raises(GGUFRunError, match="--draft FILE"):
        eng.generate(eng.encode_raw("a b"), 4, params=GREEDY, spec="draft")


def test_cli_draft(files):
    target, small, other = files
    rc, out, err = run(str(target), "-p", "one two three", "--raw", "-n", "12", "--temp", "0", "--backend", "numpy",
                       "-q")
    assert rc == 0, err
    rc2, out2, err2 = run(str(target), "-p", "one two three", "--raw", "-n", "12", "--temp", "0", "--backend",
                          "numpy", "--draft", str(small), "--verbose")
    assert rc2 == 0 and out2 == out, err2
    assert "draft" in err2.lower() or "accept" in err2.lower(), err2
    assert_one_line_error(run(str(target), "-p", "x", "--backend", "numpy", "--spec", "draft"), "--draft")
    assert_one_line_error(run(str(target), "-p", "x", "--backend", "numpy", "--spec", "ngram", "--draft", str(small)),
                          "--draft")
    assert_one_line_error(run(str(target), "-p", "x", "--backend", "numpy", "--draft", str(other)), "same family")
