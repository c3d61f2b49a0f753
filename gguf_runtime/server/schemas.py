"""Request validation and response shapes for the Ollama and OpenAI APIs (no I/O here).

Every check raises :class:`ApiError` with an HTTP status and a one-line message; the routes turn
it into ``{"error": message}`` (Ollama) or ``{"error": {"message": ..., "type": ...}}`` (OpenAI).
Sampling defaults are the CLI's (llama.cpp's): temperature 0.8, top-k 40, top-p 0.95, min-p 0.05,
repeat penalty 1.0 (off); a request's fields override them.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import re
import time
from typing import Any, Callable

import numpy as np

from ..engine.constraint import compile_grammar
from ..format.chat_template import THINK_LEVELS, think_variables
from ..format.model_info import quant_histogram
from ..format.tool_calls import template_family
from ..sampling import MAX_TOP_LOGPROBS, SamplingParams


class ApiError(Exception):
    """A request's error: its HTTP status, message and (OpenAI's ``error.code``) code or None."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def bad(message: str) -> ApiError:
    return ApiError(400, message)


_SECOND: tuple[int, str] = (-1, "")  # (a second, its "YYYY-MM-DDTHH:MM:SS"): every stream chunk has a stamp


def now_rfc3339() -> str:
    """Now in UTC to the microsecond, "2026-11-27T04:01:01.123456Z" (the date part formatted once a
    second: a datetime's isoformat costs more than the rest of a streamed chunk)."""
    ns = time.time_ns()
    sec, us = divmod(ns // 1000, 1_000_000)
    global _SECOND
    cached = _SECOND
    if cached[0] != sec:
        cached = _SECOND = (sec, _dt.datetime.fromtimestamp(sec, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S"))
    return f"{cached[1]}.{us:06d}Z"


_DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|ms|s|m|h)")
_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


FOREVER_S = 100 * 365 * 86400.0  # keep_alive durations past a century are "for ever"


def keep_alive(v: Any, what: str = "keep_alive") -> float | None:
    """Ollama's keep_alive in seconds: a Go duration ("5m", "1h30m", "250ms", "-1s"), a number of
    seconds (also as a string), any negative value or one past FOREVER_S: for ever (inf; a date
    that far would not fit /api/ps's expires_at); absent or null: None (the server's default).
    Anything else is a 400 naming it."""
    if v is None:
        return None
    if isinstance(v, bool):
        raise bad(f"{what} must be a duration like \"5m\" or a number of seconds, not {json.dumps(v)}")
    if isinstance(v, (int, float)):
        secs = float(v)
    elif isinstance(v, str):
        t = v.strip()
        try:
            secs = float(t)
        except ValueError:
            sign = -1.0 if t.startswith("-") else 1.0
            body = t[1:] if t[:1] in ("+", "-") else t
            parts = _DURATION.findall(body)
            if not body or "".join(a + u for a, u in parts) != body:
                raise bad(f"{what} {json.dumps(v)[:60]} is not a duration: give e.g. \"5m\", \"1h\", \"30s\", 0 "
                          "(unload after the request) or -1 (keep loaded)") from None
            secs = sign * sum(float(a) * _UNIT[u] for a, u in parts)
    else:
        raise bad(f"{what} must be a duration like \"5m\" or a number of seconds")
    if secs != secs:
        raise bad(f"{what} is not a number")
    return math.inf if secs < 0 or secs > FOREVER_S else secs


def ns(seconds: float) -> int:
    return max(0, int(round(seconds * 1e9)))


# ---- fields ---------------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def get_str(d: dict, key: str, default: str | None = None) -> str | None:
    v = d.get(key, default)
    if v is not None and not isinstance(v, str):
        raise bad(f"{key} must be a string, got {type(v).__name__}")
    return v


def get_bool(d: dict, key: str, default: bool) -> bool:
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"{key} must be true or false, got {v!r}"[:200])
    return v


def get_number(d: dict, key: str) -> float | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(f"{key} must be a finite number, got {v!r}"[:200])
    return float(v)


def get_int(d: dict, key: str) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer() and abs(v) < 2**63:  # 8.0 from a JSON number
        v = int(v)
    if not _is_int(v):
        raise bad(f"{key} must be an integer, got {v!r}"[:200])
    return v


def get_budget(d: dict, key: str, ollama: bool) -> int | None:
    """Tokens to generate: None = up to the context. Ollama's -1 (no limit) and -2 (fill the
    context) mean None; other negatives are a 400; values past the context are clipped later."""
    v = get_int(d, key)
    if v is None:
        return None
    if v < 0:
        if ollama and v in (-1, -2):
            return None
        raise bad(f"{key} must be >= 0{' (or -1: no limit, -2: fill the context)' if ollama else ''}, got {v}")
    return v


def get_stop(v: Any, key: str = "stop") -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v) or len(v) > 16:
        raise bad(f"{key} must be a string or a list of up to 16 strings")
    return tuple(s for s in v if s)


