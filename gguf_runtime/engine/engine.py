"""The engine: a loaded model (weights on a backend, tokenizer, chat template) that generates.

It owns the token history that sits in the backend's KV cache, so a chat turn evaluates only
the tokens after the longest common prefix with what is already cached.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from . import embed as E
from .backend_choice import select_backend
from .constraint import Constraint, compile_grammar
from .decode_loop import sample_loop
from .draft import DraftProposer, check_vocab
from .speculative import ngram_propose, speculative_loop
from .tool_grammar import marker_ids, think_ids
from ..format.chat_template import ChatTemplate
from ..errors import ContextOverflowError, GGUFRunError
from ..format.gguf_file import GGUFFile, open_gguf
from ..format.model_config import ModelConfig, config_from_gguf
from ..sampling import SamplingParams
from ..format.tokenizer import Tokenizer
from ..format.tool_calls import template_family

DEFAULT_CTX = 4096
SPEC_MODES = ("none", "ngram", "draft")  # speculative decoding's proposers (--spec)


def check_spec(spec: str, spec_k: int, has_draft: bool = True) -> None:
    """One line for a speculative-decoding setting generate cannot take (``has_draft``: whether a
    draft model is there for "draft")."""
    if spec not in SPEC_MODES:
        raise GGUFRunError(f"--spec {spec}: use one of {', '.join(SPEC_MODES)}")
    if not 1 <= spec_k <= 16:
        raise GGUFRunError(f"--spec-k {spec_k}: give 1 to 16 proposed tokens a step")
    if spec == "draft" and not has_draft:
        raise GGUFRunError("--spec draft needs a draft model: give --draft FILE (a smaller model of the same family)")


@dataclass
class GenerationStats:
    """The figures ``ollama run --verbose`` prints, in seconds and tokens."""

    load_s: float = 0.0
    prompt_tokens: int = 0
    prompt_s: float = 0.0
    eval_tokens: int = 0
    eval_s: float = 0.0
    total_s: float = 0.0
    stop_reason: str = ""  # "stop" (end-of-generation token), "length" (n_predict), "context", "interrupted"
    spec_steps: int = 0  # speculative decoding: verification steps, tokens proposed, proposals kept,
    spec_proposed: int = 0  # tokens decoded the plain way where speculation did not pay
    spec_accepted: int = 0
    spec_plain: int = 0

    @property
    def prompt_rate(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s > 0 else 0.0

    @property
    def eval_rate(self) -> float:
        return self.eval_tokens / self.eval_s if self.eval_s > 0 else 0.0


@dataclass
class Generation:
    """Iterate to stream text pieces; ``ids`` and ``stats`` fill in as it runs."""

    _pieces: Iterator[str]
    ids: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)

    def __iter__(self) -> Iterator[str]:
        return self._pieces

    def text(self) -> str:
        return "".join(self)

    def close(self) -> None:
        """Stop early (the KV cache keeps what was evaluated; stop_reason becomes "interrupted")."""
        close = getattr(self._pieces, "close", None)
        if close:
            close()


@dataclass
class Embeddings:
    """``Engine.embed``'s answer: one L2-normalized vector a text, and the tokens each evaluated."""

    vectors: np.ndarray  # [texts, dimensions] float32
    tokens: list[int]
    pooling: str  # "mean", "cls" or "last" (engine/embed.py)
    seconds: float = 0.0


def check_text_fits(text: str, tokenizer: Tokenizer, n_ctx: int, what: str = "the prompt") -> None:
    """Refuse, before tokenizing, a text that cannot fit ``n_ctx`` tokens whatever its tokens: no token
    covers more bytes than the vocabulary's longest one (a 10 MB prompt ends here in
    milliseconds instead of after a minute and gigabytes of BPE)."""
    n = len(text)  # characters <= bytes: the exact byte count only when it can matter
    longest = tokenizer.max_token_bytes
    if n > longest * n_ctx and (n := len(text.encode("utf-8", "surrogatepass"))) > longest * n_ctx:
        raise ContextOverflowError(
            f"{what} is {n:,} bytes, more than {n_ctx} tokens of this vocabulary can hold (its "
            f"longest token is {longest} bytes); raise --ctx-size or shorten {what}")


