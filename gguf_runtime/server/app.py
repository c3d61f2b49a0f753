"""The HTTP side: Ollama's /api/* and OpenAI's /v1/* routes on Starlette (parsing, formatting), and
llama-server's /health, /tokenize, /detokenize and /apply-template.

Each route validates its body (``schemas``), names how to tokenize the prompt and which response
format to use (``formats``), and hands the rest to ``service.run_job`` (embeddings: ``embeddings``
parses, ``service.run_embed`` runs). Every error a request can cause becomes a JSON 4xx (a bug, a
JSON 500); the server keeps serving.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import json
import math
import logging
import time
from typing import Any, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from .. import __version__
from ..engine import embed as E
from ..engine.engine import check_text_fits
from ..errors import GGUFRunError
from . import embeddings as EM
from . import schemas as S
from . import tools as T
from .formats import FORMATS
from .guard import Guard, openai_shaped
from .service import (MAX_BODY, Service, error_response, prepare, read_json, run_choices, run_embed, run_job,
                      status_of)

__all__ = ["MAX_BODY", "Service", "build_app"]
log = logging.getLogger("gguf_runtime.server")


def _model(svc: Service, body: dict, key: str = "model") -> str:
    model = body.get(key)
    if model is None or model == "":
        raise S.bad("model is required")
    card = svc.find(model)
    if card is None:
        names = sorted(svc.cards)
        raise S.ApiError(404, f"model {json.dumps(model)[:200]} not found, try pulling it first (this server has "
                              f"{', '.join(names[:20])}{' ...' if len(names) > 20 else ''})", code="model_not_found")
    return card.name


def _ids(v: Any, n_vocab: int, key: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < n_vocab
                                          for t in v):
        raise S.bad(f"{key} must be a list of token ids below {n_vocab}")
    return v


def route(openai: bool):
    """Wrap a handler: any ApiError, user error or bug becomes a JSON error response."""

    def wrap(fn):
        async def handler(request: Request) -> Response:
            svc: Service = request.app.state.service
            try:
                return await fn(svc, request)
            except Exception as e:  # noqa: BLE001 - never let a request take the server down
                if status_of(e) >= 500 and not isinstance(e, GGUFRunError):
                    log.exception("request failed")
                return error_response(e, openai)

        return handler

    return wrap


# ---- Ollama ---------------------------------------------------------------------------------------
@route(openai=False)
async def api_generate(svc: Service, request: Request) -> Response:
    body = await read_json(request, svc.max_body)
    name = _model(svc, body)
    ka = S.keep_alive(body.get("keep_alive"))
    prompt, system = S.get_str(body, "prompt", ""), S.get_str(body, "system")
    S.unsupported_generate(body)
    _check_think(svc, body, name)
    if not prompt and not body.get("context"):  # Ollama: an empty prompt loads the model (keep_alive 0: unloads it)
        return await _load_or_unload(svc, name, ka, {"response": ""})
    async with svc.using(ka, name):
        return await _generate(svc, request, body, name, prompt, system)


def _check_think(svc: Service, body: dict, name: str) -> None:
    """Ollama's 400 for ``think`` on (true or a level) to a model that cannot think (its card has no
    "thinking" capability), worded as Ollama words it; an invalid value is think_kwargs' 400."""
    if S.think_kwargs(body, ollama=True).get("enable_thinking") and "thinking" not in svc.cards[name].capabilities:
        raise S.bad(f"{json.dumps(body.get('model'), ensure_ascii=False)} does not support thinking")


async def _load_or_unload(svc: Service, name: str, ka: float | None, reply: dict) -> Response:
    """Ollama's answer to a request with nothing to generate: the model loaded and kept for
    keep_alive, or with keep_alive 0 unloaded (once nothing else runs)."""
    if ka == 0:
        done = await asyncio.get_running_loop().run_in_executor(None, svc.unload, name)
        reason = "unload" if done else "load"
    else:
        async with svc.using(ka, name):
            reason = "load"
    return JSONResponse({"model": name, "created_at": S.now_rfc3339(), **reply, "done": True, "done_reason": reason})


