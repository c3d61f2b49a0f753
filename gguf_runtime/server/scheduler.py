"""Continuous batching: one thread owns the model and runs every request through it.

Request handlers (any thread) call :meth:`Scheduler.submit` and :meth:`Scheduler.cancel`; both
only put a message in a queue. The scheduler's thread loops: take messages; admit waiting jobs
(first come, first served) into free slots while the adapter has room, at most ``admit_tokens``
prompt tokens per round once something is running (so running streams keep flowing); run one
adapter step; turn each slot's new tokens into text (incremental UTF-8, end-of-generation
tokens, stop strings, the token budget); release finished and cancelled slots at once.

A job reports through ``job.emit(kind, data)``, called on the scheduler's thread: ``("text",
str)`` as text arrives, then ``("done", job)`` (``job.reason`` is "stop" or "length") or
``("error", exception)``. Nothing is emitted after a cancel. A job that asked for ``logprobs``
(k >= 0 alternatives) also gets ``("logprobs", [entry, ...])`` before the text of each step: one
``sampling.token_logprobs`` entry per token added to ``job.ids``, kept in ``job.logprobs_seen``.

An :class:`EmbedJob` (embeddings of several inputs) waits in a queue of its own; each round runs
inputs of the first one (``adapter.embed``, each input its own sequence) up to ``admit_tokens``
tokens (at least one input), in a free slot lent for the call where the adapter needs one, so
running streams keep flowing between them; it reports ``("done", job)`` with ``job.vectors``.
"""

from __future__ import annotations

import heapq
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import ContextOverflowError, GGUFRunError
from ..sampling import SamplingParams
from .adapters import NoRoom

log = logging.getLogger("gguf_runtime.server")


class ServerBusy(GGUFRunError):
    """Too many requests waiting (HTTP 503)."""


class ShuttingDown(GGUFRunError):
    """The server is stopping (HTTP 503)."""