class Engine:
    def __init__(self, path: str | os.PathLike, backend: str = "auto", n_ctx: int | None = None,
                 progress: Callable[[str, int, int], None] | None = None,
                 note: Callable[[str], None] | None = None, use_graph: bool = True, max_batch: int = 1,
                 kv_tokens: int | None = None, kv_types: tuple[str, str] = ("auto", "auto"),
                 tensor_parallel: int = 1, draft: str | os.PathLike | None = None) -> None:
        """``draft``: a smaller model of the same vocabulary, loaded beside this one for
        ``generate(spec="draft")`` (its own backend of the same kind and context)."""
        t0 = time.perf_counter()
        self.path = os.fspath(path)
        self.gguf: GGUFFile = open_gguf(self.path)
        self.cfg: ModelConfig = config_from_gguf(self.gguf)
        self.tokenizer = Tokenizer.from_metadata(self.gguf.metadata)
        self.template = ChatTemplate.from_metadata(self.gguf.metadata)
        # special tokens a generation shows, so that an answer parser (format/tool_calls.py) can tell
        # the reasoning from the answer: a thinking template's <think> and </think> where the
        # vocabulary made them control tokens, a Harmony template's channel markers
        self.shown = ((think_ids(self.tokenizer) if self.template.supports_thinking else frozenset())
                      | (marker_ids(self.tokenizer, "harmony") if template_family(self.template.source) == "harmony"
                         else frozenset()))
        if n_ctx is None:
            n_ctx = min(DEFAULT_CTX, self.cfg.n_ctx_train)
        elif n_ctx == 0:  # as llama.cpp's -c 0: the context the model was trained for
            n_ctx = self.cfg.n_ctx_train
        if n_ctx < 8:
            raise GGUFRunError(f"context size {n_ctx} is too small; use --ctx-size 8 or more")
        self.n_ctx = n_ctx
        self.backend = select_backend(backend, self.gguf, self.cfg, n_ctx, progress=progress, note=note,
                                      use_graph=use_graph, max_batch=max_batch, kv_tokens=kv_tokens,
                                      kv_types=kv_types, tensor_parallel=tensor_parallel)
        self.cached: list[int] = []  # tokens whose K/V sit in the backend's cache, in order
        self.draft: DraftProposer | None = None
        if draft is not None:
            d = Engine(draft, backend=getattr(self.backend, "name", backend), n_ctx=n_ctx, progress=progress,
                       note=note, use_graph=use_graph)
            check_vocab(self, d, self.path, os.fspath(draft))
            self.draft = DraftProposer(d, self.cfg.n_vocab)
        self.load_s = time.perf_counter() - t0
        self._load_reported = False  # the load time counts in the first generation's stats only

    # ---- prompts -----------------------------------------------------------------------------
    @property
    def has_template(self) -> bool:
        return not self.template.is_fallback

    def encode_raw(self, text: str) -> list[int]:
        self.check_text_fits(text)
        return self.tokenizer.encode(text, add_special=True, parse_special=False)

    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    tools: Sequence[dict] | None = None, **variables: Any) -> list[int]:
        """The chat's prompt tokens; ``tools`` (OpenAI-style function items) reach the template as its
        ``tools`` variable, ``variables`` as theirs (``reasoning_effort``, ``enable_thinking``)."""
        self.check_text_fits("".join(str(m.get("content") or "") for m in messages if isinstance(m, dict)))
        extra = {**variables, **({"tools": list(tools)} if tools else {})}
        text = self.template.render(list(messages), add_generation_prompt=add_generation_prompt, **extra)
        self.check_text_fits(text)
        ids = self.tokenizer.encode(text, add_special=True, parse_special=True)
        bos = self.tokenizer.bos_id
        if len(ids) >= 2 and ids[0] == bos and ids[1] == bos:  # template wrote BOS itself
            ids = ids[1:]
        return ids

    def check_text_fits(self, text: str) -> None:
        check_text_fits(text, self.tokenizer, self.n_ctx)

    # ---- generation --------------------------------------------------------------------------
    def check_fits(self, n_prompt: int) -> None:
        if n_prompt >= self.n_ctx:
            raise ContextOverflowError(
                f"the prompt is {n_prompt} tokens but the context holds {self.n_ctx}; "
                "raise --ctx-size or shorten the prompt")

    def constraint(self, kind: str, spec=None) -> Constraint:
        """A fresh grammar state for one generation (constraint.compile_grammar's kinds: "json",
        "json_schema", "gbnf", "lark", "regex"); GrammarError names a schema or grammar it cannot use."""
        return Constraint(self.tokenizer, self.cfg.n_vocab, compile_grammar(kind, spec))

    def generate(self, prompt_ids: Sequence[int], n_predict: int = 128,
                 params: SamplingParams | None = None, stop_ids: frozenset[int] | None = None,
                 constraint: Constraint | None = None, spec: str = "none", spec_k: int = 4) -> Generation:
        """Stream the continuation of ``prompt_ids`` (evaluating only what isn't cached); with
        ``constraint`` (self.constraint) only output its grammar allows; ``spec`` "ngram": proposals
        by prompt lookup, "draft": by the draft model (up to ``spec_k`` a step), checked in one
        evaluation each (speculative.py)."""
        check_spec(spec, spec_k, self.draft is not None)
        if spec != "none" and constraint is not None:
            raise GGUFRunError("--spec and a grammar (--json-schema, --grammar) do not combine yet; drop one")
        params = params or SamplingParams()
        params.validate()
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise GGUFRunError("the prompt is empty after tokenization; give some text")
        self.check_fits(len(prompt_ids))
        stop = self.tokenizer.eog_ids if stop_ids is None else stop_ids
        gen = Generation(iter(()))
        gen._pieces = self._run(prompt_ids, n_predict, params, stop, gen, constraint, spec, spec_k)
        return gen

    def _run(self, prompt_ids: list[int], n_predict: int, params: SamplingParams,
             stop: frozenset[int], gen: Generation, constraint: Constraint | None = None, spec: str = "none",
             spec_k: int = 4) -> Iterator[str]:
        st = gen.stats
        if not self._load_reported:
            st.load_s, self._load_reported = self.load_s, True
        t0 = t1 = time.perf_counter()
        keep = _common_prefix(self.cached, prompt_ids)
        if keep == len(prompt_ids):  # the whole prompt is cached: re-evaluate its last token
            keep -= 1
        self.backend.truncate(keep)
        del self.cached[keep:]
        new = prompt_ids[keep:]
        st.prompt_tokens = len(new)
        self.cached.extend(new)  # trimmed back in `finally` to what the backend really evaluated
        decoder = self.tokenizer.stream(skip_special=True, keep=self.shown)
        history = list(prompt_ids)
        counts: dict = {}  # speculative decoding's (speculative_loop's stats)
        try:
            self.backend.prefill(new)
            t1 = time.perf_counter()
            st.prompt_s = t1 - t0
            budget = min(n_predict if n_predict >= 0 else self.n_ctx, self.n_ctx - len(self.cached))
            st.stop_reason = "length" if budget == n_predict else "context"
            if spec != "none":
                propose = self.draft if spec == "draft" else ngram_propose
                tokens = speculative_loop(self.backend, budget, params, history, stop, k=spec_k, propose=propose,
                                          stats=counts)
            else:
                tokens = sample_loop(self.backend, budget, params, history, stop, constraint)
            for tok in tokens:
                if tok in stop:
                    st.stop_reason = "stop"
                    break
                gen.ids.append(tok)
                history.append(tok)
                self.cached.append(tok)
                st.eval_tokens += 1
                piece = decoder.push(tok)
                if piece:
                    yield piece
        except (KeyboardInterrupt, GeneratorExit):
            st.stop_reason = "interrupted"
            raise
        finally:
            st.spec_steps, st.spec_proposed = counts.get("steps", 0), counts.get("proposed", 0)
            st.spec_accepted, st.spec_plain = counts.get("accepted", 0), counts.get("plain", 0)
            # keep exactly the tokens whose K/V the backend holds (a prefill cut short, a backend
            # that ran ahead, or the last accepted token not yet evaluated)
            n = min(self.backend.n_past, len(self.cached))
            del self.cached[n:]
            self.backend.truncate(n)
            now = time.perf_counter()
            if not st.prompt_s:
                st.prompt_s = now - t0
            st.eval_s = now - t1 if st.prompt_s and t1 > t0 else 0.0
            st.total_s = now - t0 + st.load_s
        tail = decoder.flush()
        if tail:
            yield tail

    # ---- embeddings --------------------------------------------------------------------------
    def embed(self, texts: Sequence[str], truncate: bool = True, dimensions: int | None = None) -> Embeddings:
        """Each text's embedding (engine/embed.py): tokenized as a prompt, its final hidden states
        pooled as the file's pooling_type says, L2-normalized; ``truncate``: cut a text longer than
        the context (else ContextOverflowError); ``dimensions``: its first N values, normalized again."""
        t0 = time.perf_counter()
        pooling = E.pooling_of(self.cfg)
        E.check_dimensions(dimensions, self.cfg.n_embd)
        ids = [E.text_ids(self.tokenizer, t, self.n_ctx, truncate, f"text {i + 1}") for i, t in enumerate(texts)]
        vecs = [E.finish(E.pool(self.hidden(x), pooling), dimensions) for x in ids]
        width = dimensions or self.cfg.n_embd
        return Embeddings(np.stack(vecs) if vecs else np.zeros((0, width), np.float32), [len(x) for x in ids],
                          pooling, time.perf_counter() - t0)

    def hidden(self, ids: Sequence[int]) -> np.ndarray:
        """The final hidden states [T, n_embd] of ``ids`` as a sequence of their own (the backend's
        ``hidden``); where that reused the single sequence's cache (CUDA), the cached prefix is gone."""
        try:
            return self.backend.hidden(list(ids))
        finally:
            del self.cached[min(self.backend.n_past, len(self.cached)):]

    def reset(self) -> None:
        self.backend.truncate(0)
        self.cached.clear()


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
