"""The service behind the routes: the scheduler, the model's card, the limits, and running one
job for one HTTP request (disconnect watching, streaming, errors as JSON).

A request's prompt is rendered and tokenized on a few helper threads (off the event loop and off
the model's thread; several, so one slow prompt cannot hold up the others), then submitted to the
scheduler; its events come back through a mailbox (one
``call_soon_threadsafe`` per batch of events) into the request's event queue (``_Events``). The response
starts when the first event arrives, so an error at admission still gets its 4xx/5xx status; a
client that disconnects, while waiting or while streaming, cancels its job (its slot and KV pages
are free at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import math
import os
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..errors import GGUFRunError, printable
from ..format.chat_template import ChatTemplate
from ..format.gguf_file import open_gguf
from ..format.tokenizer import Tokenizer
from . import schemas as S
from .scheduler import EmbedJob, Job, Scheduler, ServerBusy, ShuttingDown

log = logging.getLogger("gguf_runtime.server")

MAX_BODY = 1 << 20


class _Mailbox:
    """Events from the scheduler's thread into the loop's queues, with one wake-up per batch
    (``call_soon_threadsafe`` writes to a pipe; 64 streams would cost 64 writes a step)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.items, self.lock, self.armed = loop, [], threading.Lock(), False

    def put(self, q: _Events, item: tuple) -> None:
        with self.lock:
            self.items.append((q, item))
            if self.armed:
                return
            self.armed = True
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self.lock:
            items, self.items, self.armed = self.items, [], False
        for q, item in items:
            q.put_nowait(item)


def exit_process(e: BaseException) -> None:
    """The scheduler loop died: say why in one line and end the process (exit 70), so no server stays
    up that answers /api/version but generates nothing."""
    print(f"error: the scheduler stopped ({type(e).__name__}: {printable(str(e))[:300]}); the server exits",
          file=sys.stderr, flush=True)
    os._exit(70)


PREP_THREADS = 4  # prompts rendered and tokenized at once (templates stop at 2 s; a 1 MB word takes seconds)
# A request body of at most this many bytes is rendered and tokenized on the event loop: the hop to
# a prep thread and back costs more than the work (bench/RESULTS.md row 145). Once such a render
# takes longer than INLINE_PREP_MAX_S (a template slow on small input; a normal one stays far
# below it, its cold first render too), every prompt goes to the prep threads from then on, so a
# slow template can hold the event loop at most once.
INLINE_PREP_BYTES = 8192
INLINE_PREP_MAX_S = 0.1
# The GIL's switch interval while serving (Python's default is 5 ms). The scheduler thread gives the
# GIL up at each numpy or CUDA call, and while a long prompt is tokenized it waits up to the interval
# to have it back, every time (bench/RESULTS.md row 136).
SWITCH_INTERVAL_S = 0.001
# A stream writes at most once per this interval while its request runs (the first chunk and the
# last go at once): the tokens meanwhile go out together, one write and one socket send instead of
# one a token, which at many streams of a small model bounds the event loop's work; the interval
# is below what a reader sees (bench/RESULTS.md row 139).
STREAM_INTERVAL_S = 0.01
# Vocabularies read from the headers of models not loaded (/tokenize and the like naming one), kept
# for the next request: the most recent few, as a large vocabulary holds a lot of memory.
VOCABS_KEPT = 2


@dataclasses.dataclass(frozen=True)
class Vocab:
    """A model's tokenizer and chat template (what the text-only routes need of an engine)."""

    tokenizer: Tokenizer
    template: ChatTemplate


