"""The server's host path alone: `serve` with the CUDA adapter over a timed stand-in of the GPU.

    python bench/host_serve.py [--clients 64] [--tokens 128] [--step-ms 0.45,0.0208] [--profile] [--trace]

The stand-in (``TimedBackend``) has the CUDA backend's batch API (seq_start, seq_prefill_many,
batch_step, the pinned ring, events) and a device timeline instead of a GPU: each launch takes
the time the H100 measured (a decode step of bucket B: a + b * B ms, by default SmolLM2's: 0.42 ms at
B=1 and 1.78 ms at B=64, anchors.md; a packed prompt forward: 0.5 ms + its tokens at 110k tok/s), events complete at
their point of that timeline, and a wait for one sleeps (the GIL is free meanwhile, as in a CUDA
event wait). Tokens are a real text's, through the real tokenizer and template (the default model's),
so detokenizing, stop strings, formats and HTTP cost what they cost. ``--real`` (a GPU machine)
serves the CUDA backend itself with the same accounting: the real server's host threads measured.

The load is `bench/serve_load.py bench` in another process. What it prints: tok/s beside the
stand-in's own B = clients rate (the ceiling), the share of wall time the "device" was busy, and
(--profile) where the scheduler thread and the event loop spend their time, (--trace) where each
request's cycle goes between its client and a slot's decoding. Runs on any machine:
the host's work is Python, the same on the GPU machine's CPUs (there faster per core)."""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import threading
import time
import traceback
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gguf_runtime.backends.page_pool import PagePool  # noqa: E402
from gguf_runtime.cli.default_model import default_model_path  # noqa: E402
from gguf_runtime.engine.engine import Engine  # noqa: E402
from gguf_runtime.server.adapters import make_adapter  # noqa: E402
from gguf_runtime.server.app import Service, build_app  # noqa: E402

RING = 64
TEXT = ("The river runs past the old mills toward the grey sea, and the wizards of the valley count "
        "the boats that come home each evening. ") * 8


class Device:
    """A timeline: each launch starts when the device is free (or now) and takes its duration."""

    def __init__(self) -> None:
        self.free_at = 0.0
        self.busy = 0.0  # seconds of launched work

    def launch(self, seconds: float) -> float:
        now = time.perf_counter()
        self.free_at = max(self.free_at, now) + seconds
        self.busy += seconds
        return self.free_at


class TimedEvent:
    def __init__(self, dev: Device) -> None:
        self.dev, self.t = dev, 0.0

    def record(self, stream) -> None:
        self.t = self.dev.free_at

    def synchronize(self) -> None:
        left = self.t - time.perf_counter()
        if left > 0:
            time.sleep(left)

    @property
    def done(self) -> bool:
        return time.perf_counter() >= self.t