class StopMatcher:
    """Cuts streamed text at the first stop string, holding back a tail that may start one."""

    def __init__(self, stops: tuple[str, ...] = ()) -> None:
        self.stops = tuple(s for s in stops if s)
        self.buf = ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was hit; then nothing more is emitted)."""
        if not self.stops:
            return text, False
        buf = self.buf + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.buf = ""
            return buf[:min(hits)], True
        keep = 0
        for k in range(min(len(buf), max(map(len, self.stops)) - 1), 0, -1):
            if any(s.startswith(buf[-k:]) for s in self.stops):
                keep = k
                break
        self.buf = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


@dataclass(eq=False)
class Job:
    prompt: list[int]
    params: SamplingParams
    max_new: int  # from Scheduler.budget
    emit: Callable[[str, Any], None]
    stop: tuple[str, ...] = ()
    t_submit: float = field(default_factory=time.perf_counter)
    grammar: str | None = None  # structured output: the compiled grammar (schemas.structured_output)
    keep_special: frozenset[int] = frozenset()  # special tokens shown in the text (tool-call markers)
    logprobs: int = -1  # -1: none; k >= 0: each token's log-probability and its k most likely alternatives
    # filled in by the scheduler
    state: str = "new"  # waiting, active, done, cancelled, failed
    slot: int = -1
    ids: list[int] = field(default_factory=list)  # generated tokens (no end-of-generation token)
    logprobs_seen: list = field(default_factory=list)  # with logprobs: an entry per token of ids
    prompt_eval: int = 0  # prompt tokens evaluated (the rest came from a cached prefix)
    reason: str = ""
    t_admit: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0


@dataclass(eq=False)
class EmbedJob:
    inputs: list[list[int]]  # token ids, one sequence each
    emit: Callable[[str, Any], None]
    t_submit: float = field(default_factory=time.perf_counter)
    # filled in by the scheduler
    state: str = "new"  # waiting, done, cancelled, failed
    vectors: list = field(default_factory=list)  # adapter.embed's pooled vectors, in input order
    tokens: int = 0  # tokens evaluated
    reason: str = ""
    t_admit: float = 0.0
    t_end: float = 0.0


class Scheduler:
    def __init__(self, factory: Callable[[], Any], admit_tokens: int = 4096, max_queue: int = 1024,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        """``factory`` builds the adapter (loads the model) on the scheduler's thread. ``on_fatal`` is
        called (on that thread) if the loop itself dies after start: the server exits then, rather
        than answer as if alive while nothing generates."""
        self._factory = factory
        self._on_fatal = on_fatal
        self.admit_tokens, self.max_queue = admit_tokens, max_queue
        self.adapter: Any = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.RLock()  # re-entrant: shutdown() may run in a signal handler
        self._pending = 0  # submitted and not yet finished
        self._closed = False
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="gguf-scheduler", daemon=True)
        self.waiting: deque[Job] = deque()
        self.active: dict[int, Job] = {}
        self.embeds: deque[EmbedJob] = deque()
        self._free: list[int] = []
        self._state: dict[Job, Any] = {}  # job -> (decoder, matcher)

    # ---- any thread -------------------------------------------------------------------------
    def start(self) -> Any:
        """Start the thread; wait for the adapter (re-raising what the factory raised)."""
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self.adapter

    def budget(self, n_prompt: int, requested: int | None, n_ctx: int | None = None) -> int:
        """Tokens a job may generate: ``requested`` (None: up to the context), clipped to fit the
        context, or the request's own window ``n_ctx`` (Ollama's num_ctx; past the server's, the
        server's: Ollama caps it at what the model was trained for, and clients send that figure,
        /api/show's context_length, as num_ctx)."""
        a = self.adapter
        if n_prompt < 1:
            raise GGUFRunError("the prompt is empty after tokenization; give some text")
        if n_ctx is not None:
            n_ctx = min(n_ctx, a.n_ctx)
        if n_ctx is not None and n_prompt + 1 > n_ctx:
            raise ContextOverflowError(f"the prompt is {n_prompt} tokens but options.num_ctx is {n_ctx}; "
                                       "shorten the prompt or raise num_ctx")
        room = min(a.n_ctx - a.margin, n_ctx or a.n_ctx) - n_prompt
        if room < 1:
            raise ContextOverflowError(f"the prompt is {n_prompt} tokens but the context holds {a.n_ctx}"
                                       f"{f' (less {a.margin} reserved)' if a.margin else ''}; "
                                       "shorten the prompt or restart the server with a larger --ctx-size")
        return room if requested is None or requested < 0 else min(requested, room)

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._closed:
                raise ShuttingDown("the server is shutting down")
            if self._pending >= self.max_queue:
                raise ServerBusy(f"the server has {self._pending} requests in progress; try again later")
            self._pending += 1
        self._inbox.put(("submit", job))

    def cancel(self, job: Job) -> None:
        self._inbox.put(("cancel", job))

    def shutdown(self, wait: bool = True, timeout: float | None = 30.0) -> None:
        """Stop taking jobs, cancel running ones (their handlers get a ShuttingDown error). A thread
        still loading the model is not waited for (a load cannot be cut short; it stops once done)."""
        with self._lock:
            self._closed = True
        self._inbox.put(("stop", None))
        if wait and self._ready.is_set() and self._thread.is_alive() and \
                threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def stats(self) -> dict[str, int]:
        """A snapshot for monitoring (read without locking; approximate while busy)."""
        s = {"active": len(self.active), "waiting": len(self.waiting), "pending": self._pending,
             "slots": getattr(self.adapter, "max_slots", 0), "free_slots": len(self._free)}
        kv = getattr(getattr(self.adapter, "be", None), "kv", None)
        if kv is not None and hasattr(kv, "free_pages"):
            s.update(kv_pages=kv.n_pages, free_kv_pages=kv.free_pages())  # (cached pages count as free)
            pool = getattr(kv, "pool", None)
            if pool is not None:
                s.update(kv_cached_pages=pool.cached(), prefix_hit_tokens=pool.hits)
        return s

    # ---- the scheduler's thread -------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._setup()
        except BaseException as e:  # noqa: BLE001 - handed to start()
            self._error = e
            with self._lock:
                self._closed = True
            return
        finally:
            self._ready.set()
        try:
            while self._pump():
                pass
        except BaseException as e:  # noqa: BLE001 - a bug in the loop itself: nothing will generate
            log.exception("the scheduler loop died")
            self._error = e
            self._close_all()
            if self._on_fatal is not None:
                self._on_fatal(e)
            return
        self._close_all()

    def _setup(self) -> None:
        self.adapter = self._factory()
        self._free = list(range(self.adapter.max_slots))
        self.eog = frozenset(self.adapter.tokenizer.eog_ids)

    def _pump(self) -> bool:
        idle = not (self.active or self.waiting or self.embeds)
        try:
            msg = self._inbox.get(timeout=0.5) if idle else self._inbox.get_nowait()
        except queue.Empty:
            msg = None
        while msg is not None:
            kind, job = msg
            if kind == "stop":
                return False
            if kind == "submit":
                self._enqueue(job)
            else:
                self._cancel(job)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                msg = None
        self._embed_round()  # first: it lends a free slot only for the call, so neither kind starves
        self._admit()
        if self.active:
            try:
                out = self.adapter.step()
            except Exception as e:  # noqa: BLE001 - a device failure: fail what runs, keep serving
                log.exception("decode step failed")
                for job in list(self.active.values()):
                    self._end(job, "failed", e)
                return True
            for slot, toks in out.items():
                job = self.active.get(slot)
                if job is not None:
                    try:
                        self._feed(job, toks)
                    except Exception as e:  # noqa: BLE001 - this request's tokens or text: fail it alone
                        log.exception("finishing a step of a request failed")
                        self._end(job, "failed", e)
            for slot, e in list(getattr(self.adapter, "failed", {}).items()):  # a prompt's later chunk failed
                job = self.active.get(slot)
                if job is not None:
                    self._end(job, "failed", e)
        return True

    def _enqueue(self, job: Job | EmbedJob) -> None:
        if isinstance(job, EmbedJob):
            job.state = "waiting"
            self.embeds.append(job)
            return
        if job.max_new <= 0:
            job.t_admit = job.t_first = time.perf_counter()
            self._end(job, "done", reason="length")
            return
        job.state = "waiting"
        self.waiting.append(job)

    def _admit(self) -> None:
        room = self.admit_tokens
        while self.waiting and self._free and (room > 0 or not self.active):
            job = self.waiting[0]
            slot = heapq.heappop(self._free)  # the lowest free slot keeps the batch bucket small
            job.t_admit = time.perf_counter()
            try:
                more = {**({"grammar": job.grammar} if job.grammar else {}),
                        **({"logprobs": job.logprobs} if job.logprobs >= 0 else {})}
                job.prompt_eval = self.adapter.add(slot, job.prompt, job.params, job.max_new, **more)
            except NoRoom:
                heapq.heappush(self._free, slot)
                if self.active:
                    return  # wait for a running sequence to free pages (first come, first served)
                self._end(job, "failed", ContextOverflowError(
                    "the KV cache cannot hold this request even when idle; shorten it or lower num_predict"))
                continue
            except Exception as e:  # noqa: BLE001 - bad parameters for this backend, or a bug
                heapq.heappush(self._free, slot)
                if not isinstance(e, GGUFRunError):
                    log.exception("admitting a request failed")
                self._end(job, "failed", e)
                continue
            self.waiting.popleft()
            room -= job.prompt_eval  # (what the prefix cache supplied costs nothing)
            job.slot, job.state = slot, "active"
            self.active[slot] = job
            self._state[job] = (self.adapter.tokenizer.stream(skip_special=True, keep=job.keep_special),
                                StopMatcher(job.stop))

    def _embed_round(self) -> None:
        """Run inputs of the first embedding job, up to admit_tokens tokens (at least one input);
        a job is done when every input has its vector."""
        room = self.admit_tokens
        while self.embeds and room > 0:
            job = self.embeds[0]
            if len(job.vectors) == len(job.inputs):
                self._end(job, "done")
                continue
            slot = -1
            if self.adapter.embed_slot:
                if not self._free:
                    return  # every slot generates: the next one free serves it
                slot = heapq.heappop(self._free)
            if not job.t_admit:
                job.t_admit = time.perf_counter()
            ids = job.inputs[len(job.vectors)]
            try:
                vec = self.adapter.embed(slot, ids)
            except NoRoom:
                if self.active:
                    return  # wait for a running sequence to free pages
                self._end(job, "failed", ContextOverflowError(
                    "the KV cache cannot hold this input even when idle; shorten it or raise the KV budget"))
                continue
            except Exception as e:  # noqa: BLE001 - bad input for this backend, or a bug: fail this job alone
                if not isinstance(e, GGUFRunError):
                    log.exception("an embedding failed")
                self._end(job, "failed", e)
                continue
            finally:
                if slot >= 0:
                    heapq.heappush(self._free, slot)
            job.vectors.append(vec)
            job.tokens += len(ids)
            room -= len(ids)
            if len(job.vectors) == len(job.inputs):
                self._end(job, "done")

    def _feed(self, job: Job, toks: list[int]) -> None:
        decoder, matcher = self._state[job]
        parts, reason, cut = [], "", False
        if not job.t_first:  # (the adapter may have evaluated less than add said: a prefix shared meanwhile)
            job.prompt_eval = getattr(self.adapter, "prompt_eval", {}).get(job.slot, job.prompt_eval)
        entries = self.adapter.logprobs.get(job.slot, ()) if job.logprobs >= 0 else ()
        seen = len(job.logprobs_seen)
        for i, tok in enumerate(toks):
            if not job.t_first:
                job.t_first = time.perf_counter()
            if tok in self.eog:
                reason = "stop"
                break
            job.ids.append(tok)
            if i < len(entries):
                job.logprobs_seen.append(entries[i])
            piece = decoder.push(tok)
            if piece:
                text, cut = matcher.push(piece)
                parts.append(text)
                if cut:
                    reason = "stop"
                    break
            if len(job.ids) >= job.max_new:
                reason = "length"
                break
        if reason and not cut:
            text, cut = matcher.push(decoder.flush())
            parts += [text, "" if cut else matcher.flush()]
        text = "".join(parts)
        if len(job.logprobs_seen) > seen and not self._send(job, "logprobs", job.logprobs_seen[seen:]):
            return
        if text and not self._send(job, "text", text):
            return
        if reason:
            self._end(job, "done", reason=reason)

    def _send(self, job: Job, kind: str, data: Any) -> bool:
        try:
            job.emit(kind, data)
            return True
        except Exception:  # noqa: BLE001 - the handler's event loop is gone: treat as a cancel
            if job.state in ("waiting", "active"):
                self._end(job, "cancelled")
            return False

    def _release(self, job: Job) -> None:
        if job.state == "active":
            del self.active[job.slot]
            try:
                self.adapter.release(job.slot)
            finally:
                heapq.heappush(self._free, job.slot)
        elif job.state == "waiting":
            (self.embeds if isinstance(job, EmbedJob) else self.waiting).remove(job)

    def _end(self, job: Job, state: str, error: BaseException | None = None, reason: str = "") -> None:
        """Finish a job: free its slot and pages now, then report (unless cancelled)."""
        if job.state in ("done", "cancelled", "failed"):
            return
        try:
            self._release(job)
        finally:
            job.state, job.reason, job.t_end = state, reason, time.perf_counter()
            self._state.pop(job, None)
            with self._lock:
                self._pending -= 1
        if state == "done":
            self._send(job, "done", job)
        elif state == "failed":
            self._send(job, "error", error)

    def _cancel(self, job: Job) -> None:
        self._end(job, "cancelled")

    def _close_all(self) -> None:
        with self._lock:
            self._closed = True
        err = ShuttingDown("the server is shutting down")
        for job in [*self.active.values(), *self.waiting, *self.embeds]:
            try:
                self._end(job, "failed", err)
            except Exception:  # noqa: BLE001 - keep closing the others
                log.exception("releasing a sequence at shutdown failed")
        while True:
            try:
                kind, job = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                self._end(job, "failed", err)
