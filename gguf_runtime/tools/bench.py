"""Throughput measurements: prompt processing (pp), token generation (tg), batched generation.

Times are taken around synchronized device work (time.perf_counter after a stream sync), after a
warm-up run; each row keeps every repetition (mean, median and standard deviation are derived).

The functions take any backend by duck typing: the CUDA backend (``start_decode``/``run_steps``
decode on the device, ``seq_add``/``batch_step`` decode many sequences, graphs or eager) and the
numpy backend (``prefill``/``truncate``, tokens through the host sampling loop ``sample_loop``).
``run_suite`` measures the rows `gguf-run bench` prints; ``bench_report`` renders them.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..errors import BackendError
from ..format.model_config import ModelConfig, model_tensors
from ..sampling import SamplingParams

BATCH_PROMPT = 128  # prompt tokens of each sequence in the batched rows (as llama-batched-bench -npp)
ProgressFn = Callable[[str, int, int], None]


@dataclass
class Rate:
    test: str  # "pp512", "tg128", "B=8 tg128", "pp512 @ d4096" (llama-bench's depth)
    mode: str  # "eager" or "graph"
    tokens: int  # tokens per repetition (all sequences together for batched rows)
    runs: list[float]  # tokens per second, one per repetition
    batch: int = 0  # sequences decoded together (batched rows), 0 for single-sequence rows
    step_bytes: float = 0.0  # bytes read per decode step (weights + KV at the mean context); 0 for pp
    depth: int = 0  # tokens already in the cache when the row's prefill or decoding starts
    spec: dict | None = None  # speculative rows: proposer, k, acceptance, tokens a verification step

    @property
    def mean(self) -> float:
        return statistics.fmean(self.runs)

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    @property
    def stdev(self) -> float:
        return statistics.stdev(self.runs) if len(self.runs) > 1 else 0.0

    @property
    def gbs(self) -> float | None:
        """Bytes read per decode step x decode steps per second (mean), in GB/s; None for pp."""
        if not self.step_bytes:
            return None
        return self.step_bytes * self.mean / max(self.batch, 1) / 1e9

    def as_dict(self, bandwidth: float | None = None) -> dict:
        gbs = self.gbs
        return {"test": self.test, "mode": self.mode, "batch": self.batch, "depth": self.depth, "tokens": self.tokens,
                "mean": self.mean, "median": self.median, "stdev": self.stdev, "runs": list(self.runs),
                "step_bytes": self.step_bytes or None, "gbs": gbs,
                "share": gbs / bandwidth if gbs is not None and bandwidth else None,
                **({"spec": self.spec} if self.spec else {})}


def _sync(backend) -> None:
    stream = getattr(backend, "stream", None)
    if stream is not None:
        stream.synchronize()


def _on_device(backend) -> bool:
    """Whether the backend decodes on the device (CUDA: run_steps) or through the host loop."""
    return hasattr(backend, "run_steps")


def _graphed(backend, graph: bool) -> str:
    return "graph" if graph and getattr(backend, "use_graph", False) else "eager"


def single_slot(backend, n_tokens: int) -> None:
    """Pages for n_tokens in slot 0 of a paged KV cache (a CUDA backend built for many sequences
    reserves none at load, and batched rows release them); a no-op elsewhere."""
    kv = getattr(backend, "kv", None)
    if kv is not None:
        kv.reserve(0, n_tokens, stream=backend.stream)


GREEDY = SamplingParams(temperature=0.0)


class _PrefillGraphs:
    """Prefill graphs on or off while a block runs (backends without them: a no-op); ``mode`` is
    the row's label afterwards ("eager" when the backend has none, or a capture failed)."""

    def __init__(self, backend, on: bool) -> None:
        self.backend, self.on = backend, on

    def __enter__(self) -> "_PrefillGraphs":
        self.saved = getattr(self.backend, "prefill_graph", None)
        self.set_to = self.on and bool(getattr(self.backend, "use_graph", False))
        if self.saved is not None:
            self.backend.prefill_graph = self.set_to
        return self

    @property
    def mode(self) -> str:
        return "graph" if getattr(self.backend, "prefill_graph", False) else "eager"

    def __exit__(self, *exc) -> None:
        if self.saved is not None:  # a failed capture (set_to, now off) turns them off for good
            failed = self.set_to and not self.backend.prefill_graph
            self.backend.prefill_graph = False if failed else self.saved


