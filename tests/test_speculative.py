"""Speculative decoding's proposals and acceptance (engine/speculative.py), on the CPU."""

from __future__ import annotations

import numpy as np
import pytest

from gguf_runtime.engine.speculative import AdaptiveK, accept_greedy, accept_sampled, ngram_propose


def test_ngram_takes_the_longest_latest_match():
    h = [7, 1, 2, 9, 5, 1, 2, 3, 4, 8, 2, 3]
    assert ngram_propose(h, 2) == [4, 8]  # [2, 3] last occurred at 6: 4, 8 followed
    assert ngram_propose(h + [4], 3) == [8, 2, 3]  # the 3-gram [2, 3, 4]
    assert ngram_propose([1, 2, 3], 4) == []  # nothing repeats
    assert ngram_propose([5, 6, 5], 4) == [6, 5]  # (the 1-gram 5 at 0)
    assert ngram_propose(h, 0) == []


def test_ngram_lookup_index_equals_the_scan():
    """NgramLookup (the index speculative_loop keeps) proposes what ngram_propose's scan does, on
    growing histories of a small alphabet (many repeats), a fresh one and a shorter one."""
    from gguf_runtime.engine.speculative import NgramLookup
    rng = np.random.default_rng(5)
    look = NgramLookup()
    h: list[int] = []
    for _ in range(300):
        h.append(int(rng.integers(0, 6)))
        k = int(rng.integers(0, 6))
        assert look(h, k) == ngram_propose(h, k), (len(h), k)
    other = [int(t) for t in rng.integers(0, 4, 50)]
    assert look(other, 3) == ngram_propose(other, 3)
    assert look(other[:20], 3) == ngram_propose(other[:20], 3)


def test_ngram_proposes_a_function_asked_back():
    """The case prompt lookup is for: a text the model repeats (code edited in place)."""
    code = list(range(100, 160))
    history = [1, 2] + code + [3, 4] + code[:10]
    assert ngram_propose(history, 8) == code[10:18]


def test_accept_greedy():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == (2, 9)
    assert accept_greedy([5, 6, 7], [5, 6, 7, 1]) == (3, 1)
    assert accept_greedy([5], [4, 0]) == (0, 4)
    assert accept_greedy([], [3]) == (0, 3)


P = np.array([[0.1, 0.5, 0.3, 0.1], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]])


@pytest.mark.parametrize("proposer", ["point", "draft"])
def test_sampled_tokens_follow_the_target(proposer, rng):
    """The first token of a step is distributed as the target's p, whatever the proposal (a fixed
    n-gram token, or drafts drawn from another distribution q)."""
    q = np.array([[0.4, 0.1, 0.1, 0.4], [0.1, 0.2, 0.3, 0.4], [0.25] * 4])
    n = 40000
    counts = np.zeros(4)
    for _ in range(n):
        if proposer == "point":
            props, q_rows = [3, 0], None
        else:
            props = [int(rng.choice(4, p=q[0])), int(rng.choice(4, p=q[1]))]
            q_rows = q
        accepted, tok = accept_sampled(props, P, rng, q_rows)
        counts[props[0] if accepted else tok] += 1
    freq = counts / n
    assert np.abs(freq - P[0]).max() < 0.01, freq  # (4 sigma of 40,000 draws: ~0.01)


