"""`gguf-run list`: the models a name can load (format/model_store.py), as `ollama list` prints them."""

from __future__ import annotations

import time
from typing import Optional

import typer

from ..errors import GGUFRunError
from ..format.gguf_file import open_gguf
from ..format.model_info import human_bytes, quant_histogram
from ..format.model_store import list_models, ollama_dir
from .app import app
from .info_cmd import out
from .options import models_folder


def _describe(path: str) -> tuple[str, str]:
    """(family, main quant type) from a GGUF header; '?' where the file does not read."""
    try:
        with open_gguf(path, check_data=False) as f:
            hist = [r for r in quant_histogram(f) if r.type_name not in ("F32",)] or quant_histogram(f)
            return str(f.metadata.get("general.architecture", "?")), hist[0].type_name if hist else "?"
    except (GGUFRunError, OSError):
        return "?", "?"


@app.command("list", epilog="Examples:\n\n  gguf-run list\n\n  gguf-run list --models ~/gguf")
def list_cmd(
    models: Optional[str] = typer.Option(None, "--models", metavar="DIR",
                                         help="a folder of .gguf files, named by their stems, beside the Ollama store"),
) -> None:
    """List the models gguf-run can load by name: a --models folder's files and the local Ollama
    store ($OLLAMA_MODELS or ~/.ollama/models, read-only)."""
    rows = list_models(models_folder(models))
    if not rows:
        out(f"no models in {ollama_dir()}" + (f" or {models}" if models else ""))
        return
    width = max(len(m.name) for m in rows)
    out(f"{'NAME':<{width}}  {'SIZE':>10}  {'QUANT':<8}{'FAMILY':<10}MODIFIED")
    for m in rows:
        family, quant = _describe(str(m.path))
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(m.modified))
        out(f"{m.name:<{width}}  {human_bytes(m.size):>10}  {quant:<8}{family:<10}{when}")