async def _generate(svc: Service, request: Request, body: dict, name: str, prompt: str, system: str | None
                    ) -> Response:
    raw, stream = S.get_bool(body, "raw", False), S.get_bool(body, "stream", True)
    context = _ids(body["context"], svc.engine.tokenizer.n_vocab, "context") if body.get("context") else []
    params, requested, stop, num_ctx = S.ollama_options(body)
    grammar = S.structured_output(body, ollama=True)
    think = S.think_kwargs(body, ollama=True)
    eng = svc.engine

    answer = None if raw else T.generate_setup(eng)  # Harmony, thinking templates: thinking and response apart

    def encode() -> list[int]:
        if not context:
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            ids = eng.encode_raw(prompt) if raw else eng.encode_chat(msgs, **think)
        else:
            text = prompt if raw else eng.template.render([{"role": "user", "content": prompt}], **think)
            ids = context + eng.tokenizer.encode(text, add_special=False, parse_special=not raw)
        return ids if answer is None else answer.prompt(ids, eng.tokenizer, grammar is not None)

    parser, keep = (None, frozenset()) if answer is None else (answer.parser(), answer.keep)
    lp = S.logprobs(body, "chat")
    return await run_job(svc, request, FORMATS["generate"](name, parser).with_logprobs(eng.tokenizer, lp), encode,
                         params, requested, stop, stream, num_ctx, grammar, keep=keep, logprobs=lp)


def _chat_tools(svc: Service, body: dict, name: str, msgs: list[dict], grammar: str | None):
    """The request's tools (tools.setup), its template messages and its one grammar."""
    tools, msgs = T.setup(body, svc.engine, name, msgs)
    if tools.grammar is not None and grammar is not None:
        raise S.bad("a forced tool_choice and format / response_format both constrain the answer; give one")
    return tools, msgs, grammar or tools.grammar


@route(openai=False)
async def api_chat(svc: Service, request: Request) -> Response:
    body = await read_json(request, svc.max_body)
    name = _model(svc, body)
    ka = S.keep_alive(body.get("keep_alive"))
    msgs = S.messages(body.get("messages", []), T.message_tool_fields)
    _check_think(svc, body, name)
    if not msgs:
        return await _load_or_unload(svc, name, ka, {"message": {"role": "assistant", "content": ""}})
    async with svc.using(ka, name):
        return await _chat(svc, request, body, name, msgs)


async def _chat(svc: Service, request: Request, body: dict, name: str, msgs: list[dict]) -> Response:
    stream = S.get_bool(body, "stream", True)
    params, requested, stop, num_ctx = S.ollama_options(body)
    think = S.think_kwargs(body, ollama=True)
    tools, msgs, grammar = _chat_tools(svc, body, name, msgs, S.structured_output(body, ollama=True))
    lp, eng = S.logprobs(body, "chat"), svc.engine
    return await run_job(svc, request, FORMATS["chat"](name, tools.parser()).with_logprobs(eng.tokenizer, lp),
                         lambda: tools.prompt(eng.encode_chat(msgs, tools=tools.tools, **think), eng.tokenizer,
                                              grammar is not None), params, requested, stop,
                         stream, num_ctx, grammar, keep=tools.keep, logprobs=lp)


async def _off_loop(svc: Service, make: Callable[[], Response]) -> Response:
    """A response built on a helper thread: thousands of vectors take seconds to write as JSON, which
    the event loop (every stream's) must not wait for."""
    return await asyncio.get_running_loop().run_in_executor(svc.prep, make)


async def _embed(svc: Service, request: Request, inputs: list, truncate: bool,
                 n: int | None = None) -> tuple[list, int, float] | None:
    """(pooled vectors, not yet normalized; tokens evaluated; seconds) of the inputs, or None when the
    client left."""
    eng = svc.engine
    E.pooling_of(eng.cfg)  # a reranker: 400 before any work
    t0 = time.perf_counter()
    job = await run_embed(svc, request, EM.encoder(eng, inputs, n or eng.n_ctx, truncate))
    if job is None:
        return None
    return job.vectors, job.tokens, time.perf_counter() - t0


