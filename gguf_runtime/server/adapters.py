"""Backend adapters: the small interface the scheduler drives, over the CUDA and numpy backends.

An adapter has ``tokenizer``, ``n_ctx``, ``max_slots`` and ``margin`` (context tokens a sequence
needs past its budget), and four calls, all made from the scheduler's thread:

* ``add(slot, prompt, params, max_new) -> int``: admit a sequence (prefill it, sample its first
  token: at once, or in the next ``step`` with the other admissions); returns how many prompt
  tokens it will evaluate (the rest comes from the prefix cache; ``prompt_eval`` may lower it
  before the first token). Raises :class:`NoRoom` when the KV cache cannot hold it right now (the
  scheduler keeps it waiting).
* ``step() -> {slot: [token, ...]}``: advance every admitted sequence; returns the tokens that
  became readable (in order; possibly none for a slot, possibly several). A slot whose admission
  failed after ``add`` returned (a later chunk of its prompt) shows in ``failed`` (slot ->
  exception) until released. A slot admitted with ``logprobs=k`` (k >= 0) has, after each step,
  ``logprobs[slot]``: one ``sampling.token_logprobs`` entry per token returned, in order.
* ``release(slot)``: forget the sequence; its slot and KV pages are free at once.
* ``embed(slot, ids) -> vector``: the pooled final hidden states of ``ids`` as a sequence of their
  own (engine/embed.py: not yet normalized), between steps, leaving the admitted sequences as they
  were; ``embed_slot`` says whether it needs a free slot for that (raises :class:`NoRoom` like
  ``add`` when the KV cache cannot hold it right now).
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Callable, Sequence

from ..errors import BackendError, KVCacheFullError
from ..engine import embed as E
from ..engine.constraint import Constraint
from ..engine.decode_loop import LaunchAhead
from ..sampling import SamplingParams, token_logprobs
from .speculation import Speculation, speculates

MAX_GPU_TOP_K = 1024  # the CUDA sampler's top-k limit (backends/cuda/backend.MAX_GPU_TOP_K)


class NoRoom(Exception):
    """The KV cache has no pages for this sequence now; try again when one finishes."""


def make_adapter(engine, depth: int = 2, progress: Callable[[str, int, int], None] | None = None,
                 prefix_cache: bool = True, spec: str = "none", spec_k: int = 4):
    """The adapter for the engine's backend: CUDA (batched) or numpy (one sequence at a time).
    ``spec`` "ngram": speculative decoding of a few greedy sequences (CUDA, one GPU; speculation.py)."""
    if getattr(engine.backend, "name", "") == "cuda":
        return CudaAdapter(engine, depth=depth, progress=progress, prefix_cache=prefix_cache, spec=spec,
                           spec_k=spec_k)
    if spec != "none":
        raise BackendError(f"serve --spec {spec} needs the cuda backend; drop --spec")
    return NumpyAdapter(engine)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n, i = min(len(a), len(b)), 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class NumpyAdapter:
    """One sequence at a time in slot 0 (the numpy backend holds one KV cache), reusing the KV
    prefix the previous request left (the engine's ``cached`` bookkeeping)."""

    name = "numpy"
    max_slots = 1
    margin = 0

    def __init__(self, engine) -> None:
        self.engine, self.be, self.tokenizer = engine, engine.backend, engine.tokenizer
        self.n_ctx = engine.n_ctx
        self._it = None
        self._seq: list[int] = []
        self.logprobs: dict[int, list] = {}

    def add(self, slot: int, prompt: Sequence[int], params: SamplingParams, max_new: int,
            grammar: str | None = None, logprobs: int = -1) -> int:
        eng, be = self.engine, self.be
        constraint = Constraint(self.tokenizer, eng.cfg.n_vocab, grammar) if grammar else None
        prompt = list(prompt)
        keep = _common_prefix(eng.cached, prompt)
        if keep == len(prompt):  # all cached: re-evaluate the last token for its logits
            keep -= 1
        be.truncate(keep)
        del eng.cached[keep:]
        eng.cached.extend(prompt[keep:])
        self._seq = prompt
        try:
            be.prefill(prompt[keep:])
        except BaseException:
            self._trim()
            raise
        on_token = None
        if logprobs >= 0:
            seen = self.logprobs[slot] = []
            on_token = lambda logits, tok: seen.append(token_logprobs(logits, tok, logprobs))  # noqa: E731
        self._it = be.sample_loop(max_new, params, list(prompt), frozenset(), constraint=constraint,
                                  on_token=on_token)
        return len(prompt) - keep

    def step(self) -> dict[int, list[int]]:
        if self._it is None:
            return {}
        for entries in self.logprobs.values():
            entries.clear()  # this step's entries only (on_token appends to this list)
        try:
            tok = next(self._it)
        except StopIteration:
            self._it = None
            return {}
        self._seq.append(tok)
        return {0: [tok]}

    embed_slot = False  # the backend's hidden() makes a cache of its own for the call

    def embed(self, slot: int, ids: Sequence[int]):
        return E.pool(self.be.hidden(list(ids)), E.pooling_of(self.engine.cfg))

    def release(self, slot: int) -> None:
        if self._it is not None:
            self._it.close()
            self._it = None
        self.logprobs.pop(slot, None)
        self._trim()

    def _trim(self) -> None:
        """Keep as cached exactly the tokens whose K/V the backend holds."""
        n = min(self.be.n_past, len(self._seq))
        self.engine.cached[:] = self._seq[:n]
        self.be.truncate(n)


@dataclasses.dataclass
class _Filling:
    prompt: list[int]
    params: SamplingParams
    max_new: int
    done: int  # prompt tokens in the slot's pages (cached or evaluated)
    after: int = -1  # an earlier admission's slot whose prompt shares full pages with this one (it waits)


class CudaAdapter:
    """Every admitted sequence in its own slot of the CUDA backend's batch graphs.

    Up to ``depth`` decode steps are in flight: ``step`` launches steps until ``depth`` are
    enqueued, then waits for the oldest and reads the tokens it (and what preceded it on the
    stream) produced from the pinned ring. A sequence therefore runs up to ``depth - 1`` steps
    past its end before the host sees it; ``margin`` = ``depth`` extra tokens of KV pages are
    reserved for that, and the scheduler clips budgets so they stay inside the context. A slot
    released while steps are in flight is safe to reuse at once: everything is ordered on the
    backend's one stream, and tokens of the old sequence are dropped by their admission number.

    Prompts are evaluated in ``step``, before its decode launch: every prompt admitted since the
    last step together (the backend packs them into as few forwards as its workspace allows:
    64 arrivals cost one forward, not 64), and, while other sequences decode, a prompt with more
    than ``chunk`` tokens to evaluate (the tuning table's serve_chunk) ``chunk`` tokens a step, the
    oldest first, so the running streams keep a token every step; short prompts never wait behind
    a document's chunks. A sequence joins the decode steps once its last part is evaluated and its
    first token sampled. A prompt that shares full pages with an earlier one admitted but not yet
    evaluated (the same system prompt arriving together) waits for it and then takes its pages.

    Grammars (structured output, forced tool calls) and logprobs ride the same steps: a constrained
    slot's mask row is written on the host after each of its tokens is read, and while one runs a
    step is launched only once its tokens are read (one step in flight, the others' throughput
    with it); logprobs are read beside each token (the backend's kernels around its sampler).

    Speculative decoding (``spec`` "ngram", server/speculation.py): while the decoding sequences
    are few and all greedy, their n-gram proposals are verified together, several tokens a step
    (the backend's verify_many and seq_commit); the loop launches nothing while one is wanted.

    The prefix cache (``prefix_cache``, backends/page_pool.py): a prompt's leading full pages that
    an earlier or running sequence wrote are taken as they are; at release a sequence's pages are
    kept under the tokens whose K/V it wrote: the prompt and every generated token but the last one
    the host has read (the step that produced that one wrote its predecessor's K/V).
    """

    name = "cuda"
    new_constraint = Constraint  # (tokenizer, n_vocab, grammar) -> a sequence's grammar state

    def __init__(self, engine, depth: int = 2, new_event: Callable[[], object] | None = None,
                 capture: bool = True, progress: Callable[[str, int, int], None] | None = None,
                 prefix_cache: bool = True, spec: str = "none", spec_k: int = 4) -> None:
        be = engine.backend
        ring = getattr(be, "ring", None)
        ring_len = len(ring) if ring is not None else 64  # tokens a slot the pinned ring holds
        self.engine, self.be, self.tokenizer = engine, be, engine.tokenizer
        self.n_ctx, self.max_slots = be.n_ctx, be.max_batch
        self.depth = max(1, min(int(depth), ring_len // 2))
        self.margin = self.depth
        self.prefix_cache = prefix_cache
        self.chunk = getattr(getattr(be, "tune", None), "serve_chunk", 0)
        self.pack = hasattr(be, "seq_prefill_many") and getattr(getattr(be, "tune", None), "serve_pack", True)
        self._tokens: dict[int, tuple[int, list[int]]] = {}  # slot -> (prompt length, prompt + tokens read), cache on
        self._filling: dict[int, _Filling] = {}  # slots whose prompts are being evaluated, in admission order
        self.failed: dict[int, BaseException] = {}  # slots whose prompt failed after add (scheduler: fail them)
        self.prompt_eval: dict[int, int] = {}  # slot -> prompt tokens it evaluates (scheduler reads it at the first token)
        self.logprobs: dict[int, list] = {}  # slot -> this step's entries (slots that report them)
        # slot -> (its grammar's state, its pinned mask row): while any runs, a step is launched only
        # once every constrained slot's tokens are read and its next mask written (one step in flight)
        self._constraints: dict[int, tuple[Constraint, object]] = {}
        if spec not in ("none", "ngram"):
            raise BackendError(f"serve --spec {spec} is not served yet; use --spec ngram or none")
        if spec == "ngram" and not getattr(be, "slot_speculation", False):
            raise BackendError("serve --spec ngram is not served by this backend; drop --spec, or serve with "
                               "--backend cuda")
        self.spec = Speculation(be, spec_k) if spec == "ngram" else None  # (speculation.py)
        self.loop = LaunchAhead(be, self.depth, margin=self.margin, new_event=new_event, read=self._read,
                                gate=self._may_launch)
        if capture and getattr(be, "use_graph", False) and hasattr(be, "capture_buckets"):
            be.capture_buckets(progress=progress)  # before serving: no capture pause mid-stream
            rows = getattr(getattr(be, "tune", None), "serve_capture_packed", 0)
            if self.pack and rows and hasattr(be, "capture_packed"):  # (waves of prompts: their sizes too)
                be.capture_packed(rows)
            if hasattr(be, "capture_small"):  # (a cached prefix or a chunk budget leaves a few tokens)
                be.capture_small()
            if self.spec is not None and hasattr(be, "capture_verify"):
                be.capture_verify()  # (slot 0 holds no pages yet: its cache writes are skipped)

    def _params(self, p: SamplingParams) -> SamplingParams:
        """The GPU sampler keeps at most 1024 candidates: top-k 0 (off) or above becomes 1024."""
        if not p.greedy and not 0 < p.top_k <= MAX_GPU_TOP_K:
            return dataclasses.replace(p, top_k=MAX_GPU_TOP_K)
        return p

    def add(self, slot: int, prompt: Sequence[int], params: SamplingParams, max_new: int,
            grammar: str | None = None, logprobs: int = -1) -> int:
        if logprobs >= 0 and not hasattr(self.be, "seq_logprobs"):
            raise BackendError("logprobs are not served by this backend; serve with --backend numpy, or leave "
                               "logprobs and top_logprobs unset")
        if grammar and not getattr(self.be, "grammar_masks", False):
            raise BackendError("structured output (format / response_format) and forced tool calls (tool_choice "
                               "\"required\" or a named function) are not served by this backend; serve with "
                               "--backend cuda or numpy, or use `gguf-run run --json-schema` for one answer")
        be, prompt, params = self.be, list(prompt), self._params(params)
        constraint = self.new_constraint(self.tokenizer, self.engine.cfg.n_vocab, grammar) if grammar else None
        try:
            cached = be.seq_start(slot, prompt, params, max_new + self.margin, reuse=self.prefix_cache)
        except KVCacheFullError:
            raise NoRoom from None
        if logprobs >= 0:  # (the kernels around the GPU sampler write them beside each token)
            be.seq_logprobs(slot, logprobs)
            self.logprobs[slot] = []
        if constraint is not None:  # the first token's mask, sampled after the prompt
            row = be.seq_constrain(slot)
            constraint.fill(row)
            self._constraints[slot] = (constraint, row)
        if self.spec is not None and speculates(params, grammar, logprobs):
            self.spec.add(slot, prompt)
        f = self._filling[slot] = _Filling(prompt, params, max_new, cached)
        if self.prefix_cache:
            f.after = self._shares_with(slot, prompt, cached)
        self.prompt_eval[slot] = len(prompt) - cached
        return len(prompt) - cached

    def _shares_with(self, slot: int, prompt: list[int], cached: int) -> int:
        """An earlier prompt still to be evaluated whose full pages this one shares past its cached
        part (its slot), else -1: waiting for it costs a step and saves evaluating those pages."""
        page = self.be.kv.page_size
        for other, g in self._filling.items():
            if other == slot or g.after >= 0:
                continue
            n = min(len(prompt) - 1, len(g.prompt)) // page * page
            if n > cached and prompt[:cached + page] == g.prompt[:cached + page]:
                return other
        return -1

    def _restart(self, slot: int, f: _Filling) -> None:
        """The pages of the prompt it waited for are cached now: take the slot's pages again, with
        them (only fewer pages are needed: it fits)."""
        if len(self.be.kv.match(f.prompt)) * self.be.kv.page_size <= f.done:
            return
        self.be.seq_release(slot)
        f.done = self.be.seq_start(slot, f.prompt, f.params, f.max_new + self.margin, reuse=True)
        self.prompt_eval[slot] = len(f.prompt) - f.done

    def _evaluate(self) -> None:
        """This step's prompt parts: each admitted prompt whole where it has at most ``chunk`` tokens
        left or nothing decodes, else a chunk of the oldest long one; then those that waited for an
        earlier prompt's pages, once it is done."""
        touched: set[int] = set()
        budget = self.chunk if self.chunk > 0 and self.loop.busy() else None
        while True:
            parts, chunked = [], False
            for slot, f in list(self._filling.items()):
                if slot in touched or f.after in self._filling:
                    continue
                if f.after >= 0:
                    f.after = -1
                    try:
                        self._restart(slot, f)
                    except Exception as e:  # noqa: BLE001 - this request's alone
                        del self._filling[slot]
                        self.failed[slot] = e
                        continue
                left = len(f.prompt) - f.done
                if budget is None or left <= budget:
                    parts.append((slot, left))
                elif not chunked:
                    parts.append((slot, budget))
                    chunked = True
            if not parts:
                return
            touched.update(slot for slot, _ in parts)
            self._run(parts)

    def _run(self, parts: list[tuple[int, int]]) -> None:
        be, calls = self.be, []
        for slot, n in parts:
            f = self._filling[slot]
            first = None
            if f.done + n >= len(f.prompt):  # (the seed chosen here: every rank of a split model alike)
                seed = f.params.seed if f.params.seed is not None else secrets.randbits(63)
                first = (f.prompt, f.params, seed, self.prefix_cache)
            calls.append((slot, f.prompt[f.done:f.done + n], first))
        if self.pack:
            try:
                be.seq_prefill_many(calls)
            except Exception as e:  # noqa: BLE001 - these prompts' requests fail; the rest keep serving
                for slot, _, _ in calls:
                    self._filling.pop(slot, None)
                    self.failed[slot] = e
                return
            done = calls
        else:
            done = []
            for call in calls:
                slot, toks, first = call
                try:
                    be.seq_prefill(slot, toks)
                    if first is not None:
                        be.seq_first(slot, *first)
                except Exception as e:  # noqa: BLE001 - this prompt's failure is its request's alone
                    self._filling.pop(slot, None)
                    self.failed[slot] = e
                    continue
                done.append(call)
        for slot, toks, first in done:
            f = self._filling[slot]
            f.done += len(toks)
            if first is None:
                continue
            del self._filling[slot]
            self.loop.admit(slot, f.max_new)
            if self.prefix_cache:  # (the tokens it writes, kept at release)
                self._tokens[slot] = (len(f.prompt), f.prompt)

    def _read(self, slot: int, i: int) -> int:
        """A token the loop reads; where the slot asks, its logprobs entry, and its grammar advanced
        by it with the next step's mask written into the slot's row."""
        tok = self.be.seq_token(slot, i)
        if (seen := self.logprobs.get(slot)) is not None:
            seen.append(self.be.seq_logprobs_entry(slot, i, tok))
        if (c := self._constraints.get(slot)) is not None:  # the next step's mask for this slot
            try:
                c[0].advance(tok)
                c[0].fill(c[1])
            except Exception as e:  # noqa: BLE001 - this request's grammar: it fails alone
                del self._constraints[slot]
                self.failed[slot] = e
        return tok

    def _may_launch(self) -> bool:
        """The loop's gate: every grammar's mask written, and no verification wanted."""
        return all(self.loop.unread(s) == 0 for s in self._constraints) and not (self.spec and self.spec.want)

    def step(self) -> dict[int, list[int]]:
        for entries in self.logprobs.values():
            entries.clear()  # this step's entries only (_read appends them in token order)
        if self._filling:
            self._evaluate()
        if self.spec is not None and (props := self.spec.plan(self.loop, bool(self._filling))) is not None:
            try:
                self.spec.verify(self.loop, props)
            except Exception as e:  # noqa: BLE001 - these requests' alone (their tokens so far stand)
                for slot in props:
                    self.spec.drop(slot)
                    self.failed[slot] = e
        out = self.loop.step()
        if self.spec is not None:
            self.spec.read(out)
        for slot, toks in out.items():
            if slot in self._tokens:
                self._tokens[slot][1].extend(toks)
        return out

    embed_slot = True  # the evaluation runs in a free slot's KV pages (reserved for it, released after)

    def embed(self, slot: int, ids: Sequence[int]):
        try:
            hidden = self.be.hidden(list(ids), slot=slot)
        except KVCacheFullError:
            raise NoRoom from None
        return E.pool(hidden, E.pooling_of(self.engine.cfg))

    def release(self, slot: int) -> None:
        self.loop.drop(slot)
        if self.spec is not None:
            self.spec.drop(slot)
        self.logprobs.pop(slot, None)
        self._constraints.pop(slot, None)
        self.failed.pop(slot, None)
        self.prompt_eval.pop(slot, None)
        n_prompt, toks = self._tokens.pop(slot, (0, []))
        written = toks[:max(n_prompt, len(toks) - 1)]
        if (f := self._filling.pop(slot, None)) is not None:  # cancelled while its prompt was evaluated
            written = f.prompt[:f.done]
        self.be.seq_release(slot, written if self.prefix_cache else [])
