"""`gguf-run bench`: throughput as llama-bench reports it, and side by side with Ollama.

Measuring is ``gguf_runtime.bench`` (``run_suite``), printing ``gguf_runtime.bench_report``, the
Ollama client ``gguf_runtime.bench_ollama``. Everything that can be checked before the benchmark
(option values, matplotlib for --plot, the Ollama server and its model) is checked first.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Optional

import typer

from ..engine.backend_choice import BACKENDS, cuda_available
from ..tools.bench import BATCH_PROMPT, SPEC_VARIANTS, Suite, device_bandwidth, device_name, prompt_gen_rates, run_suite, weight_bytes_read
from ..tools.bench_ollama import DEFAULT_URL, Ollama, bench_prompts
from ..tools.bench_report import plot, render_table, result
from ..engine.engine import Engine
from ..errors import BackendError, GGUFRunError
from .app import app
from .options import (BATCHES, Backend, CacheTypeK, CacheTypeV, ModelArg, TensorParallel, Quiet, kv_types, note_printer,
                      resolve_model)
from .progress import progress_bars

MODES = {"both": ("graph", "eager"), "graph": ("graph",), "eager": ("eager",)}
MAX_BATCH = 64


def parse_batches(text: Optional[str]) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise typer.BadParameter(f"{text!r} is not a list of batch sizes like 1,8,32,64", param_hint="'--batch'")
    return tuple(sizes)


def parse_depths(text: Optional[str]) -> tuple[int, ...]:
    """-d "0,4096": whole numbers of tokens, in the order given (default: 0)."""
    if text is None:
        return (0,)
    try:
        depths = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a comma-separated list of token counts, e.g. 0,4096",
                                 param_hint="'-d'") from None
    if any(d < 0 for d in depths) or len(set(depths)) != len(depths):
        raise typer.BadParameter(f"{text!r}: give distinct token counts of 0 or more", param_hint="'-d'")
    return depths


def check_plot(path: str) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise GGUFRunError("--plot needs matplotlib: pip install 'gguf-run[plot]'") from None
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise GGUFRunError(f"--plot {path}: the folder {folder} does not exist")


@app.command("bench", epilog="Examples:\n\n"
             "  gguf-run bench\n\n"
             "  gguf-run bench model.gguf -p 512 -n 128 -r 5\n\n"
             "  gguf-run bench model.gguf --batch 1,8,32,64 --plot throughput.png\n\n"
             "  gguf-run bench model.gguf --json > bench.json\n\n"
             "  gguf-run bench model.gguf --ollama http://localhost:11434 --ollama-model llama3.1:8b")
def bench(
    model: Optional[str] = ModelArg,
    n_prompt: int = typer.Option(512, "-p", "--n-prompt", min=0, help="prompt tokens of the pp row (0: no pp row)"),
    n_gen: int = typer.Option(128, "-n", "--n-gen", min=0, help="generated tokens of the tg rows (0: no tg rows)"),
    reps: int = typer.Option(5, "-r", "--repetitions", min=1, help="timed runs per row (after one warm-up run)"),
    batch: Optional[str] = typer.Option(None, "--batch", metavar="LIST",
                                        help="batch sizes of batched-generation rows, e.g. 1,8,32,64 (cuda backend; "
                                             f"{BATCH_PROMPT}-token prompts, -n steps)"),
    mode: Optional[str] = typer.Option(None, "--mode", metavar="both|graph|eager",
                                       help="tg and batched rows with CUDA graph replay, eager launches, or both "
                                            "(default: both on cuda; numpy: eager)"),
    backend: str = Backend,
    cache_type_k: str = CacheTypeK,
    cache_type_v: str = CacheTypeV,
    tensor_parallel: int = TensorParallel,
    depth: Optional[str] = typer.Option(None, "-d", "--n-depth", metavar="LIST",
                                        help="tokens already in the cache before the pp and tg rows, e.g. "
                                             "0,4096,16384 (llama-bench's depth; default 0)"),
    ctx_size: Optional[int] = typer.Option(None, "-c", "--ctx-size", min=8,
                                           help="context size (default: what the rows need)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object (device, model, every run) instead"),
    plot_file: Optional[str] = typer.Option(None, "--plot", metavar="FILE.png",
                                            help="draw throughput against batch size, graph vs eager (matplotlib)"),
    ollama_url: Optional[str] = typer.Option(None, "--ollama", metavar="URL",
                                             help=f"also time the same prompts on this Ollama server (e.g. {DEFAULT_URL})"),
    ollama_model: Optional[str] = typer.Option(None, "--ollama-model", metavar="NAME",
                                               help="the Ollama model to compare with (as `ollama list` names it)"),
    seed: int = typer.Option(0, "--seed", min=0, help="seed of the random prompt tokens (and Ollama's sampler)"),
    spec: Optional[str] = typer.Option(None, "--spec", metavar="LIST",
                                       help="speculative tg rows: ngram (prompt lookup), oracle (replays the plain "
                                            "greedy output: the bound), zero (always wrong: the cost)"),
    spec_k: int = typer.Option(4, "--spec-k", min=1, max=16, help="--spec: tokens proposed a step at most"),
    quiet: bool = Quiet,
) -> None:
    """Measure prompt processing (pp) and generation (tg) speed, as llama-bench does.

    Rows: ppN (one N-token prefill), tgN (N greedy tokens after a one-token prompt) per mode, and
    with --batch "B=k tgN" (k sequences decoded together; tokens/s over all of them). t/s is the
    mean ± standard deviation of -r runs after a warm-up run; GB/s is the bytes a decode step reads
    times steps per second, and share its part of the bandwidth measured in the same run.
    """
    batches = parse_batches(batch)
    depths = parse_depths(depth)
    specs = tuple(v.strip() for v in spec.split(",") if v.strip()) if spec else ()
    bad = [v for v in specs if v not in SPEC_VARIANTS]
    if bad:
        raise typer.BadParameter(f"{bad[0]!r} is not one of {', '.join(SPEC_VARIANTS)}", param_hint="'--spec'")
    if specs and n_gen == 0:
        raise typer.BadParameter("speculative rows generate -n tokens: give -n above 0", param_hint="'--spec'")
    if mode is not None and mode not in MODES:
        raise typer.BadParameter(f"{mode!r} is not one of both, graph, eager", param_hint="'--mode'")
    if n_prompt == 0 and n_gen == 0:
        raise typer.BadParameter("nothing to measure: -p and -n are both 0", param_hint="'-p' / '-n'")
    if batches and n_gen == 0:
        raise typer.BadParameter("batched rows generate -n tokens: give -n above 0", param_hint="'--batch'")
    if backend not in BACKENDS:
        raise BackendError(f"unknown backend '{backend}'; choose one of {', '.join(BACKENDS)}")
    if plot_file:
        check_plot(plot_file)
    client = None
    if ollama_url or ollama_model:
        if not ollama_model:
            raise typer.BadParameter("--ollama needs --ollama-model NAME (as `ollama list` names it)",
                                     param_hint="'--ollama-model'")
        if n_prompt == 0 or n_gen == 0:
            raise typer.BadParameter("the Ollama comparison needs -p and -n above 0", param_hint="'--ollama'")
        client = Ollama(ollama_url or DEFAULT_URL, ollama_model)
    path = resolve_model(model)
    note = note_printer(quiet)
    ok, why = cuda_available() if backend != "numpy" else (False, "")
    if backend == "cuda" and not ok:
        raise BackendError(f"the cuda backend cannot run here: {why}; use --backend numpy")
    name = "cuda" if ok else "numpy"
    skipped: list[str] = []
    if name == "cuda":
        modes = MODES[mode or "both"]
        if batches and batches[-1] > MAX_BATCH:
            raise typer.BadParameter(f"batch sizes go up to {MAX_BATCH} on the cuda backend", param_hint="'--batch'")
    else:
        modes = ("eager",)
        if mode in ("graph", "both") and note:
            note("note: the numpy backend has no CUDA graphs; eager rows only")
        if batches:
            skipped.append(f"batched generation (--batch {','.join(map(str, batches))}) needs the cuda backend")
            print(f"note: {skipped[-1]}; those rows are skipped", file=sys.stderr, flush=True)
            batches = ()
    need = max(16, max(depths) + max(n_prompt, n_gen + 2), BATCH_PROMPT + n_gen + 1 if batches else 0,
               n_prompt + n_gen + 1 if client else 0)
    if ctx_size is not None and ctx_size < need:
        raise typer.BadParameter(f"{ctx_size} is too small for these rows: they need {need} tokens",
                                 param_hint="'-c' / '--ctx-size'")
    ctx = ctx_size or -(-need // 16) * 16
    if client:  # before any time goes into our own benchmark
        client.check()
    bandwidth, method = device_bandwidth(name)
    if tensor_parallel > 1 and bandwidth:  # a split model's byte limit: every GPU's
        bandwidth, method = bandwidth * tensor_parallel, f"{method}, times {tensor_parallel} GPUs"
    max_batch = next(b for b in BATCHES if b >= max(batches or (1,)))
    suite = Suite(n_prompt, n_gen, reps, modes, batches, seed, depths=depths, spec=specs, spec_k=spec_k)
    ollama = None
    with progress_bars(quiet) as progress:
        eng = Engine(path, backend=backend, n_ctx=ctx, progress=progress, note=note, use_graph="graph" in modes,
                     max_batch=max_batch, kv_types=kv_types(cache_type_k, cache_type_v),
                     tensor_parallel=tensor_parallel)
        be = eng.backend
        if batches and "graph" in modes:
            be.capture_buckets(progress=progress)
        rows = run_suite(be, eng.gguf, eng.cfg, suite, progress)
        if client:
            texts = bench_prompts(eng.tokenizer, n_prompt, reps + 1)
            ids = [eng.encode_raw(t) for t in texts]
            ours = prompt_gen_rates(be, ids, n_gen, graph="graph" in modes, n_prompt=n_prompt)
            theirs_pp, theirs_tg, load, answers = client.rates(texts, n_prompt, n_gen, seed, ctx)
            ollama = {"url": client.url, "model": client.model, "version": client.version, "n_prompts": reps,
                      "prompt_tokens": int(statistics.median(len(i) for i in ids[1:])), "n_gen": n_gen,
                      "seed": seed, "num_ctx": ctx, "gguf_run": [r.as_dict() for r in ours],
                      "ollama": [theirs_pp.as_dict(), theirs_tg.as_dict()],
                      "ollama_prompt_tokens": int(statistics.median(a["prompt_eval_count"] for a in answers[1:])),
                      "ollama_eval_tokens": int(statistics.median(a["eval_count"] for a in answers[1:])),
                      "load_s": {"gguf_run": eng.load_s, "ollama": load}, "answers": answers}
    settings = {"n_prompt": n_prompt, "n_gen": n_gen, "repetitions": reps, "batch": list(batches),
                "spec": list(specs), "spec_k": spec_k if specs else None,
                "depth": list(depths),
                "batch_prompt": BATCH_PROMPT if batches else None, "modes": list(modes), "n_ctx": ctx, "seed": seed,
                "tensor_parallel": tensor_parallel}
    split = f" x{tensor_parallel}" if tensor_parallel > 1 else ""
    res = result(f=eng.gguf, cfg=eng.cfg, path=path, backend=name + split, device=device_name(name) + split,
                 bandwidth=bandwidth,
                 bandwidth_method=method, weights_read=weight_bytes_read(eng.gguf, eng.cfg, name), rows=rows,
                 settings=settings, load_s=eng.load_s, skipped=skipped, ollama=ollama)
    if as_json:
        print(json.dumps(res, indent=1))
    else:
        print(render_table(res))
    if plot_file:
        plot(res, plot_file)
        if note:
            note(f"wrote {plot_file}")
