"""`gguf-run synth`: write a shape twin (a real model's header, random well-formed weights)."""

from __future__ import annotations

from typing import Optional

import typer

from ..format.model_info import human_bytes
from ..tools.synth import PRESETS, WEIGHT_SCALE, SynthError, build_preset_header, layout_of, write_header, write_twin
from .app import app
from .options import Quiet
from .progress import progress_bars


def _list_presets() -> None:
    """One line per preset: name, twin size, description (or why it is unavailable here)."""
    for name, p in PRESETS.items():
        try:
            size, note = human_bytes(layout_of(build_preset_header(name)).size), ""
        except SynthError as e:
            size, note = "n/a", f" [unavailable: {e}]"
        print(f"{name:<22}{size:>12}  {p.description}{note}")


@app.command("synth", epilog="Examples:\n\n"
             "  gguf-run synth --like model.gguf -o model.twin.gguf\n\n"
             "  gguf-run synth --preset llama3-8b-q4_k_m --header-only -o llama3-8b.hdr.gguf\n\n"
             "  gguf-run synth --fill llama3-8b.hdr.gguf -o /tmp/llama3-8b.twin.gguf --seed 1\n\n"
             "  gguf-run synth --list-presets")
def synth(
    like: Optional[str] = typer.Option(None, "--like", metavar="REAL.gguf",
                                       help="copy this model's header (metadata, tokenizer, tensor table)"),
    preset: Optional[str] = typer.Option(None, "--preset", metavar="NAME", help="a built-in layout (--list-presets)"),
    fill: Optional[str] = typer.Option(None, "--fill", metavar="HEADER",
                                       help="fill the weights of a header-only file (made with --header-only)"),
    output: Optional[str] = typer.Option(None, "-o", "--output", metavar="OUT.gguf", help="file to write"),
    header_only: bool = typer.Option(False, "--header-only",
                                     help="write only the header (bytes up to the tensor data); a few MB"),
    seed: int = typer.Option(0, "--seed", min=0, help="random seed (same seed and header, same bytes)"),
    scale: float = typer.Option(WEIGHT_SCALE, "--scale", help="RMS of the random weights"),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="worker threads (default: all CPUs)"),
    list_presets: bool = typer.Option(False, "--list-presets", help="print the presets with their sizes and exit"),
    quiet: bool = Quiet,
) -> None:
    """Write a shape twin: a model's exact GGUF header with random but well-formed weights.

    It loads and times like the real model; only its header needs to be shipped (--header-only,
    then --fill where the twin is needed).
    """
    if list_presets:
        _list_presets()
        return
    sources = [(opt, v) for opt, v in (("--like", like), ("--preset", preset), ("--fill", fill)) if v is not None]
    if len(sources) != 1:
        raise SynthError("give exactly one of --like REAL.gguf, --preset NAME, --fill HEADER"
                         + (f" (got {' and '.join(o for o, _ in sources)})" if sources else ""))
    if not output:
        raise SynthError("give the output file with -o OUT.gguf")
    src = build_preset_header(preset) if preset is not None else (like or fill)
    if header_only:
        lay = write_header(src, output)
        print(f"wrote {output}: header only, {human_bytes(len(lay.header))}, {len(lay.tensors)} tensors "
              f"(the twin: {human_bytes(lay.size)})")
        return
    with progress_bars(quiet) as progress:
        r = write_twin(src, output, seed=seed, scale=scale, progress=progress, threads=threads)
    print(f"wrote {r.path}: {human_bytes(r.size)}, {r.n_tensors} tensors, seed {seed}, {r.seconds:.1f} s")