def test_sampled_all_accepted_then_one_more_from_p(rng):
    """Proposals the target is certain of are all kept, and the token after them comes from the last row."""
    p = np.array([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert accept_sampled([1, 2], p, rng) == (2, 0)
    assert accept_sampled([0, 2], p, rng) == (0, 1)  # p(0) = 0: rejected, the rest is token 1


def test_adaptive_k():
    a = AdaptiveK(k=4, k_max=8)
    a.update(4, 4)
    assert a.k == 8
    for _ in range(10):
        a.update(a.k, 0)
    assert a.k == 1 and a.acceptance < 0.1


# ---- the loop, on the numpy backend ------------------------------------------------------------
from gguf_runtime.backends.host_loop import host_sample_loop  # noqa: E402
from gguf_runtime.backends.numpy.backend import NumpyBackend  # noqa: E402
from gguf_runtime.engine.speculative import speculative_loop  # noqa: E402
from gguf_runtime.format.gguf_file import open_gguf  # noqa: E402
from gguf_runtime.format.model_config import config_from_gguf  # noqa: E402
from gguf_runtime.sampling import SamplingParams  # noqa: E402
from micro_models import Micro, prompt_ids, write_micro  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_micro(Micro(n_embd=64, n_ff=128, n_head=4, n_head_kv=2, n_layer=2),
                       tmp_path_factory.mktemp("spec") / "m.gguf")
    f = open_gguf(path)
    return f, config_from_gguf(f)


class DeviceArgmax(NumpyBackend):
    """The numpy backend with the CUDA backend's eval_argmax (each row's argmax, lowest id on ties):
    the loop's greedy verification then takes the device path."""

    calls = 0
    captures: list[int] = []  # eval_argmax calls when each capture_verify came (the loop's start)

    def eval_argmax(self, tokens):
        DeviceArgmax.calls += 1
        return np.asarray(self.eval(tokens, all_logits=True)).reshape(len(tokens), -1).argmax(-1)

    def capture_verify(self):
        DeviceArgmax.captures.append(DeviceArgmax.calls)


def generate(model, prompt, n, params, loop, device_argmax=False, **kw):
    f, cfg = model
    be = (DeviceArgmax if device_argmax else NumpyBackend)(f, cfg, n_ctx=128)
    be.eval(prompt)
    if loop == "plain":
        return list(host_sample_loop(be, n, params, list(prompt), frozenset()))
    return list(speculative_loop(be, n, params, list(prompt), frozenset(), **kw))


def test_greedy_output_is_the_plain_loops(model):
    greedy = SamplingParams(temperature=0.0)
    prompt = prompt_ids(model[1].n_vocab, 12) * 2  # a repeated text: lookup has something to propose
    plain = generate(model, prompt, 40, greedy, "plain")
    stats: dict = {}
    assert generate(model, prompt, 40, greedy, "spec", stats=stats) == plain
    assert stats["proposed"] > 0
    # an oracle that proposes the plain output itself: all kept, a few steps for 40 tokens
    oracle_stats: dict = {}
    done = len(prompt)

    def oracle(hist, k):
        i = len(hist) - done
        return plain[i:i + k]

    assert generate(model, prompt, 40, greedy, "spec", propose=oracle, k=4, stats=oracle_stats) == plain
    assert oracle_stats["accepted"] == oracle_stats["proposed"] and oracle_stats["steps"] <= 10
    # the same through a backend that verifies on its device (eval_argmax), lookup and oracle alike
    DeviceArgmax.calls, DeviceArgmax.captures = 0, []
    assert generate(model, prompt, 40, greedy, "spec", device_argmax=True) == plain
    first = DeviceArgmax.calls
    assert generate(model, prompt, 40, greedy, "spec", device_argmax=True, propose=oracle, k=4) == plain
    assert DeviceArgmax.calls > first > 0
    assert DeviceArgmax.captures == [0, first]  # (each loop's verification graphs before its first step)


def test_wrong_proposals_change_nothing(model):
    """Proposals that are never right: every step keeps none, and the text is the plain loop's."""
    greedy = SamplingParams(temperature=0.0)
    prompt = prompt_ids(model[1].n_vocab, 9, seed=3)
    plain = generate(model, prompt, 16, greedy, "plain")
    stats: dict = {}
    wrong = generate(model, prompt, 16, greedy, "spec", stats=stats,
                     propose=lambda hist, k: [(plain[len(hist) - len(prompt)] + 1) % model[1].n_vocab] * k
                     if len(hist) - len(prompt) < len(plain) else [])
    assert wrong == plain and stats["accepted"] == 0 and stats["proposed"] > 0


# ---- `gguf-run run --spec ngram` ---------------------------------------------------------------
def test_cli_spec_ngram_same_greedy_text(model, tmp_path):
    """The CLI with prompt lookup gives the same greedy text as without, and --verbose reports the
    proposals kept; a bad --spec or one beside a grammar is one line before the model loads."""
    from test_cli import assert_one_line_error, run
    path = model[0].path
    prompt = "a b c d a b c d a b c d a b"
    base = run(path, "-p", prompt, "--raw", "--backend", "numpy", "--temp", "0", "-n", "24")
    spec = run(path, "-p", prompt, "--raw", "--backend", "numpy", "--temp", "0", "-n", "24", "--spec", "ngram",
               "--verbose")
    assert base[0] == spec[0] == 0, (base[2], spec[2])
    assert spec[1] == base[1] and base[1].strip()
    assert "draft acceptance" in spec[2] and "tokens per step" in spec[2]
    assert_one_line_error(run(path, "-p", "x", "--spec", "eagle"), "--spec", "ngram")
    assert_one_line_error(run(path, "-p", "x", "--spec", "ngram", "--json-schema", "{}"), "--spec", "grammar")


class DeviceLoop(NumpyBackend):
    """The numpy backend with a device-style plain loop (start_single / seq_token / end_single, as
    the CUDA backend's): a launch evaluates the last sampled token and samples the next greedily,
    at once, so the launch-ahead loop really evaluates past what the host reads."""

    from types import SimpleNamespace as _NS
    tune = _NS(lookahead=3)
    stream = _NS(synchronize=lambda: None)
    runs = 0

    def eval(self, tokens, all_logits=False):
        self.held = getattr(self, "held", [])[:self.n_past] + list(tokens)  # the tokens the cache holds
        return super().eval(tokens, all_logits=all_logits)

    def gpu_sampling(self, params):
        return True

    def new_event(self):
        return DeviceLoop._NS(record=lambda stream: None, synchronize=lambda: None, done=True)

    def _argmax(self) -> int:
        x = np.asarray(self.last_logits)
        return int(x.reshape(-1, x.shape[-1])[-1].argmax())

    def start_single(self, history, params, seed, given=None):
        DeviceLoop.runs += 1
        assert self.n_past == len(history), "the plain run starts after the whole history is evaluated"
        self._ring = [self._argmax() if given is None else given]

        def launch():
            self.eval([self._ring[-1]])
            self._ring.append(self._argmax())
        return launch

    def end_single(self):
        pass

    def seq_token(self, slot, i):
        return self._ring[i]


def test_fall_back_to_the_plain_loop_keeps_the_greedy_text(model):
    """Where nothing is proposed, or proposals keep failing at k = 1, a device-decoding backend runs
    its plain launch-ahead loop PLAIN_RUN tokens at a time (which evaluates ahead; the cache is cut
    back to what was read): the text is the plain loop's in every case, and the fall-back ran."""
    f, cfg = model
    greedy = SamplingParams(temperature=0.0)
    prompt = prompt_ids(cfg.n_vocab, 12) * 2
    plain = generate(model, prompt, 60, greedy, "plain")
    done = len(prompt)
    from gguf_runtime.engine.speculative import ngram_propose
    cases = {"lookup": ngram_propose, "nothing": lambda hist, k: [],
             "always wrong": lambda hist, k: [(plain[len(hist) - done] + 1) % cfg.n_vocab] * k,
             "oracle": lambda hist, k: plain[len(hist) - done:len(hist) - done + k]}
    for name, propose in cases.items():
        be = DeviceLoop(f, cfg, n_ctx=128)
        be.eval(prompt)
        DeviceLoop.runs = 0
        st: dict = {}
        got = list(speculative_loop(be, 60, greedy, list(prompt), frozenset(), k=4, propose=propose, stats=st))
        assert got == plain, name
        if name in ("nothing", "always wrong"):
            assert DeviceLoop.runs > 0 and st["plain"] > 30, (name, st)
        if name == "oracle":
            assert DeviceLoop.runs == 0 and st["accepted"] == st["proposed"] > 0
        # the cache holds the true sequence, every token but the last one generated (never evaluated)
        assert be.held[:be.n_past] == (prompt + got)[:be.n_past] and be.n_past == len(prompt) + len(got) - 1, name
    # a stop token inside a fall-back run (the launch-ahead loop evaluated past it): cut back to it
    stop_at = next(i for i in range(37, 60) if plain[i] not in plain[:i])
    be = DeviceLoop(f, cfg, n_ctx=128)
    be.eval(prompt)
    got = list(speculative_loop(be, 60, greedy, list(prompt), frozenset({plain[stop_at]}), k=4,
                                propose=lambda hist, k: []))
    assert got == plain[:stop_at + 1] and be.n_past == len(prompt) + len(got) - 1


def test_a_run_with_nothing_to_propose_stops_when_the_lookup_finds_something(model):
    """A fall-back run started because nothing was proposed launches no more steps once the
    proposer has something again; its steps in flight still give their tokens, then proposals
    are verified. The text is the plain loop's."""
    f, cfg = model
    greedy = SamplingParams(temperature=0.0)
    prompt = prompt_ids(cfg.n_vocab, 12) * 2
    plain = generate(model, prompt, 80, greedy, "plain")
    done = len(prompt)

    def late(hist, k):  # nothing until 20 tokens are out, then the plain text itself
        i = len(hist) - done
        return plain[i:i + k] if i >= 20 else []

    be = DeviceLoop(f, cfg, n_ctx=128)
    be.eval(prompt)
    DeviceLoop.runs = 0
    st: dict = {}
    got = list(speculative_loop(be, 80, greedy, list(prompt), frozenset(), k=4, propose=late, stats=st))
    assert got == plain
    # one run (PLAIN_RUN tokens at most) stopped at token 20: its lookahead's 3 steps in flight at most
    assert DeviceLoop.runs == 1 and st["plain"] <= 20 + DeviceLoop.tune.lookahead, st
    assert st["accepted"] == st["proposed"] > 40


def test_a_run_after_failed_lookups_stops_when_the_lookup_foretells_tokens(model):
    """A fall-back run started because the n-gram lookup's proposals failed stops launching once
    the lookup's one-token guesses were right SHADOW_HITS tokens in a row (a copied passage
    begins), instead of running its length; the text is the plain loop's."""
    from gguf_runtime.engine.speculative import NgramLookup, SHADOW_HITS
    f, cfg = model
    greedy = SamplingParams(temperature=0.0)
    prompt = prompt_ids(cfg.n_vocab, 12) * 2
    plain = generate(model, prompt, 90, greedy, "plain")
    done = len(prompt)

    class Copying(NgramLookup):  # wrong until 24 tokens are out, then the text itself
        def __call__(self, hist, k):
            i = len(hist) - done
            return plain[i:i + k] if i >= 24 else [(plain[i] + 1) % cfg.n_vocab] * k

    be = DeviceLoop(f, cfg, n_ctx=160)
    be.eval(prompt)
    DeviceLoop.runs = 0
    st: dict = {}
    got = list(speculative_loop(be, 90, greedy, list(prompt), frozenset(), k=4, propose=Copying(), stats=st))
    assert got == plain
    # two failed steps, then a run (PLAIN_RUN tokens at most) held once two guesses were right
    # (token 24 on): what its lookahead had in flight at most
    assert DeviceLoop.runs == 1, st
    assert st["plain"] <= 24 + SHADOW_HITS + DeviceLoop.tune.lookahead, st
    assert st["accepted"] > 40


def test_adaptive_k_powers_of_two():
    """pow2 (the GPU: matvecs compiled for 1, 2, 4 and 8 rows): k + 1 stays a power of two."""
    from gguf_runtime.engine.speculative import AdaptiveK
    a = AdaptiveK(4, k_max=7, pow2=True)
    assert a.k == 3
    seen = [a.k]
    for _ in range(3):
        a.update(a.k, a.k)
        seen.append(a.k)
    assert seen == [3, 7, 7, 7]
    for _ in range(12):  # (halved once the averaged acceptance is under ``low``)
        a.update(a.k, 0)
        seen.append(a.k)
    assert set(seen) == {1, 3, 7} and a.k == 1
    assert AdaptiveK(4, k_max=8).k == 4 and AdaptiveK(6, k_max=16, pow2=True).k_max == 15
    from types import SimpleNamespace
    from gguf_runtime.engine.speculative import first_k
    gpu, cpu = SimpleNamespace(verify_rows=8), SimpleNamespace()
    assert (first_k(gpu, 4).k, first_k(gpu, 4).k_max) == (3, 7) and first_k(gpu, 16).k == 7
    assert (first_k(cpu, 4).k, first_k(cpu, 4).k_max) == (4, 8) and first_k(gpu, 1).k == 1


def test_failing_proposals_cost_one_cheap_step_a_run(model):
    """Proposals that keep nothing: the first step proposes k, the next one token (the cheapest
    verification), then the plain loop runs; after each run one step of one token tries again
    before the next, twice as long, run."""
    from gguf_runtime.engine.speculative import LOW_STEPS, PLAIN_RUN
    f, cfg = model
    greedy = SamplingParams(temperature=0.0)
    prompt = prompt_ids(cfg.n_vocab, 12) * 2
    plain = generate(model, prompt, 100, greedy, "plain")
    done, asked = len(prompt), []

    def wrong(hist, k):
        asked.append(k)
        return [(plain[len(hist) - done] + 1) % cfg.n_vocab] * k

    be = DeviceLoop(f, cfg, n_ctx=160)
    be.eval(prompt)
    DeviceLoop.runs = 0
    st: dict = {}
    got = list(speculative_loop(be, 100, greedy, list(prompt), frozenset(), k=4, propose=wrong, stats=st))
    assert got == plain
    assert asked[:LOW_STEPS] == [4, 1] and set(asked[LOW_STEPS:]) <= {1}, asked
    # runs of 64 and 128 tokens fill the rest: one try before the later run (asked once per try)
    assert DeviceLoop.runs == 2 and st["steps"] == LOW_STEPS + 1 and st["plain"] == 100 - st["steps"] - 1, st
    assert PLAIN_RUN == 64


def test_bench_spec_rows(model):
    """`gguf-run bench --spec oracle,zero`: a row each, every oracle proposal kept, no zero one; a bad
    proposer's name is one line."""
    import json as _json
    from test_cli import assert_one_line_error, run
    path = model[0].path
    rc, out, err = run("bench", path, "--backend", "numpy", "-p", "0", "-n", "16", "-r", "1", "--spec", "oracle,zero",
                       "--json")
    assert rc == 0, err
    rows = {r["mode"].split(":")[0]: r for r in _json.loads(out)["rows"]}
    assert rows["spec oracle k=4"]["spec"]["acceptance"] == 1.0 and rows["spec oracle k=4"]["spec"]["tokens_per_step"] > 2
    assert rows["spec zero k=4"]["spec"]["acceptance"] == 0.0
    assert rows["spec oracle k=4"]["spec"]["parts_at"] is None and rows["spec zero k=4"]["spec"]["parts_at"] is None
    assert_one_line_error(run("bench", path, "--backend", "numpy", "--spec", "eagle"), "--spec", "oracle")


def test_spec_sim_replays_the_loop_over_a_text(monkeypatch):
    """bench/spec_sim.py's stand-in backend keeps speculative_loop's interface: the replay gives
    the text back, a copied passage is verified in steps of several rows, and time is charged for
    every verification and plainly decoded token."""
    import os
    import sys
    from gguf_runtime.engine import decode_loop
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "..", "bench"))
    sys.modules.pop("spec_sim", None)
    import spec_sim
    prompt = list(range(100, 160))
    out = [7, 8, 9] + list(range(110, 150)) + [3, 1, 4, 1, 5]  # a passage copied from the prompt
    monkeypatch.setattr(decode_loop, "sample_loop", spec_sim.plain_run(1000.0, 500.0, 4))
    be, st = spec_sim.TextBackend(prompt + out, len(prompt), {r: 100.0 * r for r in range(1, 9)}), {}
    got = list(speculative_loop(be, len(out), SamplingParams(temperature=0.0), list(prompt), frozenset(), k=3,
                                stats=st))
    assert got == out
    assert st["accepted"] >= 20 and st["plain"] >= 3, st
    assert be.us >= 1000.0 * st["plain"] + 200.0 * st["steps"], (be.us, st)



