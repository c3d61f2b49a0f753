"""`gguf-run perplexity`: a model's perplexity over a text file (as llama-perplexity)."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from ..engine.engine import Engine
from ..errors import GGUFRunError
from ..tools.perplexity import PATHS, perplexity
from .app import app
from .options import Backend, CacheTypeK, CacheTypeV, ModelArg, Quiet, kv_types, note_printer, resolve_model
from .progress import progress_bars


@app.command("perplexity", epilog="""Examples:\n
gguf-run perplexity model.gguf -f wiki.test.raw\n
gguf-run perplexity model.gguf -f wiki.test.raw -c 512 --chunks 20 --path both""")
def perplexity_cmd(
    model: Optional[str] = ModelArg,
    text_file: str = typer.Option(..., "-f", "--file", help="the text (UTF-8; '-': standard input)"),
    ctx: int = typer.Option(512, "-c", "--ctx-size", min=16, help="tokens a chunk (the second half is scored)"),
    chunks: int = typer.Option(0, "--chunks", min=0, help="chunks to score at most (0: every whole chunk)"),
    path: str = typer.Option("prefill", "--path", metavar="prefill|decode|both",
                             help="evaluate chunks as prompt rows, one token per call (as generation), or both"),
    backend: str = Backend,
    cache_type_k: str = CacheTypeK,
    cache_type_v: str = CacheTypeV,
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead"),
    quiet: bool = Quiet,
) -> None:
    """Perplexity of MODEL over a text, as llama-perplexity computes it: chunks of -c tokens from an
    empty cache, BOS first, the second half of each scored."""
    kv = kv_types(cache_type_k, cache_type_v)
    paths = PATHS if path == "both" else (path,)
    if path != "both" and path not in PATHS:
        raise typer.BadParameter(f"{path!r} is not one of prefill, decode, both", param_hint="'--path'")
    if text_file == "-":
        text = sys.stdin.read()
    else:
        try:
            with open(text_file, encoding="utf-8", errors="replace") as fh:
                text = fh.read()
        except OSError as e:
            raise GGUFRunError(f"{text_file}: cannot be read ({e.strerror or e})") from None
    note = note_printer(quiet)
    with progress_bars(quiet) as progress:
        eng = Engine(resolve_model(model), backend=backend, n_ctx=ctx, progress=progress, note=note, kv_types=kv)
    tok = eng.tokenizer
    ids = tok.encode(text, add_special=False)
    bos = tok.bos_id if tok.add_bos and tok.bos_id is not None and tok.bos_id >= 0 else None
    results = []
    for p in paths:
        def show(r, p=p):
            if not quiet and not as_json:
                print(f"[{r.chunks}]{r.value:.4f}", end=" " if r.chunks % 10 else "\n", file=sys.stderr, flush=True)
        r = perplexity(eng.backend, ids, ctx, bos, p, chunks, progress=show)
        if not quiet and not as_json:
            print(file=sys.stderr)
        results.append(r)
    if as_json:
        print(json.dumps({"model": eng.path, "backend": getattr(eng.backend, "name", "numpy"), "text_tokens": len(ids),
                          "results": [r.as_dict() for r in results]}, indent=1))
        return
    for r in results:
        print(f"PPL = {r.value:.4f} +/- {r.error:.4f} ({r.path}, {r.n_ctx} tokens a chunk, {r.chunks} chunks, "
              f"{r.scored:,} tokens scored)")
