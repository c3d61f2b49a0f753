"""Load test and benchmark for `gguf-run serve` (run on the GPU machine; stdlib only).

    python bench/serve_load.py load  --spawn MODEL.gguf [--serve-arg=--max-batch=64] [--tokens 64]
    python bench/serve_load.py bench --spawn MODEL.gguf [--clients 1,8,32,64] [--tokens 128]
    python bench/serve_load.py bench --url http://127.0.0.1:11434      (a server already running)
    python bench/serve_load.py chat  --spawn MODEL.gguf [--clients 1,32] [--turns 20] [--tokens 64]
    python bench/serve_load.py mixed --spawn MODEL.gguf [--clients 60] [--long-clients 4] [--long-words 6500]

load: a warm-up burst, 64 concurrent streamed requests (Ollama and OpenAI endpoints, streamed),
200 sequential ones (streamed and not), 32 clients that disconnect mid-stream, --shared requests
(64 at a time) sharing one --system-words-word system prompt, every tenth dropped after its first
chunk (the share the prefix cache served is printed), bad input (each
must get a 4xx JSON error), 64 concurrent again; then the scheduler must be idle with every KV
page free and the GPU memory (nvidia-smi) no larger than after the warm-up (--mem-tolerance-mib).
Exits 1 on any error. bench: C clients each sending --requests streamed /api/generate requests in
turn, for each C: aggregate generated tok/s, TTFT and time per output token (p50/p99); with
--constrained N the first N clients of each level send a JSON schema as `format`, with --logprobs K
every request asks for logprobs (K alternatives): their cost beside a plain run; with --prompt-file
and --greedy every request is that chat message, answered greedily (`serve --spec ngram`'s case). chat: C
clients each holding a --turns-turn conversation through /api/chat, resending the whole history
every turn as clients do (the prefix cache's case): TTFT of turn 1 and of the last turn (p50), and
the share of the prompt tokens sent that the server evaluated (prompt_eval_count less
prompt_eval_cached_count). mixed: C short clients as in bench beside --long-clients clients that
send --long-words-word documents (64 tokens each) until the short ones are done: the short
requests' TPOT p50 / p99 (a long prompt must not stall them) and the documents' TTFT.
--spawn starts the server (port 0) and stops it with SIGINT at the end (it must exit 0).
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex every jolly "
         "sphinx of black quartz and the river runs past old mills toward the grey sea").split()
ENDPOINTS = ("generate", "chat", "v1-chat", "v1-completions")
# bench --constrained: a schema whose answers can run to any length (a list of strings)
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}},
          "required": ["items"]}


@dataclass
class Res:
    ok: bool = True
    error: str = ""
    tokens: int = 0
    t0: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0
    chunks: list[float] = field(default_factory=list)
    text: str = ""  # streamed text, joined
    final: dict = field(default_factory=dict)  # the last chunk (Ollama: done, with the counts)
    seed: int | None = None  # bench: the request's seed (--trace joins the server's job by it)
    client: int = -1  # bench: the client that sent it

    @property
    def ttft(self) -> float:
        return (self.t_first or self.t_end) - self.t0

    @property
    def tpot(self) -> float | None:
        last = self.chunks[-1] if self.chunks else self.t_end
        return (last - self.t_first) / (self.tokens - 1) if self.tokens > 1 and self.t_first else None


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def body_for(kind: str, model: str, text: str, n: int, stream: bool, seed: int) -> tuple[str, dict]:
    if kind == "generate":
        return "/api/generate", {"model": model, "prompt": text, "raw": True, "stream": stream,
                                 "options": {"num_predict": n, "seed": seed}}
    if kind == "chat":
        return "/api/chat", {"model": model, "messages": [{"role": "user", "content": text}], "stream": stream,
                             "options": {"num_predict": n, "seed": seed}}
    common = {"model": model, "max_tokens": n, "seed": seed, "stream": stream}
    if stream:
        common["stream_options"] = {"include_usage": True}
    if kind == "v1-chat":
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": text}]}
    return "/v1/completions", {**common, "prompt": text}


def request(base: str, path: str, body: dict | bytes, timeout: float = 600, method: str = "POST",
            drop_after_first: bool = False, keep: dict | None = None) -> tuple[int, Res, object]:
    """One request; streamed bodies are read chunk by chunk. (status, timings, JSON body or None).
    keep: a client's connection kept alive between its requests (keep["conn"]; as HTTP clients'
    pools do), else a new connection for this request alone."""
    u = urlsplit(base)
    res = Res(t0=time.perf_counter())
    conn = keep.get("conn") if keep is not None else None
    if conn is None:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    reuse = False
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request(method, path, data if method == "POST" else None, {"Content-Type": "application/json"})
        r = conn.getresponse()
        ctype = r.getheader("content-type", "")
        if "ndjson" not in ctype and "event-stream" not in ctype:
            raw = r.read()
            res.t_end = time.perf_counter()
            reuse = keep is not None
            try:
                obj = json.loads(raw)
            except ValueError:
                obj = None
            if r.status == 200 and isinstance(obj, dict):
                res.tokens = obj.get("eval_count") or (obj.get("usage") or {}).get("completion_tokens", 0)
            return r.status, res, obj
        for line in r:
            line = line.strip()
            if line.startswith(b"data: "):
                line = line[6:]
                if line == b"[DONE]":
                    break
            if not line:
                continue
            obj = json.loads(line)
            now = time.perf_counter()
            if "error" in obj:
                res.ok, res.error = False, str(obj["error"])[:200]
                break
            if obj.get("usage"):
                res.tokens = obj["usage"]["completion_tokens"]
            if obj.get("done"):
                res.tokens, res.final = obj.get("eval_count", 0), obj
                continue
            ch = (obj.get("choices") or [{}])[0]
            text = obj.get("response") or (obj.get("message") or {}).get("content") or ch.get("text") \
                or (ch.get("delta") or {}).get("content")
            if text:
                res.t_first = res.t_first or now
                res.chunks.append(now)
                res.text += text
                if drop_after_first:
                    break
        res.t_end = time.perf_counter()
        if keep is not None and not drop_after_first:
            r.read()  # (the stream's end: the connection serves the next request)
            reuse = True
        return r.status, res, None
    except (OSError, http.client.HTTPException, ValueError) as e:
        res.ok, res.error, res.t_end = False, f"{type(e).__name__}: {e}"[:200], time.perf_counter()
        return 0, res, None
    finally:
        if reuse:
            keep["conn"] = conn
        else:
            conn.close()
            if keep is not None:
                keep.pop("conn", None)


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def summarize(name: str, results: list[Res], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    toks = sum(r.tokens for r in ok)
    tp = [r.tpot for r in ok if r.tpot is not None]
    return {"phase": name, "requests": len(results), "errors": len(results) - len(ok), "tokens": toks,
            "wall_s": wall, "tok_s": toks / wall if wall > 0 else 0.0,
            "ttft_p50_ms": 1e3 * pct([r.ttft for r in ok], 50), "ttft_p99_ms": 1e3 * pct([r.ttft for r in ok], 99),
            "tpot_p50_ms": 1e3 * pct(tp, 50), "tpot_p99_ms": 1e3 * pct(tp, 99)}


def table(rows: list[dict], first: str) -> None:
    cols = [first, "requests", "errors", "tokens", "wall_s", "tok_s", "ttft_p50_ms", "ttft_p99_ms",
            "tpot_p50_ms", "tpot_p99_ms"]
    cell = lambda v: f"{v:,.1f}" if isinstance(v, float) else str(v)  # noqa: E731
    out = [[c for c in cols]] + [[cell(r[c]) for c in cols] for r in rows]
    w = [max(len(row[i]) for row in out) for i in range(len(cols))]
    for j, row in enumerate(out):
        print("  ".join(v.rjust(w[i]) for i, v in enumerate(row)))
        if j == 0:
            print("  ".join("-" * x for x in w))


def _threads(fn, ids: list[int]) -> list:
    out: list = [None] * len(ids)
    ths = [threading.Thread(target=lambda j=j, i=i: out.__setitem__(j, fn(i))) for j, i in enumerate(ids)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    return out


def concurrent(fn, n: int, procs: int = 1) -> tuple[list, float]:
    """fn(i) for i < n, each in its own thread; procs > 1: the threads dealt over that many forked
    processes (each its own GIL: 64 clients' chunk parsing in one process delays the readers, and
    the delay is counted as the server's), results back through a queue (perf_counter is
    system-wide, so their times compare)."""
    t0 = time.perf_counter()
    if procs <= 1 or n < 2:
        return _threads(fn, list(range(n))), time.perf_counter() - t0
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    groups = [g for g in (list(range(p, n, procs)) for p in range(procs)) if g]
    ps = [ctx.Process(target=lambda g=g: q.put((g, _threads(fn, g))), daemon=True) for g in groups]
    for p in ps:
        p.start()
    out: list = [None] * n
    for _ in ps:  # (read before joining: a child blocks until its results are taken)
        g, res = q.get()
        for i, r in zip(g, res):
            out[i] = r
    for p in ps:
        p.join()
    return out, time.perf_counter() - t0


# ---- the server ------------------------------------------------------------------------------------
class Spawned:
    def __init__(self, model: str, args: list[str]) -> None:
        cmd = [sys.executable, "-m", "gguf_runtime", "serve", model, "--port", "0", "-q", *args]
        print("$", " ".join(cmd), flush=True)
        self.p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        line = self.p.stderr.readline()
        m = re.search(r" on (http://\S+)", line)
        if not m:
            raise SystemExit(f"the server did not start: {line}{self.p.stderr.read()[-2000:]}")
        print(line.strip(), flush=True)
        self.url = m.group(1)
        threading.Thread(target=lambda: shutil.copyfileobj(self.p.stderr, sys.stderr), daemon=True).start()

    def stop(self) -> int:
        self.p.send_signal(signal.SIGINT)
        try:
            return self.p.wait(60)
        except subprocess.TimeoutExpired:
            self.p.kill()
            return -9


def wait_ready(url: str, timeout: float = 900) -> str:
    t = time.time() + timeout
    while time.time() < t:
        st, _, obj = request(url, "/api/tags", b"", timeout=5, method="GET")
        if st == 200:
            return obj["models"][0]["name"]
        time.sleep(0.5)
    raise SystemExit(f"no answer from {url} in {timeout:.0f} s")


def gpu_mem_mib(pid: int | None) -> float | None:
    """GPU memory of the server process (when spawned and listed), else used on GPU 0 (nvidia-smi)."""
    if not shutil.which("nvidia-smi"):
        return None

    def smi(q: str) -> list[list[str]]:
        out = subprocess.run(["nvidia-smi", q, "--format=csv,noheader,nounits"], capture_output=True,
                             text=True).stdout
        return [[x.strip() for x in line.split(",")] for line in out.splitlines() if line.strip()]

    for row in smi("--query-compute-apps=pid,used_memory") if pid else []:
        if row[0] == str(pid):
            return float(row[1])
    rows = smi("--query-gpu=memory.used")  # containers often list no processes
    return float(rows[0][0]) if rows else None


# ---- modes -----------------------------------------------------------------------------------------
def load(url: str, model: str, a, pid: int | None) -> list[str]:
    rng, errors, rows = random.Random(0), [], []

    def one(i: int, stream: bool = True, n: int | None = None, words: int | None = None) -> Res:
        r = random.Random(i)
        path, body = body_for(ENDPOINTS[i % 4], model, prompt(r, words or r.randint(5, a.max_words)),
                              n or a.tokens, stream, r.randrange(1 << 31))
        st, res, _ = request(url, path, body)
        if st != 200 and res.ok:
            res.ok, res.error = False, f"HTTP {st} on {path}"
        return res

    def phase(name: str, results: list[Res], wall: float) -> None:
        rows.append(summarize(name, results, wall))
        errors.extend(f"{name}: {r.error}" for r in results if not r.ok)

    phase("warm-up", *concurrent(lambda i: one(i, n=4, words=a.max_words), a.concurrency))
    mem0 = gpu_mem_mib(pid)
    phase(f"{a.concurrency} concurrent", *concurrent(lambda i: one(1000 + i), a.concurrency))
    t0 = time.perf_counter()
    seq = [one(2000 + i, stream=i % 3 != 0, n=rng.randint(1, a.tokens)) for i in range(a.sequential)]
    phase(f"{a.sequential} sequential", seq, time.perf_counter() - t0)

    def drop(i: int) -> Res:
        path, body = body_for(ENDPOINTS[i % 4], model, prompt(random.Random(i), 20), 10**6, True, i)
        st, res, _ = request(url, path, body, drop_after_first=True)
        res.ok = st == 200 and bool(res.chunks)
        res.error = "" if res.ok else f"disconnect phase: HTTP {st} {res.error}"
        return res

    phase("32 disconnects", *concurrent(drop, 32))
    # many clients sharing one long system prompt (the prefix cache's case), some cancelled mid-stream
    system = prompt(random.Random(7), a.system_words)
    shared: list[Res] = []
    lock = threading.Lock()

    def sharer(c: int) -> list[Res]:
        out = []
        for k in range(c, a.shared, a.concurrency):
            r = random.Random(5000 + k)
            body = {"model": model, "stream": True, "options": {"num_predict": 8, "seed": k},
                    "messages": [{"role": "system", "content": system},
                                 {"role": "user", "content": prompt(r, r.randint(3, 12))}]}
            st, res, _ = request(url, "/api/chat", body, drop_after_first=k % 10 == 9)
            res.ok = st == 200 and (bool(res.final) or (k % 10 == 9 and bool(res.chunks)))
            res.error = "" if res.ok else f"shared system prompt: HTTP {st} {res.error}"
            out.append(res)
        with lock:
            shared.extend(out)
        return out

    _, wall = concurrent(sharer, min(a.concurrency, a.shared))
    phase(f"{a.shared} sharing a system prompt", shared, wall)
    sent = sum(r.final.get("prompt_eval_count", 0) for r in shared if r.final)
    cached = sum(r.final.get("prompt_eval_cached_count", 0) for r in shared if r.final)
    print(f"shared system prompt ({a.system_words} words): {cached:,} of {sent:,} prompt tokens came from the "
          f"prefix cache ({100 * cached / max(sent, 1):.1f}%)")
    bad = [("/api/generate", b"{oops"), ("/api/generate", {"model": "nope", "prompt": "x"}),
           ("/api/generate", {"model": model, "prompt": "x", "options": {"num_predict": -7}}),
           ("/v1/chat/completions", {"model": model, "messages": "x"}),
           ("/api/generate", {"model": model, "prompt": "word " * 100000, "raw": True}),
           ("/api/generate", b'{"model": "m", "prompt": "' + b"x" * (2 << 20) + b'"}')]
    t0, res_bad = time.perf_counter(), []
    for path, body in bad:
        st, res, obj = request(url, path, body)
        good = 400 <= st < 500 and isinstance(obj, dict) and "error" in obj
        res.ok, res.error, res.tokens = good, "" if good else f"bad input to {path}: HTTP {st}", 0
        res_bad += [res, one(3000 + len(res_bad), stream=False, n=4)]
    phase("bad input", res_bad, time.perf_counter() - t0)
    phase(f"{a.concurrency} concurrent again", *concurrent(lambda i: one(4000 + i), a.concurrency))
    time.sleep(1.0)
    st, _, sched = request(url, "/api/scheduler", b"", method="GET")
    mem1 = gpu_mem_mib(pid)
    table(rows, "phase")
    print(f"\nscheduler after: {sched}")
    if not (st == 200 and sched["active"] == sched["waiting"] == sched["pending"] == 0
            and sched.get("free_kv_pages") == sched.get("kv_pages")):
        errors.append(f"the scheduler is not idle with every KV page free: {sched}")
    if mem0 is None or mem1 is None:
        print("GPU memory: not measured (no nvidia-smi or no process entry)")
    else:
        print(f"GPU memory: {mem0:,.0f} MiB after the warm-up, {mem1:,.0f} MiB at the end ({mem1 - mem0:+,.0f})")
        if mem1 - mem0 > a.mem_tolerance_mib:
            errors.append(f"GPU memory grew by {mem1 - mem0:.0f} MiB")
    return errors


def ttft_parts(results: list[Res]) -> dict:
    """TTFT taken apart with the server's own figures (Ollama's final chunk): waiting (request
    parsing, template and tokenizer, admission), the prompt's evaluation to its first token, and the
    rest (HTTP and streaming both ways, the client itself)."""
    fin = [r for r in results if r.ok and r.final]
    ns = lambda r, k: r.final.get(k, 0) / 1e9  # noqa: E731
    queue = [ns(r, "total_duration") - ns(r, "prompt_eval_duration") - ns(r, "eval_duration") for r in fin]
    prefill = [ns(r, "prompt_eval_duration") for r in fin]
    rest = [r.ttft - q - p for r, q, p in zip(fin, queue, prefill)]
    return {"queue_p50_ms": 1e3 * pct(queue, 50), "prefill_p50_ms": 1e3 * pct(prefill, 50),
            "rest_p50_ms": 1e3 * pct(rest, 50)}


def bench(url: str, model: str, a) -> list[str]:
    rows, errors, traced = [], [], []
    request(url, *body_for("generate", model, "warm up", 8, True, 1))
    text = open(a.prompt_file).read() if a.prompt_file else None
    if text:  # the file's request twice, whole: its prompt's sizes (evaluated, then cached) met before timing
        for _ in range(2):
            path, body = body_for("chat", model, text, a.tokens, True, 1)
            if a.greedy:
                body["options"].update(temperature=0, repeat_penalty=1.0)
            request(url, path, body)
    for c in a.clients:
        def client(i: int) -> list[Res]:
            r = random.Random(c * 1000 + i)
            out, keep = [], ({} if a.keep_alive else None)
            for _ in range(a.requests):
                path, body = body_for("chat" if text else "generate", model, text or prompt(r, a.prompt_words),
                                      a.tokens, True, r.randrange(1 << 31))
                if a.greedy:
                    body["options"]["temperature"] = 0
                    body["options"]["repeat_penalty"] = 1.0
                if i < a.constrained:  # structured output beside free text (the grammar's cost)
                    body["format"] = SCHEMA
                if a.logprobs >= 0:
                    body.update(logprobs=True, top_logprobs=a.logprobs)
                st, res, _ = request(url, path, body, keep=keep)
                res.ok = res.ok and st == 200
                res.seed, res.client = body["options"]["seed"], i
                out.append(res)
            if keep and keep.get("conn"):
                keep["conn"].close()
            return out

        per, wall = concurrent(client, c, a.procs)
        results = [r for rs in per for r in rs]
        traced += [[c, r.client, r.seed, r.t0, r.t_first, r.t_end] for r in results]
        rows.append({**summarize(str(c), results, wall), "clients": c, **ttft_parts(results)})
        errors += [r.error or "HTTP error" for r in results if not r.ok]
    table(rows, "clients")
    print()
    for r in rows:
        print(f"{r['clients']} clients: TTFT p50 = waiting {r['queue_p50_ms']:,.1f} + prompt {r['prefill_p50_ms']:,.1f} "
              f"+ the rest {r['rest_p50_ms']:,.1f} ms (p50s of the server's own figures)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"url": url, "model": model, "tokens": a.tokens, "prompt_words": a.prompt_words,
                       "rows": rows}, fh, indent=1)
    if a.trace:  # each request's times (time.perf_counter: the system's monotonic clock, shared by processes)
        with open(a.trace, "w") as fh:
            json.dump({"fields": ["clients", "client", "seed", "t0", "t_first", "t_end"], "requests": traced}, fh)
    return errors


def chat(url: str, model: str, a) -> list[str]:
    rows, errors = [], []
    request(url, *body_for("generate", model, "warm up", 8, True, 1))
    for c in a.clients:
        def client(i: int) -> list[Res]:
            r, msgs, out = random.Random(c * 1000 + i), [], []
            for _ in range(a.turns):
                msgs.append({"role": "user", "content": prompt(r, a.prompt_words)})
                body = {"model": model, "messages": msgs, "stream": True,
                        "options": {"num_predict": a.tokens, "seed": r.randrange(1 << 31)}}
                st, res, obj = request(url, "/api/chat", body)
                res.ok = res.ok and st == 200 and bool(res.final)
                if st != 200:
                    res.error = f"HTTP {st}: {str((obj or {}).get('error', ''))[:160]}"
                out.append(res)
                if not res.ok:
                    break
                msgs.append({"role": "assistant", "content": res.text})
            return out

        per, wall = concurrent(client, c)
        results = [r for rs in per for r in rs]
        errors += [r.error or "HTTP error" for r in results if not r.ok]
        first = [rs[0].ttft for rs in per if rs and rs[0].ok]
        last = [rs[-1].ttft for rs in per if len(rs) == a.turns and rs[-1].ok]
        # the last turn's TTFT taken apart with the server's own figures (Ollama's final chunk): the
        # wait for admission, the prompt's evaluation to its first token, and the rest (request
        # parsing, template and tokenizer before submission; streaming after)
        fin = [rs[-1] for rs in per if len(rs) == a.turns and rs[-1].ok]
        ns = lambda r, k: r.final.get(k, 0) / 1e9  # noqa: E731
        queue = [ns(r, "total_duration") - ns(r, "prompt_eval_duration") - ns(r, "eval_duration") for r in fin]
        prefill = [ns(r, "prompt_eval_duration") for r in fin]
        rest = [r.ttft - q - p for r, q, p in zip(fin, queue, prefill)]
        sent = sum(r.final.get("prompt_eval_count", 0) for r in results if r.ok)
        cached = sum(r.final.get("prompt_eval_cached_count", 0) for r in results if r.ok)
        rows.append({**summarize(str(c), results, wall), "clients": c, "turns": a.turns,
                     "ttft_turn1_p50_ms": 1e3 * pct(first, 50), "ttft_last_p50_ms": 1e3 * pct(last, 50),
                     "last_queue_p50_ms": 1e3 * pct(queue, 50), "last_prefill_p50_ms": 1e3 * pct(prefill, 50),
                     "last_rest_p50_ms": 1e3 * pct(rest, 50),
                     "prompt_sent": sent, "prompt_evaluated": sent - cached,
                     "evaluated_share": (sent - cached) / sent if sent else float("nan")})
    table(rows, "clients")
    print()
    for r in rows:
        print(f"{r['clients']} clients: TTFT p50 turn 1 {r['ttft_turn1_p50_ms']:,.1f} ms, turn {r['turns']} "
              f"{r['ttft_last_p50_ms']:,.1f} ms ({r['ttft_last_p50_ms'] / r['ttft_turn1_p50_ms']:.2f}x); prompt "
              f"tokens evaluated {r['prompt_evaluated']:,} of {r['prompt_sent']:,} sent "
              f"({100 * r['evaluated_share']:.1f}%); turn {r['turns']} TTFT = waiting {r['last_queue_p50_ms']:,.1f} + "
              f"prompt {r['last_prefill_p50_ms']:,.1f} + the rest {r['last_rest_p50_ms']:,.1f} ms (p50s)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"url": url, "model": model, "tokens": a.tokens, "prompt_words": a.prompt_words,
                       "turns": a.turns, "rows": rows}, fh, indent=1)
    return errors


def mixed(url: str, model: str, a) -> list[str]:
    errors: list[str] = []
    request(url, *body_for("generate", model, "warm up", 8, True, 1))
    c, done, lock, finished = a.clients[0], threading.Event(), threading.Lock(), [0]

    def client(i: int) -> list[Res]:
        """Client i < c: a.requests short requests; the others send documents until those are done."""
        r, out = random.Random(7000 + i), []
        long = i >= c
        try:
            while (long and not done.is_set()) or (not long and len(out) < a.requests):
                words = a.long_words if long else a.prompt_words
                path, body = body_for("generate", model, prompt(r, words), 64 if long else a.tokens, True,
                                      r.randrange(1 << 31))
                st, res, _ = request(url, path, body)
                res.ok = res.ok and st == 200
                out.append(res)
            return out
        finally:
            if not long:
                with lock:
                    finished[0] += 1
                    if finished[0] == c:
                        done.set()

    per, wall = concurrent(client, c + a.long_clients)
    short = [r for rs in per[:c] for r in rs]
    long = [r for rs in per[c:] for r in rs]
    rows = [{**summarize("short", short, wall), "clients": c}, {**summarize("long", long, wall), "clients": a.long_clients}]
    errors += [r.error or "HTTP error" for r in short + long if not r.ok]
    table(rows, "phase")
    s = rows[0]
    # the gaps between a stream's chunks: where a long prompt stalls the others (a request's mean
    # TPOT spreads a stall over its tokens)
    gaps = [b - a_ for r in short if r.ok for a_, b in zip(r.chunks, r.chunks[1:])]
    s["itl_p50_ms"], s["itl_p99_ms"], s["itl_max_ms"] = (1e3 * pct(gaps, 50), 1e3 * pct(gaps, 99),
                                                       1e3 * max(gaps, default=float("nan")))
    print(f"\nshort requests: TPOT p50 {s['tpot_p50_ms']:.1f} ms, p99 {s['tpot_p99_ms']:.1f} ms "
          f"({s['tpot_p99_ms'] / s['tpot_p50_ms']:.2f}x); gaps between chunks p50 {s['itl_p50_ms']:.1f} ms, "
          f"p99 {s['itl_p99_ms']:.1f} ms, max {s['itl_max_ms']:.0f} ms; documents ({a.long_words} words): "
          f"TTFT p50 {rows[1]['ttft_p50_ms']:,.0f} ms over {len(long)} requests")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"url": url, "model": model, "tokens": a.tokens, "long_words": a.long_words, "rows": rows}, fh,
                      indent=1)
    return errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("mode", choices=("load", "bench", "chat", "mixed"))
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="a running server")
    src.add_argument("--spawn", metavar="MODEL", help="start `gguf-run serve MODEL --port 0` (use '' for the default)")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra argument for serve (repeat)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per request (load: 64, bench: 128)")
    ap.add_argument("--concurrency", type=int, default=64, help="load: concurrent requests per burst")
    ap.add_argument("--sequential", type=int, default=200, help="load: sequential requests")
    ap.add_argument("--max-words", type=int, default=200, help="load: prompt length, words at most")
    ap.add_argument("--shared", type=int, default=1000, help="load: requests sharing one system prompt")
    ap.add_argument("--system-words", type=int, default=1500, help="load: the shared system prompt's words")
    ap.add_argument("--mem-tolerance-mib", type=float, default=64.0)
    ap.add_argument("--clients", default="1,8,32,64", help="bench: concurrency levels")
    ap.add_argument("--requests", type=int, default=4, help="bench: requests per client per level")
    ap.add_argument("--prompt-words", type=int, default=32, help="bench: prompt length in words")
    ap.add_argument("--procs", type=int, default=1, help="bench: client processes the clients are dealt over")
    ap.add_argument("--keep-alive", action="store_true", help="bench: each client keeps its connection between "
                    "requests (as HTTP client libraries' pools do)")
    ap.add_argument("--prompt-file", help="bench: every request sends this text as a chat message instead")
    ap.add_argument("--greedy", action="store_true", help="bench: temperature 0, no repeat penalty (the requests "
                    "`serve --spec ngram` speculates)")
    ap.add_argument("--constrained", type=int, default=0,
                    help="bench: this many clients of each level send a JSON schema (format)")
    ap.add_argument("--logprobs", type=int, default=-1, help="bench: every request asks for logprobs with "
                    "this many alternatives")
    ap.add_argument("--turns", type=int, default=20, help="chat: turns per conversation")
    ap.add_argument("--long-clients", type=int, default=4, help="mixed: clients sending documents")
    ap.add_argument("--long-words", type=int, default=6500, help="mixed: words a document (~8k tokens)")
    ap.add_argument("--json", help="bench, chat: write the rows here")
    ap.add_argument("--trace", help="bench: write every request's client, seed and times here (JSON; "
                    "bench/host_serve.py --trace joins them with the server's)")
    a = ap.parse_args()
    a.tokens = a.tokens or (128 if a.mode == "bench" else 64)
    a.clients = [int(x) for x in a.clients.split(",")]
    server = Spawned(a.spawn, a.serve_arg) if a.spawn is not None else None
    errors: list[str] = []
    try:
        url = server.url if server else a.url.rstrip("/")
        model = wait_ready(url)
        if a.mode == "load":
            errors = load(url, model, a, server.p.pid if server else None)
        else:
            errors = {"bench": bench, "chat": chat, "mixed": mixed}[a.mode](url, model, a)
    finally:
        if server:
            rc = server.stop()
            print(f"server stopped with SIGINT: exit code {rc}")
            if rc != 0:
                errors.append(f"the server exited with {rc} after SIGINT")
    for e in errors[:20]:
        print("ERROR:", e)
    print(f"\n{'FAIL' if errors else 'OK'}: {len(errors)} error(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
