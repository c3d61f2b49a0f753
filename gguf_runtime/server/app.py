"""The HTTP side: Ollama's /api/* and OpenAI's /v1/* routes on Starlette (parsing, formatting).

Handlers run on the event loop. A request is validated, its prompt rendered and tokenized on one
helper thread (off the loop and off the model's thread), then submitted to the scheduler as a
job whose events come back through ``loop.call_soon_threadsafe`` into an ``asyncio.Queue``. The
response starts when the first event arrives, so an error at admission still gets its 4xx/5xx
status; a client that disconnects (while waiting or while streaming) cancels its job, which frees
its slot and KV pages at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .. import __version__
from ..errors import GGUFRunError
from . import schemas as S
from .formats import FORMATS
from .scheduler import Job, Scheduler, ServerBusy, ShuttingDown

log = logging.getLogger("gguf_runtime.server")
MAX_BODY = 1 << 20


class Service:
    """The scheduler, the model's card and the request limits, shared by every route."""

    def __init__(self, factory: Callable[[], Any], name: str | None = None, max_body: int = MAX_BODY,
                 max_queue: int = 1024, admit_tokens: int = 4096) -> None:
        self.scheduler = Scheduler(factory, admit_tokens=admit_tokens, max_queue=max_queue)
        self.name, self.max_body = name, max_body
        self.prep = ThreadPoolExecutor(1, thread_name_prefix="gguf-prep")

    def start(self) -> "Service":
        adapter = self.scheduler.start()
        self.engine = adapter.engine
        self.card = S.ModelCard(self.engine, self.name)
        self._load_s = self.engine.load_s
        return self

    def take_load_s(self) -> float:
        """The model's load time, reported once (in the first response), as Ollama does."""
        v, self._load_s = self._load_s, 0.0
        return v

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self.prep.shutdown(wait=False, cancel_futures=True)


# ---- errors and bodies ----------------------------------------------------------------------------
def _status(e: BaseException) -> int:
    if isinstance(e, S.ApiError):
        return e.status
    if isinstance(e, (ServerBusy, ShuttingDown)):
        return 503
    return 400 if isinstance(e, GGUFRunError) else 500


def error_response(e: BaseException, openai: bool) -> JSONResponse:
    status = _status(e)
    msg = str(e) if status < 500 or isinstance(e, GGUFRunError) else f"internal error: {type(e).__name__}: {e}"
    if not openai:
        return JSONResponse({"error": msg}, status_code=status)
    kind = {404: "not_found_error", 413: "invalid_request_error"}.get(status, "invalid_request_error"
                                                                      if status < 500 else "server_error")
    return JSONResponse({"error": {"message": msg, "type": kind, "param": None,
                                   "code": "model_not_found" if status == 404 else None}}, status_code=status)