class Service:
    """The scheduler, the models' cards and the request limits, shared by every route.

    One model is loaded at a time: the one ``factory`` loads at start, or one of ``catalog``
    ((name, path) pairs: a --models folder, the Ollama store) that ``loader(path)`` loads when a
    request names it; the one loaded is unloaded first (where the new file opens whole: one that
    does not is the request's 400, the loaded model kept), once its requests are done (requests for
    it that arrive meanwhile wait their turn). A model stays loaded for ``keep_alive`` seconds (inf:
    for ever; Ollama's keep_alive, the last request's or the server's default) after the last
    request ends; then a watchdog thread unloads it (scheduler stopped, GPU memory returned) and
    the next request loads it again, as Ollama does. Routes that need a model run inside ``using``.

    ``path``, where given, is the file ``factory`` loads: its card, read from the header (context
    ``n_ctx``, as ModelCard.from_file), lists the model while start() loads it on another thread
    (the server answering meanwhile); requests for it wait for the load, and end with its error
    where it fails."""

    def __init__(self, factory: Callable[[], Any], name: str | None = None, max_body: int = MAX_BODY,
                 max_queue: int = 1024, admit_tokens: int = 4096,
                 on_fatal: Callable[[BaseException], None] | None = exit_process,
                 keep_alive: float = math.inf, catalog: Sequence[tuple[str, str]] = (),
                 loader: Callable[[str], Any] | None = None, stream_interval: float = STREAM_INTERVAL_S,
                 path: str | None = None, n_ctx: int | None = None) -> None:
        self._sched = lambda f: Scheduler(f, admit_tokens=admit_tokens, max_queue=max_queue, on_fatal=on_fatal)
        self.max_queue = max_queue  # ... and the most requests waiting for a model to load (using)
        self._waiting = 0
        self._factory, self._loader, self._catalog = factory, loader, list(catalog)
        self.scheduler: Scheduler | None = self._sched(factory)
        self.engine: Any = None
        self.name, self.max_body = name, max_body
        self.prep = ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="gguf-prep")
        self._mail: dict[asyncio.AbstractEventLoop, _Mailbox] = {}
        self.keep_default = self.keep = keep_alive
        self.stream_interval = stream_interval  # seconds
        self._lock = threading.Lock()  # holds, keep, last_busy, current, wanted, scheduler (swaps)
        self._load_lock = threading.Lock()  # one load or unload at a time
        self._holds = 0  # requests inside ``using``
        self._last_busy = time.monotonic()
        self._closed = False
        self.inline_prep = True  # small prompts prepared on the event loop (see INLINE_PREP_BYTES)
        self.cards: dict[str, S.ModelCard] = {}  # by name: the loaded model's, and header-only ones
        self.current = ""  # the name of the model the scheduler serves (or last served)
        self._wanted: str | None = None  # a model requests wait to swap to
        self._started_up = False  # start() done: the first model loaded and the catalog listed
        self._failed: BaseException | None = None  # what start()'s load raised
        self._vocabs: dict[str, Vocab] = {}  # by name, oldest first (VOCABS_KEPT)
        self._vocab_lock = threading.Lock()
        self._reaper = threading.Thread(target=self._reap, name="gguf-keep-alive", daemon=True)
        self._n_ctx = n_ctx
        if path is not None:  # (a header that does not read is left out: the load says why)
            with contextlib.suppress(Exception):
                card = S.ModelCard.from_file(path, name, n_ctx)
                self.cards[card.name] = card
                self.current = card.name

    def mailbox(self) -> _Mailbox:
        loop = asyncio.get_running_loop()
        if loop not in self._mail:
            self._mail[loop] = _Mailbox(loop)
        return self._mail[loop]

    def start(self) -> "Service":
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        early = bool(self.current)  # the starting model's card from its header: the catalog is listed before its load
        if early:
            self._list_catalog(self._n_ctx)
        try:
            self._started()
        except BaseException as e:
            self._failed = e  # (the requests waiting for the load end with it)
            raise
        if not early:
            self._list_catalog(self.engine.n_ctx)
        self._reaper.start()
        self._started_up = True
        return self

    def _list_catalog(self, n_ctx: int | None) -> None:
        """Cards of the catalog's other files, from their headers (a file whose header does not read
        is left out). The dict is replaced, not grown in place: routes iterate it meanwhile."""
        cards = dict(self.cards)
        for name, path in self._catalog:
            if self.find(name) is None and os.path.realpath(path) != os.path.realpath(self.card.path):
                try:
                    card = S.ModelCard.from_file(path, name, n_ctx)
                except Exception:  # noqa: BLE001 - listed only if it reads
                    continue
                cards.setdefault(card.name, card)
        self.cards = cards

    @property
    def loading(self) -> bool:
        """Whether the server is in its initial load (start() not done yet, or failed); a later load, a
        request naming another model of the catalog, is not: the server answers meanwhile."""
        return not self._started_up

    def _started(self, name: str | None = None) -> None:
        adapter = self.scheduler.start()
        self.engine = adapter.engine
        card = S.ModelCard(self.engine, name or self.name)
        self.cards = {**self.cards, card.name: card}  # (replaced whole: routes iterate it meanwhile)
        self.current = card.name
        self._load_s = self.engine.load_s
        self._last_busy = time.monotonic()

    @property
    def card(self) -> S.ModelCard:
        """The card of the model loaded (or last loaded)."""
        return self.cards[self.current]

    def find(self, model: Any) -> S.ModelCard | None:
        """The card a request's model name means, or None."""
        return next((c for c in self.cards.values() if c.matches(model)), None)

    def vocab(self, name: str, read: bool = True) -> Any:
        """The tokenizer and template of the model ``name`` (an object with both): the engine when it
        is the one loaded, else read from its file's header (no weights; kept for the next requests,
        VOCABS_KEPT). With ``read`` false, None where the header would have to be read (callers read
        it off the event loop). A file that no longer reads is its one-line GGUFError."""
        card = self.cards[name]
        eng = self.engine
        if eng is not None and eng.path == card.path:
            return eng
        with self._vocab_lock:
            v = self._vocabs.pop(name, None)
            if v is not None:
                self._vocabs[name] = v  # (now the most recent)
                return v
        if not read:
            return None
        with open_gguf(card.path, check_data=False) as f:
            v = Vocab(Tokenizer.from_metadata(f.metadata), ChatTemplate.from_metadata(f.metadata))
        with self._vocab_lock:
            self._vocabs[name] = v
            while len(self._vocabs) > VOCABS_KEPT:
                del self._vocabs[next(iter(self._vocabs))]
        return v

    def take_load_s(self) -> float:
        """The model's load time, reported once (in the first response), as Ollama does."""
        v, self._load_s = self._load_s, 0.0
        return v

    @contextlib.asynccontextmanager
    async def using(self, keep_alive: float | None = None, name: str | None = None):
        """The model ``name`` (default: the current one) loaded for a request, swapping it in
        (once the loaded one's requests are done) or loading it again where it was unloaded; when
        the request is over (streams: when their job is), it stays loaded for ``keep_alive`` (None:
        the server's default) before the watchdog unloads it."""
        name = name or self.current
        if self._waiting >= self.max_queue:  # (each waiter holds its body: bounded as the scheduler's queue)
            raise ServerBusy(f"{self._waiting} requests are waiting for a model to load; try again later")
        self._waiting += 1
        try:
            await self._wait_for(name)
        finally:
            self._waiting -= 1
        try:
            yield
        finally:
            with self._lock:
                self._holds -= 1
                self.keep = self.keep_default if keep_alive is None else keep_alive
                self._last_busy = time.monotonic()

    async def _wait_for(self, name: str) -> None:
        """Until the model ``name`` is loaded and held for a request (using's wait)."""
        while True:
            if (e := self._failed) is not None:
                why = e if isinstance(e, GGUFRunError) else f"{type(e).__name__}: {e}"
                raise ShuttingDown(f"the model did not load ({why}); the server is shutting down")
            if self._closed:
                raise ShuttingDown("the server is shutting down")
            if self.loading:  # start()'s load, on another thread: requests wait for it
                await asyncio.sleep(0.02)
                continue
            with self._lock:
                if self.current == name and self.scheduler is not None and self._wanted in (None, name):
                    self._holds += 1
                    break
                if self._wanted is None:
                    self._wanted = name
                ready = self._wanted == name and self._holds == 0 and (
                    self.scheduler is None or not self.scheduler.stats()["pending"])
            if ready:
                await asyncio.get_running_loop().run_in_executor(None, self._swap, name)
            else:
                await asyncio.sleep(0.02)

    def _swap(self, name: str) -> None:
        """Unload the model loaded if it is another, then load ``name`` (the caller saw both idle)."""
        with self._load_lock:
            try:
                if self.scheduler is not None and self.current != name:
                    self._check_file(name)  # (a file that cannot load leaves the loaded model alone)
                    self._unload_locked()
                if self.scheduler is None and not self._closed:
                    card = self.cards[name]
                    first = name == next(iter(self.cards))  # the model serve started with
                    load = self._factory if first or self._loader is None else \
                        (lambda path=card.path: self._loader(path))
                    self.scheduler = self._sched(load)
                    try:
                        self._started(name)
                    except BaseException:
                        self.scheduler = None
                        raise
            finally:
                with self._lock:
                    if self._wanted == name:
                        self._wanted = None

    def _check_file(self, name: str) -> None:
        """Raise the one-line GGUFError of ``name``'s file where it does not open whole (truncated,
        damaged since it was listed); its tensors are not read."""
        with open_gguf(self.cards[name].path):
            pass

    def _unload_locked(self) -> None:
        with self._lock:
            sched, engine = self.scheduler, self.engine
            self.scheduler, self.engine = None, None
        if sched is not None:
            sched.shutdown(wait=True)
        del sched
        _free(engine)

    def expires_in(self) -> float:
        """Seconds until the watchdog may unload the model (inf: never; 0: once idle)."""
        with self._lock:
            if self._holds or (self.scheduler is not None and self.scheduler.stats()["pending"]):
                return self.keep
            return max(0.0, self.keep - (time.monotonic() - self._last_busy))

    def unload(self, name: str | None = None, expired: bool = False) -> bool:
        """Unload the model ``name`` (default: the one loaded) now if nothing runs on it (Ollama's
        keep_alive 0 with no prompt; ``expired``: only once idle for keep_alive, the watchdog's
        call); whether it is not loaded afterwards."""
        if self.loading:  # start()'s load runs: not idle
            return False
        with self._load_lock:
            with self._lock:
                sched = self.scheduler
                if sched is None or (name is not None and name != self.current):
                    return True
                if self._holds or sched.stats()["pending"] or \
                        (expired and time.monotonic() - self._last_busy < self.keep):
                    return False
            self._unload_locked()
            return True

    def _reap(self) -> None:
        while not self._closed:
            time.sleep(0.25)
            with self._lock:
                sched = self.scheduler
                if sched is None or self.keep == math.inf:
                    continue
                if self._holds or sched.stats()["pending"]:
                    self._last_busy = time.monotonic()
                    continue
                if time.monotonic() - self._last_busy < self.keep:
                    continue
            self.unload(expired=True)  # (checks again: a request may have come meanwhile)

    def stopping(self) -> None:
        """The server was told to stop (a signal): requests waiting for a model to load end now, with
        the 503 of a server shutting down, instead of at the end of the graceful shutdown."""
        self._closed = True

    def shutdown(self) -> None:
        self._closed = True
        with self._lock:
            sched = self.scheduler
        if sched is not None:
            sched.shutdown()
        self.prep.shutdown(wait=False, cancel_futures=True)