def sampling(d: dict, seed_key: str = "seed") -> SamplingParams:
    p = SamplingParams()
    for key in ("temperature", "top_p", "min_p", "repeat_penalty"):
        v = get_number(d, key)
        if v is not None:
            setattr(p, key, v)
    for key in ("top_k", "repeat_last_n"):
        v = get_int(d, key)
        if v is not None:
            setattr(p, key, v)
    for key in ("presence_penalty", "frequency_penalty"):  # refused, never silently ignored (0: the default)
        v = get_number(d, key)
        if v:
            raise bad(f"{key} is not supported yet (only 0); use repeat_penalty with repeat_last_n instead, "
                      "which divides the logits of the last tokens' repeats")
    seed = get_int(d, seed_key)
    p.seed = seed if seed is not None and seed >= 0 else None  # Ollama: -1 = random
    if p.seed is not None:
        p.seed %= 2**63
    try:
        p.validate()
    except ValueError as e:
        raise bad(str(e)) from None
    return p


def structured_output(body: dict, ollama: bool) -> str | None:
    """The compiled grammar of a request's structured output, None for free text: Ollama's
    ``format`` ("json", or a JSON schema object), OpenAI's ``response_format`` ({"type": "text" |
    "json_object" | "json_schema", "json_schema": {"schema": ...}}). A schema the grammar engine
    cannot use is a 400 naming why (GrammarError)."""
    if ollama:
        f = body.get("format")
        if f is None or f == "":
            return None
        if f == "json":
            return compile_grammar("json", None)
        if isinstance(f, dict):
            return compile_grammar("json_schema", f)
        raise bad('format must be "json" or a JSON schema object')
    rf = body.get("response_format")
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return compile_grammar("json", None)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise bad("response_format.json_schema must be an object with a schema object")
        return compile_grammar("json_schema", js.get("schema", {}))
    raise bad('response_format.type must be "text", "json_object" or "json_schema"')


def think_kwargs(body: dict, ollama: bool) -> dict:
    """Template variables of a request's reasoning control: Ollama's ``think`` (true / false, or a
    level "low" / "medium" / "high"), OpenAI's ``reasoning_effort`` (a level). A level reaches the
    template as ``reasoning_effort`` (Harmony's "Reasoning: ..." line), a boolean as
    ``enable_thinking`` (Qwen3's switch): ``think`` as format.chat_template.think_variables maps it,
    the CLI's ``--think`` too; a template that reads neither ignores them. A Harmony model
    reasons whatever ``think`` says (gpt-oss cannot answer without its analysis channel; Ollama
    returns its thinking then too). No ``think`` leaves the template's default (Qwen3's: thinking
    on), and a thinking model's reasoning comes back apart from the answer either way."""
    if ollama:
        v = body.get("think")
        try:
            return think_variables(v)
        except ValueError:
            raise bad(f"invalid think value: {json.dumps(v)[:60]} (must be \"high\", \"medium\", \"low\", true, "
                      "or false)") from None
    v = body.get("reasoning_effort")
    if v is None:
        return {}
    if isinstance(v, str) and v in THINK_LEVELS:
        return {"reasoning_effort": v}
    raise bad(f'reasoning_effort must be "low", "medium" or "high", got {json.dumps(v)[:60]}')


# names chat_template_kwargs may not take: the variables a request sets through its own fields
# (messages, tools), and the rendering functions' own parameters (self)
_TEMPLATE_OWN = ("messages", "tools", "add_generation_prompt", "self")