async def read_json(request: Request, limit: int) -> dict:
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > limit:
        raise S.ApiError(413, f"the request body is {size} bytes; the limit is {limit} (--max-body)")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise S.ApiError(413, f"the request body is over the limit of {limit} bytes (--max-body)")
    try:
        body = json.loads(bytes(buf) or b"null")
    except (ValueError, RecursionError) as e:
        raise S.bad(f"invalid JSON in the request body: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise S.bad("the request body must be a JSON object")
    return body


def _model(svc: Service, body: dict, key: str = "model") -> str:
    model = body.get(key)
    if model is None or model == "":
        raise S.bad("model is required")
    if not svc.card.matches(model):
        raise S.ApiError(404, f"model {json.dumps(model)[:200]} not found, try pulling it first")
    return svc.card.name


def _ids(v: Any, n_vocab: int, key: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < n_vocab
                                          for t in v):
        raise S.bad(f"{key} must be a list of token ids below {n_vocab}")
    return v


# ---- running a job --------------------------------------------------------------------------------
async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _Stream(StreamingResponse):
    """A streaming response that always watches for the client leaving (any ASGI spec version),
    and always closes its body iterator and calls ``on_close`` (which cancels the job if it runs)."""

    def __init__(self, content, on_close: Callable[[], None], **kw) -> None:
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def run() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(run)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()
            self.on_close()


async def run_job(svc: Service, request: Request, fmt, encode: Callable[[], list[int]],
                  params, requested: int | None, stop: tuple[str, ...], stream: bool) -> Response:
    t0 = time.perf_counter()
    loop = asyncio.get_running_loop()
    ids = await loop.run_in_executor(svc.prep, encode)
    sched = svc.scheduler
    max_new = sched.budget(len(ids), requested)
    q: asyncio.Queue = asyncio.Queue()
    job = Job(ids, params, max_new, lambda kind, data: loop.call_soon_threadsafe(q.put_nowait, (kind, data)),
              stop, t_submit=t0)
    sched.submit(job)
    finished = False
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        parts: list[str] = []
        while True:
            get = asyncio.ensure_future(q.get())
            await asyncio.wait({get, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                return Response(status_code=499)  # the client is gone (nobody reads this)
            kind, data = first = get.result()
            if kind == "error":
                finished = True
                raise data
            finished = kind == "done"
            if stream:
                finished = True  # the stream's body owns the job from here
                break
            if finished:
                return JSONResponse(fmt.whole("".join(parts), data, svc.take_load_s()))
            parts.append(data)
    finally:
        watch.cancel()
        if not finished:
            sched.cancel(job)

    async def body():
        done = False
        kind, data = first
        try:
            while True:
                if kind == "text":
                    yield fmt.chunk(data)
                else:
                    done = True
                    yield (fmt.final(data, svc.take_load_s()) if kind == "done"
                           else fmt.error(str(data), _status(data)))
                    return
                kind, data = await q.get()
        finally:
            if not done:
                sched.cancel(job)

    def close() -> None:
        if job.state in ("new", "waiting", "active"):  # read across threads: a stale value only
            sched.cancel(job)  # costs a no-op cancel

    return _Stream(body(), close, media_type=fmt.media_type, headers={"Cache-Control": "no-cache"})


def route(openai: bool):
    """Wrap a handler: any ApiError, user error or bug becomes a JSON error response."""

    def wrap(fn):
        async def handler(request: Request) -> Response:
            svc: Service = request.app.state.service
            try:
                return await fn(svc, request)
            except Exception as e:  # noqa: BLE001 - never let a request take the server down
                if _status(e) >= 500 and not isinstance(e, GGUFRunError):
                    log.exception("request failed")
                return error_response(e, openai)

        return handler

    return wrap


# ---- Ollama ---------------------------------------------------------------------------------------
@route(openai=False)
async def api_generate(svc: Service, request: Request) -> Response:
    body = await read_json(request, svc.max_body)
    name = _model(svc, body)
    prompt, system = S.get_str(body, "prompt", ""), S.get_str(body, "system")
    raw, stream = S.get_bool(body, "raw", False), S.get_bool(body, "stream", True)
    context = _ids(body["context"], svc.engine.tokenizer.n_vocab, "context") if body.get("context") else []
    params, requested, stop = S.ollama_options(body)
    if not prompt and not context:  # Ollama: an empty prompt just loads the model
        return JSONResponse({"model": name, "created_at": S.now_rfc3339(), "response": "", "done": True,
                             "done_reason": "load"})
    eng = svc.engine

    def encode() -> list[int]:
        if not context:
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            return eng.encode_raw(prompt) if raw else eng.encode_chat(msgs)
        text = prompt if raw else eng.template.render([{"role": "user", "content": prompt}])
        return context + eng.tokenizer.encode(text, add_special=False, parse_special=not raw)

    return await run_job(svc, request, FORMATS["generate"](name), encode, params, requested, stop, stream)


@route(openai=False)
async def api_chat(svc: Service, request: Request) -> Response:
    body = await read_json(request, svc.max_body)
    name = _model(svc, body)
    msgs = S.messages(body.get("messages", []))
    stream = S.get_bool(body, "stream", True)
    params, requested, stop = S.ollama_options(body)
    if not msgs:
        return JSONResponse({"model": name, "created_at": S.now_rfc3339(),
                             "message": {"role": "assistant", "content": ""}, "done": True, "done_reason": "load"})
    return await run_job(svc, request, FORMATS["chat"](name), lambda: svc.engine.encode_chat(msgs), params,
                         requested, stop, stream)


@route(openai=False)
async def api_tags(svc: Service, request: Request) -> Response:
    return JSONResponse({"models": [svc.card.tag()]})


@route(openai=False)
async def api_show(svc: Service, request: Request) -> Response:
    body = await read_json(request, svc.max_body)
    _model(svc, body, "model" if body.get("model") else "name")
    return JSONResponse(svc.card.show())


@route(openai=False)
async def api_ps(svc: Service, request: Request) -> Response:
    card = svc.card
    return JSONResponse({"models": [{**card.tag(), "expires_at": "0001-01-01T00:00:00Z", "size_vram":
                                     card.size if svc.engine.backend.name == "cuda" else 0,
                                     "context_length": card.n_ctx}]})


@route(openai=False)
async def api_version(svc: Service, request: Request) -> Response:
    return JSONResponse({"version": __version__})


@route(openai=False)
async def api_scheduler(svc: Service, request: Request) -> Response:
    """Not Ollama's: the scheduler's counters (active, waiting, free slots and KV pages)."""
    return JSONResponse({"backend": svc.engine.backend.name, **svc.scheduler.stats()})


# ---- OpenAI ---------------------------------------------------------------------------------------
def _openai_common(svc: Service, body: dict):
    name = _model(svc, body)
    params, requested, stop = S.openai_options(body)
    stream = S.get_bool(body, "stream", False)
    so = body.get("stream_options") or {}
    if not isinstance(so, dict):
        raise S.bad("stream_options must be an object")
    return name, params, requested, stop, stream, S.get_bool(so, "include_usage", False)


@route(openai=True)
async def v1_chat(svc: Service, request: Request) -> Response:
    body = await read_json(request, svc.max_body)
    name, params, requested, stop, stream, usage = _openai_common(svc, body)
    msgs = S.messages(body.get("messages"))
    if not msgs:
        raise S.bad("messages must not be empty")
    fmt = FORMATS["chat.completion"](name, usage)
    return await run_job(svc, request, fmt, lambda: svc.engine.encode_chat(msgs), params, requested, stop, stream)


@route(openai=True)
async def v1_completions(svc: Service, request: Request) -> Response:
    body = await read_json(request, svc.max_body)
    name, params, requested, stop, stream, usage = _openai_common(svc, body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    eng = svc.engine
    if isinstance(prompt, list):
        ids = _ids(prompt, eng.tokenizer.n_vocab, "prompt")
        encode = lambda: list(ids)  # noqa: E731
    elif isinstance(prompt, str) and prompt:
        encode = lambda: eng.encode_raw(prompt)  # noqa: E731
    else:
        raise S.bad("prompt must be a non-empty string (or one string, or a list of token ids)")
    fmt = FORMATS["text_completion"](name, usage)
    return await run_job(svc, request, fmt, encode, params, requested, stop, stream)


@route(openai=True)
async def v1_models(svc: Service, request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [svc.card.openai()]})


@route(openai=True)
async def v1_model(svc: Service, request: Request) -> Response:
    _model(svc, {"model": request.path_params["model"]})
    return JSONResponse(svc.card.openai())


async def root(request: Request) -> Response:
    return PlainTextResponse("Ollama is running")


async def _http_error(request: Request, exc: HTTPException) -> Response:
    e = S.ApiError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}")
    return error_response(e, request.url.path.startswith("/v1/"))


def build_app(service: Service) -> Starlette:
    routes = [
        Route("/", root, methods=["GET", "HEAD"]),
        Route("/api/generate", api_generate, methods=["POST"]),
        Route("/api/chat", api_chat, methods=["POST"]),
        Route("/api/tags", api_tags, methods=["GET"]),
        Route("/api/show", api_show, methods=["POST"]),
        Route("/api/ps", api_ps, methods=["GET"]),
        Route("/api/version", api_version, methods=["GET"]),
        Route("/api/scheduler", api_scheduler, methods=["GET"]),
        Route("/v1/chat/completions", v1_chat, methods=["POST"]),
        Route("/v1/completions", v1_completions, methods=["POST"]),
        Route("/v1/models", v1_models, methods=["GET"]),
        Route("/v1/models/{model:path}", v1_model, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.state.service = service
    return app
