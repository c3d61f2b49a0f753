"""Constrained decoding: each step's allowed tokens from a grammar engine (llguidance, as llama.cpp's
LLGUIDANCE build and vLLM use), for JSON output, JSON schemas, GBNF / Lark grammars and regexes.

``compile_grammar`` turns what a user gave (CLI file, Ollama ``format``, OpenAI ``response_format``)
into llguidance's grammar text, raising ``GrammarError`` with one line naming the problem.
``Constraint`` follows one sequence: ``apply(logits)`` sets the logits of tokens the grammar
forbids to -inf (the sampler then draws only allowed ones), ``advance(token)`` consumes the drawn
token. Once the grammar is complete only the end-of-generation tokens are allowed, so a complete
output ends the generation. The vocabulary is handed over once per tokenizer (cached): each id's
bytes as llama_token_to_piece gives them, control tokens marked special, as llguidance's own
llama.cpp bridge does.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

import numpy as np

from ..errors import GrammarError
from ..format.tokenizer import Tokenizer

KINDS = ("json", "json_schema", "gbnf", "lark", "regex")
# llguidance's JSON options unless a schema sets its own: one space after ':' and ',' and nowhere
# else (a model may otherwise fill a value's surroundings with whitespace until the token budget ends)
COMPACT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def _llg():
    try:
        import llguidance
    except ImportError:  # (a dependency of the package: only a broken install lacks it)
        raise GrammarError("structured output needs the llguidance package: pip install llguidance") from None
    return llguidance


def closed_objects(schema: Any, bare: bool = True, depth: int = 0, part: bool = False) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that does not say, as
    llama.cpp's grammars (and so Ollama's) read a schema: an object holds the keys it declares, not
    keys of the model's own. bare: also an object schema without properties (a tool's arguments);
    else (structured output) that one stays any object, as llama.cpp's. The branches of an allOf
    (part) stay open: each holds only part of the object's keys."""
    if not isinstance(schema, dict) or depth > 32:
        return schema
    out = {}
    for k, v in schema.items():
        if k in ("properties", "$defs", "definitions", "patternProperties") and isinstance(v, dict):
            out[k] = {name: closed_objects(sub, bare, depth + 1) for name, sub in v.items()}
        elif k in ("items", "additionalItems", "not", "if", "then", "else", "contains"):
            out[k] = closed_objects(v, bare, depth + 1)
        elif k == "allOf" and isinstance(v, list) and len(v) > 1 and all(_plain_object(sub) for sub in v):
            # the parts of one object: one object of all their keys, as llama.cpp merges them
            props = {name: sub for branch in v for name, sub in branch.get("properties", {}).items()}
            req = [r for branch in v for r in branch.get("required", [])]
            out[k] = [closed_objects({"type": "object", "properties": props, "required": list(dict.fromkeys(req))},
                                     bare, depth + 1)]
        elif k in ("anyOf", "oneOf", "allOf", "prefixItems") and isinstance(v, list):
            out[k] = [closed_objects(sub, bare, depth + 1, part=k == "allOf" and len(v) > 1) for sub in v]
        else:
            out[k] = v
    if not part and ("properties" in out or bare and out.get("type") == "object") and \
            "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _plain_object(schema: Any) -> bool:
    """An object schema of properties alone (no $ref, no word on additional keys): an allOf of them
    merges into one."""
    return isinstance(schema, dict) and isinstance(schema.get("properties", {}), dict) and \
        isinstance(schema.get("required", []), list) and \
        set(schema) <= {"type", "properties", "required", "title", "description"} and \
        schema.get("type", "object") == "object"


def compile_grammar(kind: str, spec: Any) -> str:
    """llguidance's grammar for ``spec``: kind "json" (any JSON object, spec unused), "json_schema"
    (a schema as a dict or JSON text; objects with properties closed unless it says, closed_objects),
    "gbnf" (llama.cpp's GBNF, or Lark), "lark", "regex"."""
    llg = _llg()
    if kind not in KINDS:
        raise GrammarError(f"unknown grammar kind {kind!r}; use one of {', '.join(KINDS)}")
    try:
        if kind in ("json", "json_schema"):
            schema = {"type": "object"} if kind == "json" else (
                json.loads(spec) if isinstance(spec, (str, bytes)) else spec)
            if not isinstance(schema, dict):
                raise GrammarError("a JSON schema must be a JSON object")
            if kind == "json_schema":
                schema = closed_objects(schema, bare=False)
            if "x-guidance" not in schema:  # compact JSON: no free whitespace to wander into
                schema = {**schema, "x-guidance": COMPACT}
            text = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        elif kind == "gbnf":
            text = llg.grammar_from("gbnf", spec)
        elif kind == "lark":
            text = llg.LLMatcher.grammar_from_lark(spec)
        else:
            text = llg.LLMatcher.grammar_from_regex(spec)
    except GrammarError:
        raise
    except json.JSONDecodeError as e:
        raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
    except (ValueError, TypeError, RuntimeError) as e:
        raise GrammarError(f"the {kind} grammar cannot be used: {_first_line(e)}") from None
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(text)
    if is_error:
        raise GrammarError(f"the {kind} grammar cannot be used: {_first_line(messages)}")
    return text