def chat_template_kwargs(body: dict) -> dict:
    """OpenAI chat's ``chat_template_kwargs`` (llama-server's and vLLM's): variables for the
    template, such as ``{"enable_thinking": false}`` (Qwen3's switch); they override
    reasoning_effort's."""
    v = body.get("chat_template_kwargs")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad('chat_template_kwargs must be an object of template variables, such as {"enable_thinking": false}')
    own = next((k for k in _TEMPLATE_OWN if k in v), None)
    if own is not None:
        raise bad(f"chat_template_kwargs.{own} cannot be set: the request's messages and tools are the "
                  "template's, and a chat answer always has the generation prompt")
    return v


def logprobs(body: dict, api: str) -> int:
    """How many alternatives each generated token's log-probability comes with: -1 for none asked.
    ``api``: "chat" (OpenAI chat and Ollama: ``logprobs`` true/false, ``top_logprobs`` 0..20, which
    needs ``logprobs``) or "completions" (OpenAI's legacy ``logprobs``: a number of alternatives)."""
    if api == "completions":
        if body.get("top_logprobs") is not None:
            raise bad("/v1/completions takes logprobs: N (alternatives per token), not top_logprobs")
        if isinstance(body.get("logprobs"), bool):
            raise bad("logprobs on /v1/completions is a number of alternatives per token (0 to "
                      f"{MAX_TOP_LOGPROBS}), not true or false")
        k = get_int(body, "logprobs")
        if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
            raise bad(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {k}")
        return -1 if k is None else k
    on = get_bool(body, "logprobs", False)
    top = get_int(body, "top_logprobs")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top}")
    if top and not on:
        raise bad("top_logprobs needs logprobs: true")
    return (top or 0) if on else -1


def ollama_options(body: dict) -> tuple[SamplingParams, int | None, tuple[str, ...], int | None]:
    """(sampling, num_predict, stop, num_ctx): num_ctx is the request's context window (prompt and
    generation), None for the server's whole context (Scheduler.budget checks it against that)."""
    opts = body.get("options")
    if opts is None:
        opts = {}
    if not isinstance(opts, dict):
        raise bad("options must be an object")
    for key, noop in OLLAMA_UNSUPPORTED.items():
        v = get_number(opts, key)
        if v is not None and v != noop:
            raise bad(f"options.{key} is not supported (only {noop}); use temperature, top_k, top_p and min_p")
    num_ctx = get_int(opts, "num_ctx")
    if num_ctx is not None and num_ctx < 1:
        raise bad(f"options.num_ctx must be a positive number of tokens, got {num_ctx}")
    return (sampling(opts), get_budget(opts, "num_predict", ollama=True), get_stop(opts.get("stop"), "options.stop"),
            num_ctx)


MAX_CHOICES = 16  # OpenAI's n: choices one request may ask for


def openai_n(body: dict, stream: bool) -> int:
    """OpenAI's ``n`` (choices of one prompt): 1 to MAX_CHOICES, streamed or not."""
    n = get_int(body, "n")
    if n is None:
        return 1
    if not 1 <= n <= MAX_CHOICES:
        raise bad(f"n must be between 1 and {MAX_CHOICES}, got {n}")
    return n


# Ollama options that would change the answer and are not implemented, with their no-op values
# (what clients send by default passes; anything else is a 400, never silently ignored)
OLLAMA_UNSUPPORTED = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0}


def unsupported_generate(body: dict) -> None:
    """/api/generate fields that would change the answer and are not implemented: a 400 naming the
    field (empty values pass, as clients send them)."""
    if body.get("images") not in (None, []):
        raise bad("images: this model reads text only; send the prompt without images")
    if body.get("suffix") not in (None, ""):
        raise bad("suffix (text after the insertion point) is not supported yet: leave it unset")
    if body.get("template") not in (None, ""):
        raise bad("template (a prompt template of the request's own) is not supported: the model's template is "
                  "used; leave it unset, or send raw: true with the prompt already formatted")