@route(openai=False)
async def api_embed(svc: Service, request: Request) -> Response:
    body = await read_json(request, svc.max_body)
    name = _model(svc, body)
    ka = S.keep_alive(body.get("keep_alive"))
    async with svc.using(ka, name):
        return await _api_embed(svc, request, body, name)


async def _api_embed(svc: Service, request: Request, body: dict, name: str) -> Response:
    inputs = EM.ollama_inputs(body)
    truncate = S.get_bool(body, "truncate", True)
    dims = EM.dimensions(body, svc.engine.cfg.n_embd)
    n = EM.limit(body, svc.engine.n_ctx)
    if not inputs:  # Ollama: no input just loads the model
        return JSONResponse({"model": name, "embeddings": []})
    got = await _embed(svc, request, inputs, truncate, n)
    if got is None:
        return Response(status_code=499)
    vecs, tokens, secs = got
    load = svc.take_load_s()
    return await _off_loop(svc, lambda: JSONResponse(
        {"model": name, "embeddings": [EM.floats(E.finish(v, dims)) for v in vecs],
         "total_duration": S.ns(secs + load), "load_duration": S.ns(load), "prompt_eval_count": tokens}))


@route(openai=False)
async def api_embeddings(svc: Service, request: Request) -> Response:
    """Ollama's legacy route: one prompt, {"embedding": [...]}; too long a prompt is a 400."""
    body = await read_json(request, svc.max_body)
    name = _model(svc, body)
    ka = S.keep_alive(body.get("keep_alive"))
    async with svc.using(ka, name):
        return await _api_embeddings(svc, request, body)


async def _api_embeddings(svc: Service, request: Request, body: dict) -> Response:
    prompt = S.get_str(body, "prompt", "")
    n = EM.limit(body, svc.engine.n_ctx)
    if not prompt:  # Ollama: an empty request loads the model
        return JSONResponse({"embedding": []})
    got = await _embed(svc, request, [prompt], False, n)
    if got is None:
        return Response(status_code=499)
    svc.take_load_s()
    return JSONResponse({"embedding": EM.floats(E.finish(got[0][0]))})


@route(openai=False)
async def api_tags(svc: Service, request: Request) -> Response:
    return JSONResponse({"models": [c.tag() for c in svc.cards.values()]})


@route(openai=False)
async def api_show(svc: Service, request: Request) -> Response:
    body = await read_json(request, svc.max_body)
    name = _model(svc, body, "model" if body.get("model") else "name")
    return JSONResponse(svc.cards[name].show())


@route(openai=False)
async def api_ps(svc: Service, request: Request) -> Response:
    eng = svc.engine
    if eng is None:  # (unloaded, or loading)
        return JSONResponse({"models": []})
    card = svc.card
    left = svc.expires_in()
    expires = (_dt.datetime.now(_dt.timezone.utc) + _dt.timedelta(seconds=left) if left != math.inf
               else _dt.datetime(2318, 1, 1, tzinfo=_dt.timezone.utc))  # (Ollama's "Forever")
    return JSONResponse({"models": [{**card.tag(), "expires_at": expires.isoformat().replace("+00:00", "Z"),
                                     "size_vram": card.size if eng.backend.name == "cuda" else 0,
                                     "context_length": card.n_ctx}]})


@route(openai=False)
async def api_version(svc: Service, request: Request) -> Response:
    return JSONResponse({"version": __version__})


@route(openai=False)
async def api_scheduler(svc: Service, request: Request) -> Response:
    """Not Ollama's: the scheduler's counters (active, waiting, free slots and KV pages)."""
    sched, eng = svc.scheduler, svc.engine
    if sched is None or eng is None:  # (unloaded, or loading)
        return JSONResponse({"backend": None, "loaded": False, "active": 0, "waiting": 0, "pending": 0})
    return JSONResponse({"backend": eng.backend.name, "loaded": True, **sched.stats()})