def _free(engine: Any) -> None:
    """Give the unloaded model's GPU memory back: close what the backend holds open (tensor-parallel
    workers), collect it, and empty CuPy's pools (where CuPy is in use)."""
    close = getattr(getattr(engine, "backend", None), "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # noqa: BLE001 - unloading goes on
            pass
    del engine
    gc.collect()
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()


# ---- errors and bodies ----------------------------------------------------------------------------
def status_of(e: BaseException) -> int:
    if isinstance(e, S.ApiError):
        return e.status
    if isinstance(e, (ServerBusy, ShuttingDown)):
        return 503
    return 400 if isinstance(e, GGUFRunError) else 500


def error_response(e: BaseException, openai: bool) -> JSONResponse:
    status = status_of(e)
    msg = str(e) if status < 500 or isinstance(e, GGUFRunError) else f"internal error: {type(e).__name__}: {e}"
    if not openai:
        return JSONResponse({"error": msg}, status_code=status)
    kind = "invalid_request_error" if status < 500 else "server_error"  # (OpenAI's, a missing model's too)
    return JSONResponse({"error": {"message": msg, "type": kind, "param": None,
                                   "code": getattr(e, "code", None)}}, status_code=status)


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


# ---- running a job ------------------------------------------------------------------------------
class _Events:
    """A request's events from the mailbox (one consumer on the event loop: a deque and the one
    waiter; asyncio.Queue's bookkeeping cost more than the tokens' text did). A stream's pause
    between two writes (``pause``) ends early when a job's last event ("done" or "error", at index
    ``at`` of the item) arrives: the end of an answer goes out at once, and its client can send
    its next request."""

    __slots__ = ("items", "at", "_waiter", "_pause", "_ends")

    def __init__(self, at: int = 0) -> None:
        self.items: deque = deque()
        self.at, self._waiter, self._pause, self._ends = at, None, None, 0  # (_ends: last events queued)

    def put_nowait(self, item) -> None:
        self.items.append(item)
        if item[self.at] in ("done", "error"):
            self._ends += 1
            if self._pause is not None and not self._pause.done():
                self._pause.set_result(None)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def empty(self) -> bool:
        return not self.items

    def get_nowait(self):
        item = self.items.popleft()  # (IndexError when empty: callers check empty() first)
        self._ends -= item[self.at] in ("done", "error")
        return item

    async def get(self):
        while not self.items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.get_nowait()

    async def pause(self, seconds: float) -> None:
        if self._ends:  # a last event is queued already: no pause
            return
        loop = asyncio.get_running_loop()
        f = self._pause = loop.create_future()
        h = loop.call_later(seconds, _resolve, f)
        try:
            await f
        finally:
            h.cancel()
            self._pause = None


def _resolve(f: asyncio.Future) -> None:
    if not f.done():
        f.set_result(None)


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
        # two asyncio tasks, the first to end cancels the other: an anyio task group's cancel scope
        # formats repr(task) at each cancel, a cost on the event loop every streamed request paid
        tasks = (asyncio.ensure_future(self._body(send)), asyncio.ensure_future(self.listen_for_disconnect(receive)))
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.wait(tasks)
            await self.body_iterator.aclose()
            self.on_close()
        for t in tasks:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()

    async def _body(self, send) -> None:
        try:
            await self.stream_response(send)
        except OSError:
            pass  # the client left mid-write


async def prepare(svc: Service, request: Request, encode: Callable[[], Any]) -> Any:
    """encode() (template and tokenizer) on the event loop for a small request body, else on a prep
    thread; a small one that took long sends every later one to the prep threads."""
    size = request.headers.get("content-length", "")
    if not (svc.inline_prep and size.isdigit() and int(size) <= INLINE_PREP_BYTES):
        return await asyncio.get_running_loop().run_in_executor(svc.prep, encode)
    t0 = time.perf_counter()
    try:
        return encode()
    finally:
        if (took := time.perf_counter() - t0) > INLINE_PREP_MAX_S:
            svc.inline_prep = False
            log.warning("a small prompt took %.0f ms to prepare: prompts are prepared off the event loop from now on",
                        1e3 * took)


async def run_job(svc: Service, request: Request, fmt, encode: Callable[[], list[int]],
                  params, requested: int | None, stop: tuple[str, ...], stream: bool,
                  n_ctx: int | None = None, grammar: str | None = None,
                  keep: frozenset[int] = frozenset(), logprobs: int = -1) -> Response:
    t0 = time.perf_counter()
    ids = await prepare(svc, request, encode)
    sched, mail = svc.scheduler, svc.mailbox()
    max_new = sched.budget(len(ids), requested, n_ctx)
    q = _Events()
    job = Job(ids, params, max_new, lambda kind, data: mail.put(q, (kind, data)), stop, t_submit=t0,
              grammar=grammar, keep_special=keep, logprobs=logprobs)
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
            if kind == "text":
                parts.append(data)
    finally:
        watch.cancel()
        if not finished:
            sched.cancel(job)

    async def body():
        done = False
        item = first
        loop = asyncio.get_running_loop()
        try:
            while True:
                out, texts = [], []  # everything queued goes out in one write, its text as one chunk
                while True:
                    kind, data = item
                    if kind == "text":
                        texts.append(data)
                    elif kind == "logprobs":
                        fmt.logprobs(data)  # (they go out with the next chunk)
                    else:
                        done = True
                        if texts:
                            out.append(fmt.chunk("".join(texts)))
                            texts = []
                        out.append(fmt.final(data, svc.take_load_s()) if kind == "done"
                                   else fmt.error(str(data), status_of(data)))
                        break
                    if q.empty():
                        break
                    item = q.get_nowait()
                if texts:
                    out.append(fmt.chunk("".join(texts)))
                if out:  # (logprobs alone wait for their text)
                    yield "".join(out)
                if done:
                    return
                last = loop.time()
                item = await q.get()
                if job.state == "active" and (wait := last + svc.stream_interval - loop.time()) > 0:
                    await q.pause(wait)  # (read across threads: a stale state costs one wait)
        finally:
            if not done:
                sched.cancel(job)

    def close() -> None:
        if job.state in ("new", "waiting", "active"):  # read across threads: a stale value only
            sched.cancel(job)  # costs a no-op cancel

    return _Stream(body(), close, media_type=fmt.media_type, headers={"Cache-Control": "no-cache"})


async def run_choices(svc: Service, request: Request, make_fmt: Callable[[], Any],
                      encode: Callable[[], list[list[int]]], params, requested: int | None, stop: tuple[str, ...],
                      n: int, grammar: str | None = None, keep: frozenset[int] = frozenset(),
                      stream: bool = False, logprobs: int = -1) -> Response:
    """Several choices: OpenAI's ``n`` and /v1/completions' list of prompts. ``encode`` gives the
    prompts (tokenized once each); each gets n jobs (the prefix cache evaluates a prompt once where
    the backend has one), seeds seed, seed + 1, ... where a seed is given; choice p * n + j is
    prompt p's j-th. Usage counts each prompt once and every choice's tokens. A failing choice
    fails the request and cancels the others; so does the client leaving. Streamed, the choices'
    chunks interleave as their tokens come (each with its index), one usage chunk and [DONE] last."""
    t0 = time.perf_counter()
    prompts = await prepare(svc, request, encode)
    sched, mail = svc.scheduler, svc.mailbox()
    budgets = [sched.budget(len(ids), requested) for ids in prompts]
    k = len(prompts) * n
    q = _Events(at=1)  # (choice, kind, data) of every job
    jobs = [Job(prompts[c // n], params if params.seed is None else dataclasses.replace(params, seed=params.seed + c % n),
                budgets[c // n], lambda kind, data, c=c: mail.put(q, (c, kind, data)), stop, t_submit=t0,
                grammar=grammar, keep_special=keep, logprobs=logprobs) for c in range(k)]
    submitted: list[Job] = []

    def cancel_all() -> None:
        for job in submitted:
            if job.state in ("new", "waiting", "active"):
                sched.cancel(job)

    parts: list[list[str]] = [[] for _ in range(k)]
    done, started = 0, False
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        for job in jobs:
            sched.submit(job)
            submitted.append(job)
        while done < k:
            get = asyncio.ensure_future(q.get())
            await asyncio.wait({get, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                return Response(status_code=499)  # the client is gone (nobody reads this)
            item = c, kind, data = get.result()
            if kind == "error":
                raise data
            if stream:  # the body streams from this first event on (an error before it keeps its status)
                started = True
                break
            if kind == "done":
                done += 1
            elif kind == "text":
                parts[c].append(data)
    finally:
        watch.cancel()
        if not started:
            cancel_all()
    if stream:
        return _stream_choices(make_fmt, q, item, jobs, prompts, n, cancel_all, svc.stream_interval)
    load = svc.take_load_s()
    wholes = [make_fmt().whole("".join(p), job, load) for p, job in zip(parts, jobs)]
    out = wholes[0]
    out["choices"] = [{**w["choices"][0], "index": c} for c, w in enumerate(wholes)]
    out["usage"] = _choices_usage(prompts, jobs, n)
    return JSONResponse(out)


def _choices_usage(prompts: list[list[int]], jobs: list[Job], n: int) -> dict:
    firsts = jobs[::n]  # each prompt's first job: its cached part
    n_in, n_out = sum(map(len, prompts)), sum(len(job.ids) for job in jobs)
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out,
            "prompt_tokens_details": {"cached_tokens": sum(max(0, len(j.prompt) - j.prompt_eval) for j in firsts)}}


def _stream_choices(make_fmt: Callable[[], Any], q: _Events, first: tuple, jobs: list[Job],
                    prompts: list[list[int]], n: int, cancel_all: Callable[[], None], interval: float) -> Response:
    """run_choices streamed from its first event: each choice's chunks through its own formatter
    (its index, the first one's id), one usage chunk and [DONE] once every choice is done; a write
    at most every ``interval`` seconds while a choice runs."""
    k = len(jobs)
    fmts = [make_fmt() for _ in range(k)]
    for c, f in enumerate(fmts):
        f.as_choice(c, fmts[0])

    async def body():
        done, item, over = 0, first, False
        loop = asyncio.get_running_loop()
        try:
            while True:
                out, texts = [], {}  # everything queued goes out in one write, a choice's text as one chunk
                while True:
                    c, kind, data = item
                    if kind == "text":
                        texts.setdefault(c, []).append(data)
                    elif kind == "logprobs":
                        fmts[c].logprobs(data)
                    elif kind == "done":
                        if c in texts:
                            out.append(fmts[c].chunk("".join(texts.pop(c))))
                        out.append(fmts[c].end(data))
                        done += 1
                        if done == k:
                            out.append(fmts[0].tail(_choices_usage(prompts, jobs, n)))
                            over = True
                            break
                    else:
                        out.append(fmts[0].error(str(data), status_of(data)))
                        over = True
                        break
                    if q.empty():
                        break
                    item = q.get_nowait()
                if not over:
                    out += [fmts[c].chunk("".join(t)) for c, t in texts.items()]
                if out:
                    yield "".join(out)
                if over:
                    return
                last = loop.time()
                item = await q.get()
                if any(j.state == "active" for j in jobs) and (wait := last + interval - loop.time()) > 0:
                    await q.pause(wait)
        finally:
            cancel_all()

    return _Stream(body(), cancel_all, media_type=fmts[0].media_type, headers={"Cache-Control": "no-cache"})


async def run_embed(svc: Service, request: Request, encode: Callable[[], list[list[int]]]) -> EmbedJob | None:
    """Tokenize the inputs (``encode``, on a helper thread), run them through the scheduler (each its
    own sequence, between the running generations' steps) and return the finished job (its pooled
    ``vectors``, not yet normalized); None when the client left first (the job is cancelled)."""
    t0 = time.perf_counter()
    inputs = await asyncio.get_running_loop().run_in_executor(svc.prep, encode)
    sched, mail = svc.scheduler, svc.mailbox()
    q = _Events()
    job = EmbedJob(inputs, lambda kind, data: mail.put(q, (kind, data)), t_submit=t0)
    sched.submit(job)
    finished = False
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        get = asyncio.ensure_future(q.get())
        await asyncio.wait({get, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not get.done():
            get.cancel()
            return None
        finished = True
        kind, data = get.result()
        if kind == "error":
            raise data
        return job
    finally:
        watch.cancel()
        if not finished:
            sched.cancel(job)