def unsupported_openai(body: dict, api: str) -> None:
    """OpenAI fields that would change the answer and are not implemented (``api``: "chat" or
    "completions"): a 400 naming the field, never an answer that ignored it. Hints that change no
    answer (user, store, metadata, service_tier, prediction) pass."""
    if body.get("logit_bias") not in (None, {}):
        raise bad("logit_bias is not supported yet: leave it unset or empty")
    if api == "chat":
        if body.get("functions") is not None or body.get("function_call") is not None:
            raise bad("functions and function_call (deprecated) are not supported: send tools and tool_choice")
        mods = body.get("modalities")
        if body.get("audio") is not None or (isinstance(mods, list) and "audio" in mods):
            raise bad("audio output is not supported: this model writes text (leave audio unset, modalities [\"text\"])")
        return
    if body.get("echo") not in (None, False):
        raise bad("echo is not supported yet: leave it unset or false")
    if body.get("suffix") not in (None, ""):
        raise bad("suffix (text after the insertion point) is not supported yet: leave it unset")
    best_of, n = get_int(body, "best_of"), get_int(body, "n") or 1
    if best_of is not None and best_of != n and best_of > 1:
        raise bad(f"best_of is not supported (only equal to n, {n}): ask for n choices instead")


def openai_options(body: dict) -> tuple[SamplingParams, int | None, tuple[str, ...]]:
    temp = get_number(body, "temperature")
    if temp is not None and not 0 <= temp <= 2:
        raise bad(f"temperature must be between 0 and 2, got {temp}")
    budget = get_budget(body, "max_completion_tokens", ollama=False)
    if budget is None:
        budget = get_budget(body, "max_tokens", ollama=False)
    return sampling(body), budget, get_stop(body.get("stop"))


def messages(v: Any, extra: Callable[[dict, int], dict] | None = None) -> list[dict]:
    """Chat messages: a list of {role, content} (content a string, null, or OpenAI text parts);
    ``extra(message, i)`` adds checked fields of its own (tools.message_tool_fields)."""
    if not isinstance(v, list):
        raise bad("messages must be a list of {\"role\", \"content\"} objects")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string role")
        if m.get("images") not in (None, []):  # (Ollama's; the model would answer without them)
            raise bad(f"messages[{i}].images: this model reads text only; send the message without images")
        c = m.get("content")
        if isinstance(c, list):
            if not all(isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in c):
                raise bad(f"messages[{i}].content parts must be objects with a text field")
            other = next((p.get("type") for p in c if p.get("type", "text") != "text"), None)
            if other is not None:
                raise bad(f"messages[{i}].content has a part of type {json.dumps(other)[:40]}: this model reads text "
                          "only; send text parts")
            c = "".join(p.get("text", "") for p in c)
        elif c is not None and not isinstance(c, str):
            raise bad(f"messages[{i}].content must be a string")
        out.append({"role": m["role"], "content": c or "", **(extra(m, i) if extra else {})})
    return out


# ---- the model card ------------------------------------------------------------------------------
def _plain(v: Any) -> Any:
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # (JSON has no NaN or infinity: a file's nan would make /api/show a 500)
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return None  # arrays (tokens, merges ...) are left out, as Ollama does without verbose


def _size_label(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}" if unit == "B" else f"{n / div:.2f}{unit}".replace(".00", "")
    return str(n)