def _first_line(x: Any) -> str:
    """An engine message in one line: its first line, and where that only opens a multi-line report
    (a regex's "regex parse error:", the pattern, a caret line, then "error: why"), the why too."""
    s = "; ".join(x) if isinstance(x, list) else str(x)
    lines = [ln.strip() for ln in s.strip().splitlines() if ln.strip()]
    if not lines:
        return "(no reason given)"
    why = next((ln for ln in lines[1:] if ln.lower().startswith("error:")), None)
    if lines[0].endswith(":") and why is not None:
        where = f" (in {lines[1]})" if lines[1] is not why else ""
        return f"{lines[0]} {why[len('error:'):].strip()}{where}"
    return lines[0]


class _Vocab:
    """The duck-typed tokenizer llguidance.TokenizerWrapper reads."""

    def __init__(self, tok: Tokenizer, n_vocab: int) -> None:
        self._tok = tok
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else min(tok.eog_ids, default=0)
        self.bos_token_id = tok.bos_id
        pieces = []
        for i in range(n_vocab):
            b = tok.token_to_bytes(i) if i < len(tok.tokens) else b""
            if i < len(tok.tokens) and tok.is_control(i):
                b = b"\xff" + b  # llguidance's mark of a special token (never matched as text)
            pieces.append(b)
        self.tokens = pieces
        self.special_token_ids = [i for i in range(min(n_vocab, len(tok.tokens))) if tok.is_control(i)]

    def __call__(self, s: bytes | str) -> list[int]:
        text = s.decode("utf-8", "replace") if isinstance(s, bytes) else s
        return self._tok.encode(text, add_special=False)


# per tokenizer (weakly: a tokenizer that is gone takes its entry along), per logits width
_TOKENIZERS: "weakref.WeakKeyDictionary[Tokenizer, dict[int, Any]]" = weakref.WeakKeyDictionary()


def ll_tokenizer(tok: Tokenizer, n_vocab: int):
    """The llguidance tokenizer of ``tok`` over the model's ``n_vocab`` logits (made once: the whole
    vocabulary's bytes are handed over), the end-of-generation ids as its EOS tokens."""
    by_width = _TOKENIZERS.setdefault(tok, {})
    lt = by_width.get(n_vocab)
    if lt is None:
        llg = _llg()
        eos = sorted(i for i in tok.eog_ids if i < n_vocab)
        lt = by_width[n_vocab] = llg.LLTokenizer(llg.TokenizerWrapper(_Vocab(tok, n_vocab)), n_vocab=n_vocab,
                                                 eos_token=eos or None)
    return lt


class Constraint:
    """One sequence's grammar state (see the module)."""

    def __init__(self, tok: Tokenizer, n_vocab: int, grammar: str) -> None:
        llg = _llg()
        self.n_vocab = n_vocab
        self._m = llg.LLMatcher(ll_tokenizer(tok, n_vocab), grammar, log_level=0)
        if self._m.is_error():
            raise GrammarError(f"the grammar cannot be used: {_first_line(self._m.get_error())}")
        self._mask = np.zeros((n_vocab + 31) // 32, np.int32)
        # the first mask: a grammar that no output matches fails here, before any work
        self._m.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        if self._m.is_error():
            raise GrammarError("the grammar admits no output at all (nothing can match it, e.g. a JSON schema that "
                               "only refers to itself); fix the schema or grammar")

    def allowed(self) -> np.ndarray:
        """A bool array over the vocabulary: the tokens the grammar allows next."""
        self._m.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        bits = np.unpackbits(self._mask.view(np.uint8), bitorder="little")
        return bits[:self.n_vocab].astype(bool)

    def fill(self, words: np.ndarray) -> None:
        """The allowed tokens as llguidance's bitmask into ``words`` (uint32, (n_vocab + 31) // 32 of
        them, C-contiguous: the CUDA backend's pinned mask row of the sequence's slot)."""
        assert words.dtype == np.uint32 and words.size == self._mask.size and words.flags.c_contiguous
        self._m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """A copy of ``logits`` with every forbidden token at -inf."""
        out = np.array(logits, np.float32, copy=True)
        out[~self.allowed()] = -np.inf
        return out

    def advance(self, token: int) -> None:
        if not self._m.consume_token(int(token)):
            why = _first_line(self._m.get_error())
            hint = ("; the grammar is too costly to follow (a JSON schema whose required properties refer back to "
                    "it can never be completed): simplify it") if "Too many items" in why else ""
            raise GrammarError(f"the grammar engine refused token {token}: {why}{hint}")