# ---- OpenAI ---------------------------------------------------------------------------------------
def _openai_common(svc: Service, body: dict):
    name = _model(svc, body)
    params, requested, stop = S.openai_options(body)
    stream = S.get_bool(body, "stream", False)
    so = body.get("stream_options") or {}
    if not isinstance(so, dict):
        raise S.bad("stream_options must be an object")
    return name, params, requested, stop, stream, S.get_bool(so, "include_usage", False), S.openai_n(body, stream)


@route(openai=True)
async def v1_chat(svc: Service, request: Request) -> Response:
    body = await read_json(request, svc.max_body)
    async with svc.using(None, _model(svc, body)):
        return await _v1_chat(svc, request, body)


async def _v1_chat(svc: Service, request: Request, body: dict) -> Response:
    S.unsupported_openai(body, "chat")
    name, params, requested, stop, stream, usage, n = _openai_common(svc, body)
    msgs = S.messages(body.get("messages"), T.message_tool_fields)
    if not msgs:
        raise S.bad("messages must not be empty")
    think = {**S.think_kwargs(body, ollama=False), **S.chat_template_kwargs(body)}
    tools, msgs, grammar = _chat_tools(svc, body, name, msgs, S.structured_output(body, ollama=False))
    lp, tok = S.logprobs(body, "chat"), svc.engine.tokenizer
    encode = lambda: tools.prompt(svc.engine.encode_chat(msgs, tools=tools.tools, **think), tok,  # noqa: E731
                                  grammar is not None)
    make = lambda: FORMATS["chat.completion"](name, usage, tools.parser()).with_logprobs(tok, lp)  # noqa: E731
    if n > 1:
        return await run_choices(svc, request, make, lambda: [encode()], params, requested, stop, n, grammar=grammar,
                                 keep=tools.keep, stream=stream, logprobs=lp)
    return await run_job(svc, request, make(), encode, params, requested, stop, stream, grammar=grammar,
                         keep=tools.keep, logprobs=lp)


@route(openai=True)
async def v1_completions(svc: Service, request: Request) -> Response:
    body = await read_json(request, svc.max_body)
    async with svc.using(None, _model(svc, body)):
        return await _v1_completions(svc, request, body)


async def _v1_completions(svc: Service, request: Request, body: dict) -> Response:
    S.unsupported_openai(body, "completions")
    name, params, requested, stop, stream, usage, n = _openai_common(svc, body)
    prompt = body.get("prompt")
    eng = svc.engine
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        many = prompt  # several prompts: strings or lists of token ids, a choice (or n) each
    elif isinstance(prompt, list) or (isinstance(prompt, str) and prompt):
        many = [prompt]
    else:
        raise S.bad("prompt must be a non-empty string, a list of token ids, or a list of those")
    if len(many) > S.MAX_CHOICES:
        raise S.bad(f"prompt holds {len(many)} prompts: send at most {S.MAX_CHOICES} a request")
    parts = []
    for k, p in enumerate(many):
        where = "prompt" if len(many) == 1 else f"prompt[{k}]"
        if isinstance(p, list):
            ids = _ids(p, eng.tokenizer.n_vocab, where)
            parts.append(lambda ids=ids: list(ids))
        elif isinstance(p, str) and p:
            parts.append(lambda p=p: eng.encode_raw(p))
        else:
            raise S.bad(f"{where} must be a non-empty string or a list of token ids")
    encode = parts[0]
    grammar = S.structured_output(body, ollama=False)
    lp = S.logprobs(body, "completions")
    make = lambda: FORMATS["text_completion"](name, usage).with_logprobs(eng.tokenizer, lp)  # noqa: E731
    if n > 1 or len(parts) > 1:
        if n * len(parts) > S.MAX_CHOICES:
            raise S.bad(f"{len(parts)} prompts x n={n} is {n * len(parts)} choices: ask for at most {S.MAX_CHOICES}")
        return await run_choices(svc, request, make, lambda: [f() for f in parts], params, requested, stop, n,
                                 grammar=grammar, stream=stream, logprobs=lp)
    return await run_job(svc, request, make(), encode, params, requested, stop, stream, grammar=grammar, logprobs=lp)