class ModelCard:
    """The loaded model as /api/tags, /api/show and /v1/models describe it."""

    def __init__(self, engine, name: str | None = None) -> None:
        self._fill(engine.path, engine.gguf, engine.template, engine.cfg.pooling_type, engine.n_ctx, name)

    @classmethod
    def from_file(cls, path: str, name: str, n_ctx: int | None = None) -> "ModelCard":
        """The card of a model not loaded, from its file's header (context: the server's, else the
        model's own); one line naming the file where it does not read."""
        from ..format.chat_template import ChatTemplate
        from ..format.gguf_file import open_gguf
        from ..format.model_config import config_from_gguf

        card = cls.__new__(cls)
        with open_gguf(path, check_data=False) as f:
            cfg = config_from_gguf(f)
            template = ChatTemplate(f.metadata.get("tokenizer.chat_template"))
            card._fill(path, f, template, cfg.pooling_type, min(n_ctx or cfg.n_ctx_train, cfg.n_ctx_train), name)
        return card

    def _fill(self, path: str, f, template, pooling_type: int | None, n_ctx: int, name: str | None) -> None:
        stem = os.path.splitext(os.path.basename(path))[0]
        base = (name or stem).strip()
        self.name = base if ":" in base else base + ":latest"
        self.aliases = {self.name.lower(), self.name.lower().removesuffix(":latest")}
        st = os.stat(path)
        self.size = st.st_size
        self.modified_at = _dt.datetime.fromtimestamp(st.st_mtime, _dt.timezone.utc).isoformat()
        h = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}:".encode())
        with open(path, "rb") as fh:
            h.update(fh.read(1 << 20))  # the header, not the whole file: quick at startup
        self.digest = h.hexdigest()
        meta = f.metadata
        arch = str(meta.get("general.architecture", "unknown"))
        hist = quant_histogram(f)
        self.n_params = sum(r.params for r in hist)
        try:
            import gguf

            quant = gguf.LlamaFileType(int(meta["general.file_type"])).name.removeprefix("MOSTLY_")
        except Exception:  # noqa: BLE001 - no or unknown file type: the largest tensor type
            quant = hist[0].type_name if hist else "unknown"
        self.details = {"parent_model": "", "format": "gguf", "family": arch, "families": [arch],
                        "parameter_size": _size_label(self.n_params), "quantization_level": quant}
        self.model_info = {k: _plain(v) for k, v in meta.items()}
        self.model_info["general.parameter_count"] = self.n_params
        self.template = template.source or ""
        # reasoning apart from the answer: Harmony's analysis channel, a thinking template's <think> block
        thinking = template_family(self.template) == "harmony" or template.supports_thinking
        self.capabilities = (["completion"] + (["tools"] if template.supports_tools else [])
                             + (["thinking"] if thinking else [])
                             + (["embedding"] if pooling_type is not None else []))  # an embedding model
        self.n_ctx = n_ctx
        self.path = path

    def matches(self, model: Any) -> bool:
        return isinstance(model, str) and model.strip().lower() in self.aliases

    def tag(self) -> dict:
        return {"name": self.name, "model": self.name, "modified_at": self.modified_at, "size": self.size,
                "digest": self.digest, "details": self.details}

    def show(self) -> dict:
        params = f"num_ctx                        {self.n_ctx}"
        return {"license": str(self.model_info.get("general.license") or ""),
                "modelfile": f"# Modelfile served by gguf-run\nFROM {self.path}\n"
                             + (f'TEMPLATE """{self.template}"""\n' if self.template else "")
                             + f"PARAMETER {params}\n",
                "parameters": params, "template": self.template, "details": self.details,
                "model_info": self.model_info, "capabilities": self.capabilities,
                "modified_at": self.modified_at}

    def openai(self) -> dict:
        created = int(_dt.datetime.fromisoformat(self.modified_at).timestamp())
        return {"id": self.name, "object": "model", "created": created, "owned_by": "library"}


# ---- responses -----------------------------------------------------------------------------------
def ollama_final(job, load_s: float) -> dict:
    """The figures of a finished job, in Ollama's final-chunk fields (nanoseconds). As Ollama fills
    them on a cache hit (llm/llama_server.go: prompt_eval_count = cache_n + prompt_n since 0.30):
    prompt_eval_count is the whole prompt, prompt_eval_cached_count the part the cache supplied
    (left out when none), prompt_eval_duration the time spent evaluating the rest."""
    t_first = job.t_first or job.t_end
    cached = max(0, len(job.prompt) - job.prompt_eval)
    return {"done": True, "done_reason": job.reason,
            "total_duration": ns(job.t_end - job.t_submit + load_s), "load_duration": ns(load_s),
            "prompt_eval_count": len(job.prompt), **({"prompt_eval_cached_count": cached} if cached else {}),
            "prompt_eval_duration": ns(t_first - job.t_admit),
            "eval_count": len(job.ids), "eval_duration": ns(job.t_end - t_first)}


def openai_usage(job) -> dict:
    """OpenAI's usage: prompt_tokens is the whole prompt, the part a cached prefix supplied in
    prompt_tokens_details.cached_tokens (as Ollama's prompt_eval_count and prompt_eval_cached_count)."""
    n_in, n_out = len(job.prompt), len(job.ids)
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out,
            "prompt_tokens_details": {"cached_tokens": max(0, n_in - job.prompt_eval)}}