def test_fall_back_policy():
    """FallBack (speculative_loop's and the server's): nothing proposed, or LOW_STEPS failed tries,
    start a run; after a run one failed try starts the next, twice as long, up to PLAIN_RUN_MAX; a
    kept proposal resets both; during a run SHADOW_HITS right guesses in a row end it."""
    from gguf_runtime.engine.speculative import LOW_STEPS, PLAIN_RUN, PLAIN_RUN_MAX, SHADOW_HITS, FallBack

    f = FallBack()
    assert f.due(False) and not f.due(True)
    for _ in range(LOW_STEPS - 1):
        f.kept(0)
        assert not f.due(True)
    f.kept(0)
    assert f.due(True) and f.start() == PLAIN_RUN
    assert not f.due(True)
    f.kept(0)
    assert f.due(True) and f.start() == 2 * PLAIN_RUN
    for _ in range(8):
        f.kept(0)
        f.start()
    assert f.length == PLAIN_RUN_MAX
    f.kept(3)
    assert not f.due(True) and f.start() == PLAIN_RUN
    # the watch: guesses compared with the token that follows them
    f.start()
    text = [5, 6, 7, 8, 9]
    said = [f.foretold(t, [text[i + 1]] if i + 1 < len(text) else []) for i, t in enumerate(text)]
    assert said.index(True) == SHADOW_HITS
    f.start()
    assert not any(f.foretold(t, [0]) for t in text)


def test_server_slot_falls_back_as_the_loop_does():
    """The server's SpecSlot keeps FallBack's rule: LOW_STEPS failed tries start a run of PLAIN_RUN
    plain tokens; after it one failed try starts the next, twice as long."""
    from gguf_runtime.engine.speculative import LOW_STEPS, PLAIN_RUN, AdaptiveK
    from gguf_runtime.server.speculation import SpecSlot

    s = SpecSlot([1, 2, 3, 1, 2], AdaptiveK(3))
    for _ in range(LOW_STEPS):
        s.kept(3, 0)
    assert s.plain == PLAIN_RUN and s.proposals(100, 8) == []
    s.read([9] * PLAIN_RUN)
    assert s.plain == 0
    s.kept(1, 0)
    assert s.plain == 2 * PLAIN_RUN