@route(openai=True)
async def v1_embeddings(svc: Service, request: Request) -> Response:
    body = await read_json(request, svc.max_body)
    async with svc.using(None, _model(svc, body)):
        return await _v1_embeddings(svc, request, body)


async def _v1_embeddings(svc: Service, request: Request, body: dict) -> Response:
    name = _model(svc, body)
    inputs = EM.openai_inputs(body)
    dims = EM.dimensions(body, svc.engine.cfg.n_embd)
    fmt = EM.encoding_format(body)
    got = await _embed(svc, request, inputs, True)
    if got is None:
        return Response(status_code=499)
    vecs, tokens, _ = got
    svc.take_load_s()
    enc = EM.base64_f32 if fmt == "base64" else EM.floats
    return await _off_loop(svc, lambda: JSONResponse(
        {"object": "list", "model": name,
         "data": [{"object": "embedding", "index": i, "embedding": enc(E.finish(v, dims))} for i, v in enumerate(vecs)],
         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}))


@route(openai=True)
async def v1_models(svc: Service, request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [c.openai() for c in svc.cards.values()]})


@route(openai=True)
async def v1_model(svc: Service, request: Request) -> Response:
    name = _model(svc, {"model": request.path_params["model"]})
    return JSONResponse(svc.cards[name].openai())


# ---- llama-server ---------------------------------------------------------------------------------
# llama.cpp's llama-server routes that health checks, token counters and front ends call, in its
# request and response shapes; their errors in OpenAI's shape, as /v1/*'s. The text routes load no
# model: a model not loaded lends its tokenizer and template from its file's header.
LOADING = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}  # llama-server's


def llama_route(fn):
    """route(openai=True), with llama-server's 503 while the server is in its initial load (a later
    load, of a model a request names, is not one: the server answers meanwhile)."""

    async def after_load(svc: Service, request: Request) -> Response:
        if svc.loading:
            return JSONResponse(LOADING, status_code=503)
        return await fn(svc, request)

    return route(openai=True)(after_load)


@llama_route
async def health(svc: Service, request: Request) -> Response:
    return JSONResponse({"status": "ok"})


def _named(svc: Service, body: dict) -> str:
    """The model a llama-server request names (llama-server serves one and takes no name); none
    named: the one loaded, else the one serve started with."""
    if body.get("model") in (None, ""):
        return svc.current if svc.engine is not None else next(iter(svc.cards))
    return _model(svc, body)


async def _vocab(svc: Service, name: str) -> Any:
    """The model's tokenizer and template (Service.vocab), a header read on a prep thread."""
    v = svc.vocab(name, read=False)
    return v if v is not None else await asyncio.get_running_loop().run_in_executor(svc.prep, svc.vocab, name)


def _piece(b: bytes) -> str | list[int]:
    """A token's text as llama-server's with_pieces gives it: its byte values where they are not
    UTF-8 on their own (a character split across tokens)."""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return list(b)


@llama_route
async def tokenize(svc: Service, request: Request) -> Response:
    """{"tokens": [ids]} of ``content`` (with_pieces: [{"id", "piece"}]); llama-server's defaults: no
    BOS / EOS (add_special), special tokens' text parsed as them (parse_special)."""
    body = await read_json(request, svc.max_body)
    name = _named(svc, body)
    content = body.get("content")
    if not isinstance(content, str):
        raise S.bad("content must be a string: the text to tokenize")
    add_special = S.get_bool(body, "add_special", False)
    parse_special = S.get_bool(body, "parse_special", True)
    pieces = S.get_bool(body, "with_pieces", False)
    tok = (await _vocab(svc, name)).tokenizer
    check_text_fits(content, tok, svc.cards[name].n_ctx, "content")

    def answer() -> Response:
        ids = tok.encode(content, add_special=add_special, parse_special=parse_special)
        return JSONResponse({"tokens": [{"id": t, "piece": _piece(tok.token_to_bytes(t))} for t in ids]
                             if pieces else ids})

    return await prepare(svc, request, answer)