def fill_depth(backend, depth: int, seed: int = 0) -> None:
    """``depth`` random tokens into slot 0's cache (not timed): what the depth rows start from."""
    backend.truncate(0)
    if depth:
        rng = np.random.default_rng(seed + 1)
        backend.prefill(rng.integers(10, backend.cfg.n_vocab, depth).tolist())
        _sync(backend)


def _at(test: str, depth: int) -> str:
    return f"{test} @ d{depth}" if depth else test


def prefill_rate(backend, n: int = 512, reps: int = 5, seed: int = 0, graph: bool = False, depth: int = 0) -> Rate:
    """Prompt processing of n random tokens after ``depth`` tokens of cache (fill_depth first).
    With graph: the first run is eager and the second captures the graph (a padded size's second
    use), so both are warm-up."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(10, backend.cfg.n_vocab, n).tolist()
    runs = []
    with _PrefillGraphs(backend, graph) as pg:
        warm = 2 if pg.mode == "graph" else 1
        for r in range(reps + warm):
            backend.truncate(depth)
            _sync(backend)
            t0 = time.perf_counter()
            backend.prefill(ids)
            _sync(backend)
            if r >= warm:
                runs.append(n / (time.perf_counter() - t0))
        mode = pg.mode
    return Rate(_at(f"pp{n}", depth), mode, n, runs, depth=depth)


def _decode(backend, n: int, history: list[int], graph: bool, params: SamplingParams = GREEDY) -> None:
    """n decode steps after a prefill (each evaluates one token and samples the next)."""
    if _on_device(backend):
        backend.run_steps(n, params, graph=graph)
    else:
        for _ in backend.sample_loop(n + 1, params, history, frozenset()):  # n + 1 tokens, n evals
            pass


def _start(backend, prompt: list[int], params: SamplingParams = GREEDY, keep: int = 0) -> None:
    """Prefill the prompt after the cache's first ``keep`` tokens (CUDA: and sample the first
    token on the device)."""
    if _on_device(backend):
        backend.start_decode(prompt, params, seed=params.seed or 0, keep=keep)
    else:
        backend.truncate(keep)
        backend.prefill(prompt)


def decode_rate(backend, n: int = 128, reps: int = 5, graph: bool = False, params: SamplingParams = GREEDY,
                depth: int = 0) -> Rate:
    """Generation of n tokens after a one-token prompt at ``depth`` (fill_depth first; CUDA:
    sampling on the device); greedy unless ``params`` says otherwise (mode "graph, sampled")."""
    runs = []
    for r in range(reps + 1):
        _start(backend, [1], params, keep=depth)
        _sync(backend)
        t0 = time.perf_counter()
        _decode(backend, n, [1], graph, params)
        _sync(backend)
        if r:
            runs.append(n / (time.perf_counter() - t0))
    return Rate(_at(f"tg{n}", depth), _graphed(backend, graph) + ("" if params.greedy else ", sampled"), n, runs,
                depth=depth)


SPEC_VARIANTS = ("ngram", "oracle", "zero")  # gguf-run bench --spec


def spec_rate(backend, variant: str, n: int = 128, k: int = 4, reps: int = 5, depth: int = 0) -> Rate:
    """Greedy generation of n tokens after a one-token prompt at ``depth`` (the prompt untimed, as
    decode_rate's) by speculative decoding (engine/speculative.py) with proposals from ``variant``:
    "ngram" (prompt lookup), "oracle" (the speculative path's own greedy output replayed: every
    proposal kept, the mechanism's bound), "zero" (always wrong: none kept, its cost). The row's spec
    dict: acceptance, tokens a verification step, and ``parts_at``: the first token where the text
    differs from the plain loop's (None: the same).
    Past the decode matvecs' rows (big models) the verification's tensor-core products may round a
    near tie the other way than the one-row decode step, so a difference is reported, not raised;
    the tests hold the equality."""
    from ..engine.decode_loop import sample_loop
    from ..engine.speculative import first_k, ngram_propose, speculative_loop

    def fresh() -> None:
        backend.truncate(depth)
        backend.prefill([1])
        _sync(backend)

    def run(propose, stats: dict | None = None) -> list[int]:  # (after fresh(): the prompt is not timed)
        return list(speculative_loop(backend, n, GREEDY, [1], frozenset(), k=k, propose=propose, stats=stats))

    fresh()
    ref = list(sample_loop(backend, n, GREEDY, [1], frozenset()))  # the plain greedy output (warm-up too)
    n_vocab = getattr(getattr(backend, "cfg", None), "n_vocab", None) or max(ref) + 2
    own = ref
    if variant == "oracle":  # replayed until the speculative path gives back what it was proposed
        for _ in range(ORACLE_ROUNDS):
            fresh()
            out = run(lambda hist, kk, t=own: t[len(hist) - 1:len(hist) - 1 + kk])
            if out == own:
                break
            own = out
    proposers = {"ngram": ngram_propose,
                 "oracle": lambda hist, kk: own[len(hist) - 1:len(hist) - 1 + kk],
                 "zero": lambda hist, kk: [(ref[min(len(hist) - 1, len(ref) - 1)] + 1) % n_vocab] * kk}
    runs, st = [], {}
    steps = accepted = proposed = plain = 0
    parts_at = None
    for r in range(reps + 1):
        st = {}
        fresh()
        t0 = time.perf_counter()
        out = run(proposers[variant], st)
        _sync(backend)
        if r:
            runs.append(n / (time.perf_counter() - t0))
            steps, accepted = steps + st["steps"], accepted + st["accepted"]
            proposed, plain = proposed + st["proposed"], plain + st["plain"]
        if out != ref and parts_at is None:
            parts_at = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
    k0 = first_k(backend, k).k  # the first proposals' size (the GPU's: 1, 3 or 7)
    spec = {"proposer": variant, "k": k0, "acceptance": accepted / proposed if proposed else 0.0,
            "tokens_per_step": (accepted + steps) / steps if steps else 1.0,
            "plain_share": plain / (n * reps), "parts_at": parts_at}
    mode = f"spec {variant} k={k0}: {spec['acceptance']:.0%} kept, {spec['tokens_per_step']:.2f} a step"
    if parts_at is not None:
        mode += f", text parts from plain at token {parts_at}"
    return Rate(_at(f"tg{n}", depth), mode, n, runs, depth=depth, spec=spec)


ORACLE_ROUNDS = 64  # speculative runs to find the oracle's text (each fixes at least one more token)


def prompt_gen_rates(backend, prompts: Sequence[list[int]], n_gen: int, graph: bool = True,
                     n_prompt: int | None = None) -> tuple[Rate, Rate]:
    """As a server answers a request: prefill each prompt from an empty cache, then generate n_gen
    tokens greedily; prompts[0] warms up. (prompt eval, eval) rates, like Ollama's two figures."""
    single_slot(backend, max(len(p) for p in prompts) + n_gen + 1)
    pp, tg = [], []
    with _PrefillGraphs(backend, graph) as pg:
        for r, ids in enumerate(prompts):
            _sync(backend)
            t0 = time.perf_counter()
            _start(backend, list(ids))
            _sync(backend)
            t1 = time.perf_counter()
            _decode(backend, n_gen, list(ids), graph)
            _sync(backend)
            if r:
                pp.append(len(ids) / (t1 - t0))
                tg.append(n_gen / (time.perf_counter() - t1))
        mode = pg.mode
    n = n_prompt or len(prompts[-1])
    return Rate(f"pp{n}", mode, n, pp), Rate(f"tg{n_gen}", _graphed(backend, graph), n_gen, tg)


def batch_rate(backend, batch: int, prompt: int = BATCH_PROMPT, gen: int = 128, reps: int = 3, seed: int = 0,
               graph: bool | None = None, params: SamplingParams = GREEDY) -> Rate:
    """Generated tokens per second over all sequences, as llama-batched-bench's S_TG: ``batch``
    sequences of ``prompt`` random tokens are admitted (prefill, not timed), then ``gen`` batch
    decode steps are timed (the bucket's graph, or eager launches with graph=False); greedy unless
    ``params`` says otherwise (mode "graph, sampled": every row sampled as a server's request is)."""
    ring = len(getattr(backend, "ring", ())) or 64  # the pinned token ring's length
    rng = np.random.default_rng(seed)
    saved = backend.use_graph
    if graph is False:
        backend.use_graph = False
    try:
        runs = []
        for r in range(reps + 1):
            prompts = [rng.integers(10, backend.cfg.n_vocab, prompt).tolist() for _ in range(batch)]
            for s, p in enumerate(prompts):
                backend.seq_add(s, p, params, gen + 1)
            _sync(backend)
            t0 = time.perf_counter()
            for i in range(gen):
                backend.batch_step(batch)
                if i % (ring // 2) == ring // 2 - 1:  # keep the ring from lapping (as a server would read it)
                    _sync(backend)
            _sync(backend)
            dt = time.perf_counter() - t0
            for s in range(batch):
                backend.seq_release(s)
            if r:
                runs.append(batch * gen / dt)
        mode = "graph" if backend.use_graph else "eager"
    finally:
        if graph is False:  # (a failed capture turns graphs off for good: that is kept)
            backend.use_graph = saved
    return Rate(f"B={batch} tg{gen}", mode + ("" if params.greedy else ", sampled"), batch * gen, runs, batch=batch)


# ---- bytes and bandwidth ------------------------------------------------------------------------
def weight_bytes_read(f, cfg: ModelConfig, backend_name: str) -> int:
    """Weight bytes one decode step reads: every tensor the model uses, as the backend holds it
    (GGUF's quantized bytes on cuda, float32 on numpy), less the embedding table when the output
    head is another tensor (a step reads one of its rows); of stacked experts a token reads its
    n_expert_used."""
    total = 0
    for name in model_tensors(cfg):
        if name == "token_embd.weight" and not cfg.tied_embeddings:
            continue
        t = f.tensors[name]
        n = t.n_elems * 4 if backend_name == "numpy" else t.nbytes
        total += n * cfg.n_expert_used // cfg.n_expert if name.endswith("_exps.weight") else n
    return total


def kv_bytes_read(cfg: ModelConfig, ctx: float, elem: int = 4) -> float:
    """K and V bytes attention reads at context ``ctx`` (caches of ``elem``-byte elements;
    windowed layers capped)."""
    per_layer = cfg.n_head_kv * (cfg.head_dim + cfg.head_dim_v) * elem
    windows = cfg.layer_window or (0,) * cfg.n_layer
    return sum(per_layer * (min(ctx, w) if w else ctx) for w in windows)


def device_bandwidth(backend_name: str) -> tuple[float, str]:
    """(GB/s, how it was measured): a copy's bytes read + written per second, best of a few."""
    if backend_name == "cuda":
        import cupy as cp

        a = cp.empty(512 << 20, cp.uint8)
        b = cp.empty_like(a)
        cp.copyto(b, a)
        cp.cuda.runtime.deviceSynchronize()
        ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
        ev0.record()
        for _ in range(10):
            cp.copyto(b, a)
        ev1.record()
        ev1.synchronize()
        gbs = 2 * 10 * a.nbytes / (cp.cuda.get_elapsed_time(ev0, ev1) / 1e3) / 1e9
        del a, b
        cp.get_default_memory_pool().free_all_blocks()
        return gbs, "device-to-device copy (cupy)"
    a = np.ones(128 << 20, np.uint8)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(4):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.nbytes / best / 1e9, "host memcpy (numpy)"


def device_name(backend_name: str) -> str:
    if backend_name == "cuda":
        import cupy as cp

        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        name = props["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPU threads"


# ---- the suite `gguf-run bench` runs --------------------------------------------------------------
@dataclass
class Suite:
    n_prompt: int = 512
    n_gen: int = 128
    reps: int = 5
    modes: tuple[str, ...] = ("graph", "eager")  # of the pp, tg and batched rows
    batches: tuple[int, ...] = ()
    seed: int = 0
    sampled: bool = True  # with graphs on a GPU: one more tg row with the CLI's default sampling
    depths: tuple[int, ...] = (0,)  # tokens in the cache before the pp and tg rows (llama-bench -d)
    spec: tuple[str, ...] = ()  # speculative tg rows (SPEC_VARIANTS) at each depth, k = spec_k
    spec_k: int = 4

    def n_rows(self) -> int:
        pp = len(self.modes) if self.n_prompt > 0 else 0
        tg = len(self.modes) + (self.sampled and "graph" in self.modes) + len(self.spec) if self.n_gen > 0 else 0
        batched = (len(self.modes) + (self.sampled and "graph" in self.modes)) * len(self.batches) \
            if self.n_gen > 0 else 0
        return (pp + tg) * len(self.depths) + batched


def run_suite(backend, f, cfg: ModelConfig, suite: Suite, progress: ProgressFn | None = None) -> list[Rate]:
    """pp and tg per mode, then batched tg per mode and batch size; rows carry the bytes one
    decode step reads, for GB/s."""
    name = getattr(backend, "name", "numpy")
    weights = weight_bytes_read(f, cfg, name)
    keys = getattr(getattr(backend, "kv", None), "k", None)
    elem = keys.itemsize if keys is not None else 4  # the CUDA cache's type; numpy's caches are float32
    rows: list[Rate] = []
    total = suite.n_rows()

    def done(rate: Rate) -> None:
        rows.append(rate)
        if progress:
            progress("benchmarking", len(rows), total)

    if suite.n_prompt > 0 or suite.n_gen > 0:
        single_slot(backend, max(suite.depths) + max(suite.n_prompt, suite.n_gen + 1))
    for depth in suite.depths:
        fill_depth(backend, depth, suite.seed)
        if suite.n_prompt > 0:
            for mode in suite.modes:
                done(prefill_rate(backend, suite.n_prompt, suite.reps, suite.seed, graph=mode == "graph", depth=depth))
        if suite.n_gen > 0:
            step = weights + kv_bytes_read(cfg, depth + 1 + (suite.n_gen + 1) / 2, elem)
            for mode in suite.modes:
                r = decode_rate(backend, suite.n_gen, suite.reps, graph=mode == "graph", depth=depth)
                r.step_bytes = step
                done(r)
            for variant in suite.spec:  # (no GB/s: a verification step reads the weights once for several tokens)
                done(spec_rate(backend, variant, suite.n_gen, suite.spec_k, suite.reps, depth))
            if suite.sampled and "graph" in suite.modes and _on_device(backend):
                # temperature 0.8, top-k 40, top-p 0.95, min-p 0.05 on the device: the sampler's cost
                r = decode_rate(backend, suite.n_gen, suite.reps, graph=True, params=SamplingParams(seed=suite.seed),
                                depth=depth)
                r.step_bytes = step
                done(r)
    if suite.batches and suite.n_gen > 0:
        if not hasattr(backend, "seq_add"):
            raise BackendError("batched generation (--batch) needs the cuda backend")
        backend.seq_release(0)  # slot 0's pages go back to the pool
        ctx = BATCH_PROMPT + (suite.n_gen + 1) / 2
        for mode in suite.modes:
            for b in suite.batches:
                r = batch_rate(backend, b, BATCH_PROMPT, suite.n_gen, suite.reps, suite.seed, graph=mode == "graph")
                r.step_bytes = weights + b * kv_bytes_read(cfg, ctx, elem)
                done(r)
        if suite.sampled and "graph" in suite.modes and _on_device(backend):
            for b in suite.batches:  # the CLI's default sampling in every row: a server's requests' cost
                r = batch_rate(backend, b, BATCH_PROMPT, suite.n_gen, suite.reps, suite.seed, graph=True,
                               params=SamplingParams(seed=suite.seed))
                r.step_bytes = weights + b * kv_bytes_read(cfg, ctx, elem)
                done(r)
    return rows
