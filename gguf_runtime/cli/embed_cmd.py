"""`gguf-run embed`: print the embeddings of texts."""

from __future__ import annotations

import json
import sys
from typing import List, Optional

import typer

from ..engine.engine import Engine
from ..server.embeddings import floats
from .app import app
from .options import Backend, CtxSize, Quiet, note_printer, resolve_model
from .progress import progress_bars


@app.command("embed", epilog="Examples:\n\n  gguf-run embed model.gguf 'The sky is blue' 'Grass is green'\n\n"
             "  gguf-run embed model.gguf 'Some text' --dimensions 64 --json\n\n"
             "  cat notes.txt | gguf-run embed model.gguf -")
def embed(
    model: str = typer.Argument(..., help="GGUF model file (or a name of the Ollama store)"),
    texts: List[str] = typer.Argument(..., help="texts to embed, each its own sequence ('-': standard input)"),
    truncate: bool = typer.Option(True, "--truncate/--no-truncate",
                                  help="cut a text longer than the context to it (else: an error)"),
    dimensions: Optional[int] = typer.Option(None, "--dimensions", min=1, help="keep each vector's first N values "
                                                                         "(normalized again)"),
    ctx_size: Optional[int] = CtxSize,
    backend: str = Backend,
    as_json: bool = typer.Option(False, "--json", help="print one JSON object (model, embeddings, token counts)"),
    quiet: bool = Quiet,
) -> None:
    """Print one JSON array per TEXT: its embedding (final hidden states pooled as the model's
    pooling_type says, the last token for a decoder LLM; L2-normalized, as Ollama's /api/embed)."""
    if texts.count("-") > 1:
        raise typer.BadParameter("standard input can be read once: give '-' at most once", param_hint="TEXTS")
    texts = [sys.stdin.read() if t == "-" else t for t in texts]
    path = resolve_model(model)
    with progress_bars(quiet) as progress:
        eng = Engine(path, backend=backend, n_ctx=ctx_size, progress=progress, note=note_printer(quiet))
    out = eng.embed(texts, truncate=truncate, dimensions=dimensions)
    if as_json:
        print(json.dumps({"model": path, "pooling": out.pooling, "embeddings": [floats(v) for v in out.vectors],
                          "prompt_eval_count": out.tokens}))
    else:
        for v in out.vectors:
            print(json.dumps(floats(v)))