@llama_route
async def detokenize(svc: Service, request: Request) -> Response:
    """{"content": the tokens' text}: their pieces joined, special tokens' text included and no
    leading space dropped, as llama-server does (bytes that are not UTF-8 become U+FFFD)."""
    body = await read_json(request, svc.max_body)
    name = _named(svc, body)
    ids = body.get("tokens")
    if not isinstance(ids, list):
        raise S.bad("tokens must be a list of token ids")
    n_ctx = svc.cards[name].n_ctx
    if len(ids) > n_ctx:  # (a context's worth at most, as prompts are: a token's text can be many times its id's)
        raise S.bad(f"tokens holds {len(ids)} ids, more than the context of {n_ctx}; send at most that many")
    tok = (await _vocab(svc, name)).tokenizer
    n = tok.n_vocab
    for k, t in enumerate(ids):
        if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < n):
            raise S.bad(f"tokens[{k}] is {json.dumps(t)[:40]}, not a token id of {name} (0 to {n - 1})")
    return await prepare(svc, request, lambda: JSONResponse(
        {"content": b"".join(map(tok.token_to_bytes, ids)).decode("utf-8", "replace")}))


@llama_route
async def apply_template(svc: Service, request: Request) -> Response:
    """{"prompt": the chat's prompt text}, rendered as /v1/chat/completions renders it (messages,
    tools, reasoning_effort, chat_template_kwargs), generation prompt added; less the BOS (EOS) text
    the template wrote where the tokenizer adds its own, as llama.cpp gives it."""
    body = await read_json(request, svc.max_body)
    name = _named(svc, body)
    msgs = S.messages(body.get("messages"), T.message_tool_fields)
    if not msgs:
        raise S.bad("messages must not be empty")
    think = {**S.think_kwargs(body, ollama=False), **S.chat_template_kwargs(body)}
    v = await _vocab(svc, name)
    tools, msgs = T.setup(body, v, name, msgs)
    extra = {**think, **({"tools": list(tools.tools)} if tools.tools else {})}
    tok, tpl = v.tokenizer, v.template

    def answer() -> Response:
        text = tpl.render(msgs, add_generation_prompt=True, **extra)
        if tok.add_bos and tpl.bos_token and text.startswith(tpl.bos_token):
            text = text[len(tpl.bos_token):]
        if tok.add_eos and tpl.eos_token and text.endswith(tpl.eos_token):
            text = text[:-len(tpl.eos_token)]
        return JSONResponse({"prompt": text})

    return await prepare(svc, request, answer)


async def root(request: Request) -> Response:
    return PlainTextResponse("Ollama is running")


async def _http_error(request: Request, exc: HTTPException) -> Response:
    e = S.ApiError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}")
    return error_response(e, openai_shaped(request.url.path))


def build_app(service: Service, check_host: bool = False, allow_origins: tuple[str, ...] = ()) -> Any:
    """The ASGI app: routes behind the Host/Origin guard (guard.py). ``check_host``: the server is
    bound to a loopback address (serve sets it from --host)."""
    routes = [
        Route("/", root, methods=["GET", "HEAD"]),
        Route("/api/generate", api_generate, methods=["POST"]),
        Route("/api/chat", api_chat, methods=["POST"]),
        Route("/api/embed", api_embed, methods=["POST"]),
        Route("/api/embeddings", api_embeddings, methods=["POST"]),
        Route("/api/tags", api_tags, methods=["GET"]),
        Route("/api/show", api_show, methods=["POST"]),
        Route("/api/ps", api_ps, methods=["GET"]),
        Route("/api/version", api_version, methods=["GET"]),
        Route("/api/scheduler", api_scheduler, methods=["GET"]),
        Route("/v1/chat/completions", v1_chat, methods=["POST"]),
        Route("/v1/completions", v1_completions, methods=["POST"]),
        Route("/v1/embeddings", v1_embeddings, methods=["POST"]),
        Route("/v1/models", v1_models, methods=["GET"]),
        Route("/v1/models/{model:path}", v1_model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/health", health, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/apply-template", apply_template, methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.state.service = service
    return Guard(app, check_host, allow_origins)