class TimedKV:
    page_size = 16

    def __init__(self, n_pages: int, slots: int) -> None:
        self.n_pages, self.pool = n_pages, PagePool(n_pages, self.page_size, slots)

    def capacity(self, s):
        return len(self.pool.owned(s)) * self.page_size

    def free_pages(self):
        return self.pool.available()

    def match(self, tokens):
        return self.pool.match(tokens, len(tokens) - 1)

    def reserve(self, s, n, stream=None, prefix=()):
        self.pool.reserve(s, -(-n // self.page_size), prefix)

    def publish(self, s, tokens):
        self.pool.publish(s, tokens)

    def release(self, s, tokens=()):
        self.pool.release(s, tokens)


class TimedBackend:
    """The CUDA backend's batch API over a Device timeline (see the module)."""

    name, use_graph = "cuda", False

    def __init__(self, tokens: list[int], n_ctx: int, max_batch: int, step: tuple[float, float],
                 prefill: tuple[float, float], first_cost: tuple[bool, float] = (False, 0.0)) -> None:
        self.n_ctx, self.max_batch, self.step_ab, self.prefill_ab = n_ctx, max_batch, step, prefill
        # seq_first as the CUDA backend's costs it (--first-cost): a wait for the device (its check
        # of the prompt's logits) and host work holding the GIL (the slot's parameter uploads)
        self.first_sync, self.first_host = first_cost
        self.forward_host = 0.0  # host seconds a prompt forward holds the GIL (its eager launches: --forward-host)
        self.dev, self.stream = Device(), object()
        self.tune = SimpleNamespace(serve_chunk=2048, serve_pack=True, lookahead=2)
        self.kv = TimedKV(n_ctx // 16 * max_batch, max_batch)
        self.ring = [[0] * max_batch for _ in range(RING)]
        self.text = tokens
        self.seq: dict[int, list[int]] = {}  # slot -> [offset into text, tokens produced]
        self.steps = 0
        self.forwards = 0  # prompt forwards (packed or not)

    def new_event(self):
        return TimedEvent(self.dev)

    def gpu_sampling(self, params) -> bool:
        return True

    def _next(self, slot: int) -> None:
        q = self.seq[slot]
        self.ring[q[1] % RING][slot] = self.text[(q[0] + q[1]) % len(self.text)]
        q[1] += 1

    def seq_start(self, slot, prompt, params, max_new, reuse=False):
        kv = self.kv
        prefix = kv.match(prompt) if reuse and not kv.capacity(slot) else []
        kv.reserve(slot, min(self.n_ctx, len(prompt) + max_new), prefix=prefix)
        return len(prefix) * kv.page_size

    def _hold(self, seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    def seq_prefill_many(self, parts) -> None:
        self.forwards += 1
        self._hold(self.forward_host)
        a, rate = self.prefill_ab
        self.dev.launch(a + sum(len(t) for _, t, _ in parts) / rate)
        for slot, _, first in parts:
            if first is not None:
                self.seq_first(slot, *first, launch=False)

    def seq_prefill(self, slot, tokens) -> None:
        self.forwards += 1
        self._hold(self.forward_host)
        a, rate = self.prefill_ab
        self.dev.launch(a + len(tokens) / rate)

    def seq_first(self, slot, prompt, params, seed=None, publish=False, launch=True) -> None:
        if self.first_sync and (left := self.dev.free_at - time.perf_counter()) > 0:
            time.sleep(left)
        self._hold(self.first_host)
        if publish:
            self.kv.publish(slot, prompt)
        self.seq[slot] = [(seed or 0) % len(self.text), 0]
        self._next(slot)

    def batch_step(self, n_slots: int) -> None:
        bucket = 1 << (n_slots - 1).bit_length()
        a, b = self.step_ab
        self.dev.launch((a + b * bucket) / 1e3)
        self.steps += 1
        for slot in list(self.seq):
            if slot < n_slots:
                self._next(slot)

    def seq_token(self, slot, i):
        return self.ring[i % RING][slot]

    def seq_release(self, slot, tokens=()):
        self.seq.pop(slot, None)
        self.kv.release(slot, tokens)


class GpuTimes:
    """--gpu-time (with --real): CUDA events on the backend's stream around each prompt forward
    (seq_prefill_many / seq_prefill, its first tokens' sampling included) and each decode step; what
    the device did over the span they cover, per decode step: stepping, prompts, and the rest (idle,
    waiting for the host, or the few small copies between the calls)."""

    KINDS = {"seq_prefill_many": "prompt", "seq_prefill": "prompt", "batch_step": "step", "verify_many": "verify"}

    def __init__(self, be) -> None:
        import cupy as cp

        self.cp, self.be, self.depth = cp, be, 0
        self.spans: list[tuple] = []  # (kind, start event, end event, parts, tokens)
        for name, kind in self.KINDS.items():
            if hasattr(be, name):
                setattr(be, name, self._wrap(getattr(be, name), kind))

    def _wrap(self, real, kind: str):
        def call(*args, **kw):
            if self.depth:  # (a call inside a timed one: seq_prefill_many's own seq_prefill)
                return real(*args, **kw)
            parts = list(args[0]) if kind == "prompt" and isinstance(args[0], list) else None
            n = (len(parts), sum(len(t) for _, t, _ in parts)) if parts is not None else \
                (1, len(args[1])) if kind == "prompt" else (0, 0)
            self.depth += 1
            start = self.cp.cuda.Event()
            start.record(self.be.stream)
            try:
                return real(*args, **kw)
            finally:
                end = self.cp.cuda.Event()
                end.record(self.be.stream)
                self.spans.append((kind, start, end, *n))
                self.depth -= 1
        return call

    def report(self) -> str:
        import numpy as np

        cp = self.cp
        self.be.stream.synchronize()
        if not self.spans:
            return "gpu time: nothing timed"
        ref = self.spans[0][1]
        iv = sorted((cp.cuda.get_elapsed_time(ref, s), cp.cuda.get_elapsed_time(ref, e), k, p, t)
                    for k, s, e, p, t in self.spans)
        busy: dict[str, float] = collections.Counter()
        count: dict[str, int] = collections.Counter()
        gaps, reach = [], iv[0][0]
        for s, e, k, _, _ in iv:
            gaps.append(max(0.0, s - reach))
            reach = max(reach, e)
            busy[k] += e - s
            count[k] += 1
        span, idle = reach - iv[0][0], sum(gaps)
        steps = max(count["step"], 1)
        prompts = [(e - s, p, t) for s, e, k, p, t in iv if k == "prompt"]
        out = [f"gpu time over {span:,.1f} ms: " + ", ".join(f"{k} {busy[k]:,.1f} ms ({count[k]:,})" for k in busy)
               + f", the rest {idle:,.1f} ms ({100 * idle / span:.1f}%)",
               f"  a decode step: {busy['step'] / steps:.3f} ms, + prompts {busy['prompt'] / steps:.3f} ms"
               f" + the rest {idle / steps:.3f} ms = {span / steps:.3f} ms"]
        if prompts:
            ms, p, t = (np.array(x) for x in zip(*prompts))
            out.append(f"  prompt forwards: {len(ms):,}, parts each {p.mean():.2f} (max {p.max()}), tokens each "
                       f"{t.mean():.1f}; {np.median(ms):.3f} ms each (p50), {np.percentile(ms, 90):.3f} (p90)")
            big = np.sort(np.array(gaps))[::-1]
            out.append(f"  gaps: {int((big > 0.05).sum()):,} over 50 us, the largest "
                       f"{', '.join(f'{g:.2f}' for g in big[:5])} ms")
        return "\n".join(out)


def cpu_seconds(native_id: int) -> float:
    """A thread's user + system CPU time (Linux /proc; 0 elsewhere)."""
    try:
        with open(f"/proc/self/task/{native_id}/stat") as fh:
            f = fh.read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def thread_cpu() -> dict[str, float]:
    """CPU seconds of the server's threads so far: the event loop, the scheduler, prompt preparation."""
    out: dict[str, float] = collections.Counter()
    for t in threading.enumerate():
        name = ("scheduler" if t.name == "gguf-scheduler" else "prep" if t.name.startswith("gguf-prep")
                else "event loop" if t.name.startswith("Thread-") else None)
        if name and t.native_id:
            out[name] += cpu_seconds(t.native_id)
    return out


class Sampler:
    """Every 5 ms, each thread's innermost frames, counted (--profile)."""

    def __init__(self, depth: int = 4) -> None:
        self.depth = depth
        self.counts = collections.defaultdict(collections.Counter)
        self.total = collections.Counter()
        self.stop = False
        self.th = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        me = threading.get_ident()
        while not self.stop:
            time.sleep(0.005)
            names = {t.ident: t.name for t in threading.enumerate()}
            for tid, frame in sys._current_frames().items():
                if tid == me:
                    continue
                name = names.get(tid, str(tid))
                name = "prep" if name.startswith("gguf-prep") else name
                st = traceback.extract_stack(frame)[-self.depth:]
                key = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in reversed(st))
                self.counts[name][key] += 1
                self.total[name] += 1

    def report(self, top: int = 14) -> str:
        out = []
        for name, n in self.total.most_common():
            if name == "MainThread" or not n:
                continue
            out.append(f"== {name}: {n} samples")
            for key, c in self.counts[name].most_common(top):
                out.append(f"{100 * c / n:5.1f}%  {key}")
        return "\n".join(out)


def cycle_report(trace_file: str, jobs: list[tuple]) -> str:
    """Where each request's cycle goes (ms; means, p50, p90), the client's times (serve_load --trace)
    joined by seed with the server's: sent -> submitted (HTTP, parsing, the prompt's tokens) ->
    admitted -> first token read -> delivered; decoding; last token read -> delivered; then the
    client's turn to its next request. A slot idles from one request's end to the next one's first
    token (its client's delivery, turn, HTTP, wait and prompt): the share printed last."""
    import json

    import numpy as np

    with open(trace_file) as fh:
        tr = json.load(fh)
    srv = {j[0]: j[1:] for j in jobs}
    parts: dict[str, list[float]] = collections.defaultdict(list)
    by_client: dict[tuple, list] = collections.defaultdict(list)
    for c, i, seed, t0, tf, te in tr["requests"]:
        by_client[(c, i)].append((t0, te, seed))
        if seed not in srv or not tf:
            continue
        sub, adm, first, end = srv[seed]
        for k, v in (("sent -> submitted", sub - t0), ("submitted -> admitted", adm - sub),
                     ("admitted -> first token", first - adm), ("first token delivered", tf - first),
                     ("decoding", end - first), ("last token delivered", te - end)):
            parts[k].append(v)
    for reqs in by_client.values():
        reqs.sort()
        parts["client's turn"] += [b[0] - a[1] for a, b in zip(reqs, reqs[1:])]
    if not parts:
        return "trace: no request joined"
    out = [f"trace: {len(parts['decoding'])} requests joined (ms)"]
    for k, v in parts.items():
        x = np.array(v) * 1e3
        out.append(f"  {k:24s} mean {x.mean():8.2f}  p50 {np.median(x):8.2f}  p90 {np.percentile(x, 90):8.2f}")
    idle = sum(np.mean(parts[k]) for k in ("last token delivered", "client's turn", "sent -> submitted",
                                           "submitted -> admitted", "admitted -> first token") if parts[k])
    dec = np.mean(parts["decoding"])
    out.append(f"  a slot decodes {100 * dec / (dec + idle):.1f}% of its cycle ({1e3 * dec:.1f} of "
               f"{1e3 * (dec + idle):.1f} ms)")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="the GGUF whose tokenizer and template serve (default: the default model)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4, help="per client")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--procs", type=int, default=1, help="the load's client processes (serve_load.py --procs)")
    ap.add_argument("--keep-alive", action="store_true", help="the load's clients keep their connections")
    ap.add_argument("--real", action="store_true", help="the CUDA backend itself instead of the stand-in (a GPU "
                    "machine): the same CPU accounting and --profile for the real server")
    ap.add_argument("--step-ms", default="0.40,0.0216", help="a decode step of bucket B takes a + b * B ms")
    ap.add_argument("--prefill", default="0.0005,110000", help="a prompt forward: seconds + tokens / rate")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--switch-interval", type=float, default=None, help="the GIL's (seconds; default the server's)")
    ap.add_argument("--depth", type=int, default=2, help="decode steps in flight (the adapter's launch-ahead)")
    ap.add_argument("--forward-host", type=float, default=0.0, help="host seconds a prompt forward holds the GIL")
    ap.add_argument("--first-cost", default="", help="SYNC,HOST_S: each first token waits for the device "
                    "(SYNC 1) and holds the host HOST_S seconds, as the CUDA backend's seq_first does")
    ap.add_argument("--stream-interval", type=float, default=None, help="the server's (seconds; default its own)")
    ap.add_argument("--profile", action="store_true", help="sample every thread's stack")
    ap.add_argument("--trace", action="store_true", help="each request's cycle: the load's times joined with the "
                    "server's (submitted, admitted, first token, end), where a client's turn goes")
    ap.add_argument("--gpu-time", action="store_true", help="with --real: where the device's time goes (CUDA "
                    "events around each prompt forward and decode step)")
    ap.add_argument("--cprofile", action="store_true", help="the event loop under cProfile (slows it)")
    ap.add_argument("--loop", default="auto", help="uvicorn's: auto, asyncio, uvloop")
    ap.add_argument("--http", default="auto", help="uvicorn's: auto, h11, httptools")
    a = ap.parse_args()
    import uvicorn

    step = tuple(float(x) for x in a.step_ms.split(","))
    prefill = tuple(float(x) for x in a.prefill.split(","))
    max_batch = 1 << (a.clients - 1).bit_length()
    if a.real:
        eng = Engine(a.model or default_model_path(), backend="cuda", n_ctx=a.ctx, max_batch=max(max_batch, 1))
        be = None
    else:
        eng = Engine(a.model or default_model_path(), backend="numpy", n_ctx=a.ctx)
        eos = set(eng.tokenizer.eog_ids)
        text = [t for t in eng.tokenizer.encode(TEXT, add_special=False) if t not in eos]
        fc = a.first_cost.split(",") if a.first_cost else ["0", "0"]
        be = TimedBackend(text, a.ctx, max(max_batch, 1), step, prefill, (fc[0] == "1", float(fc[1])))
        be.forward_host = a.forward_host
        eng.backend = be
    svc = Service(lambda: make_adapter(eng, depth=a.depth), name="host").start()
    gpu_times = GpuTimes(eng.backend) if a.real and a.gpu_time else None  # (after the start's captures)
    jobs: list[tuple] = []
    if a.trace:  # the server's times of each finished request (the scheduler's thread appends)
        sch, end = svc.scheduler, svc.scheduler._end

        def _end(job, state, error=None, reason=""):
            end(job, state, error, reason)
            if hasattr(job, "params") and job.t_end:
                jobs.append((job.params.seed, job.t_submit, job.t_admit, job.t_first, job.t_end))
        sch._end = _end
    trace_file = f"/tmp/host_serve_trace_{os.getpid()}.json" if a.trace else ""
    if a.stream_interval is not None:
        svc.stream_interval = a.stream_interval
    if a.switch_interval is not None:
        sys.setswitchinterval(a.switch_interval)
    import socket
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(build_app(svc), log_level="warning", loop=a.loop, http=a.http)
    config.install_signal_handlers = False
    srv = uvicorn.Server(config)
    prof_loop = None
    if a.cprofile:  # the event loop's thread under cProfile
        import cProfile
        prof_loop = cProfile.Profile()
        run_loop = lambda **kw: prof_loop.runcall(srv.run, **kw)  # noqa: E731
    th = threading.Thread(target=run_loop if prof_loop else srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    while not srv.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    prof = Sampler() if a.profile else None
    if prof:
        prof.th.start()
    import resource
    busy0, t0, cpu0 = be.dev.busy if be else 0.0, time.perf_counter(), thread_cpu()
    load = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "serve_load.py"), "bench",
                           "--url", url, "--clients", str(a.clients), "--requests", str(a.requests),
                           "--tokens", str(a.tokens), "--procs", str(a.procs)] + (["--keep-alive"] if a.keep_alive else [])
                          + (["--trace", trace_file] if a.trace else []), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    cpu = thread_cpu()
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    if prof:
        prof.stop = True
    srv.should_exit = True
    th.join(10)
    svc.shutdown()
    print(load.stdout[-3000:], load.stderr[-2000:])
    if be is not None:
        ceiling = a.clients / ((step[0] + step[1] * max_batch) / 1e3)
        print(f"{be.forwards:,} prompt forwards, {be.steps:,} decode steps")
        print(f"stand-in B={a.clients} step {step[0] + step[1] * max_batch:.3f} ms: ceiling {ceiling:,.0f} tok/s; "
              f"device busy {100 * (be.dev.busy - busy0) / wall:.1f}% of {wall:.1f} s (warm-up included)")
    n_tok = a.clients * a.requests * a.tokens
    print(f"the load's process: {ru.ru_utime + ru.ru_stime:.2f} s of CPU in {wall:.2f} s (its own start and "
          "warm-up included)")
    print("host CPU per generated token: " + ", ".join(
        f"{k} {1e6 * (cpu[k] - cpu0.get(k, 0)) / n_tok:.1f} us" for k in ("event loop", "scheduler", "prep")))
    if gpu_times is not None:
        print(gpu_times.report())
    if prof:
        print(prof.report())
    if trace_file and os.path.exists(trace_file):
        print(cycle_report(trace_file, jobs))
        os.remove(trace_file)
    if prof_loop:
        import pstats
        pstats.Stats(prof_loop).sort_stats("tottime").print_stats(30)
    return load.returncode


if __name__ == "__main__":
    sys.exit(main())
