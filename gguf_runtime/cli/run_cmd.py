"""`gguf-run run`: stream one completion."""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

import typer

from ..engine.constraint import compile_grammar
from ..engine.engine import Engine
from ..errors import GGUFRunError
from . import chat_cmd  # the module: its `chat` may not be defined yet while typer registers commands
from .app import app
from .options import (TensorParallel, N_PREDICT_DEFAULT, Backend, CacheTypeK, CacheTypeV, CtxSize, MinP, ModelArg, NoGraph, NPredict,
                      Quiet, RepeatPenalty, Seed, Draft, SpecK, SpecMode, Temp, TopK, TopP, check_n_predict, kv_types,
                      note_printer, resolve_model, sampling_params, spec_choice)
from .progress import progress_bars
from .stats import print_stats
from .thinking import NoThink, Think, ThinkingPrinter, answer_parser, think_choice, think_vars

HideThinking = typer.Option(False, "--hide-thinking", help="print a thinking model's answer without its reasoning")


@app.command("run", epilog="Examples:\n\n  gguf-run --prompt 'Write a haiku about GPUs'\n\n"
             "  gguf-run model.gguf -p 'def fibonacci(n):' --raw --temp 0 -n 64 --verbose\n\n"
             "  echo 'Summarize: ...' | gguf-run model.gguf")
def run(
    model: Optional[str] = ModelArg,
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="the prompt (default: read stdin)"),
    n_predict: int = NPredict,
    temp: float = Temp,
    top_k: int = TopK,
    top_p: float = TopP,
    min_p: float = MinP,
    repeat_penalty: float = RepeatPenalty,
    seed: Optional[int] = Seed,
    ctx_size: Optional[int] = CtxSize,
    chat: Optional[bool] = typer.Option(None, "--chat/--raw",
                                        help="apply the model's chat template, or not (default: chat when "
                                             "the file has a template)"),
    system: Optional[str] = typer.Option(None, "--system", help="system message (chat mode)"),
    think: Optional[str] = Think,
    no_think: bool = NoThink,
    hide_thinking: bool = HideThinking,
    backend: str = Backend,
    cache_type_k: str = CacheTypeK,
    cache_type_v: str = CacheTypeV,
    tensor_parallel: int = TensorParallel,
    no_graph: bool = NoGraph,
    verbose: bool = typer.Option(False, "--verbose", help="print timings like `ollama run --verbose`"),
    quiet: bool = Quiet,
    json_schema: Optional[str] = typer.Option(None, "--json-schema", "-j",
                                              help="output JSON valid against this schema: a file, or the schema "
                                                   "itself ('{...}'); '{}' for any JSON"),
    grammar: Optional[str] = typer.Option(None, "--grammar", help="output that this grammar file allows (GBNF, as "
                                                                  "llama.cpp's grammars/, or Lark)"),
    spec_mode: str = SpecMode,
    spec_k: int = SpecK,
    draft: Optional[str] = Draft,
) -> None:
    """Stream a completion of PROMPT (default model when MODEL is omitted); with no prompt in a
    terminal, start a chat (`gguf-run chat`)."""
    check_n_predict(n_predict)
    thinks = think_choice(think, no_think)
    spec_mode = spec_choice(spec_mode, spec_k, draft)
    if spec_mode != "none" and (json_schema is not None or grammar is not None):
        raise GGUFRunError("--spec and a grammar (--json-schema, --grammar) do not combine yet; drop one")
    if json_schema is not None and grammar is not None:
        raise GGUFRunError("give --json-schema or --grammar, not both")
    if chat is False and system is not None:
        raise GGUFRunError("--system goes with the chat template, and --raw sends the prompt as it is; drop one")
    if chat is False and (thinks is not None or hide_thinking):
        flag = ("--hide-thinking" if thinks is None else "--no-think" if thinks is False
                else "--think" if thinks is True else f"--think={thinks}")
        raise GGUFRunError(f"{flag} goes with the chat template, and --raw sends the prompt as it is; drop one")
    spec = read_grammar_spec(json_schema, grammar)
    if spec:
        compile_grammar(*spec)  # a schema or grammar it cannot use stops here, before the model loads
    params = sampling_params(temp, top_k, top_p, min_p, repeat_penalty, seed)
    kv = kv_types(cache_type_k, cache_type_v)
    if prompt is None and sys.stdin.isatty() and spec:
        raise GGUFRunError("--json-schema and --grammar shape one answer: give the prompt with -p or on stdin")
    if prompt is None and sys.stdin.isatty():  # a conversation, as `ollama run` starts; run's default -n -> chat's

        return chat_cmd.chat(model=model, n_predict=-1 if n_predict == N_PREDICT_DEFAULT else n_predict, temp=temp,
                         top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty, seed=seed,
                         ctx_size=ctx_size, system=system, backend=backend, cache_type_k=cache_type_k,
                         cache_type_v=cache_type_v, tensor_parallel=tensor_parallel, no_graph=no_graph,
                         verbose=verbose, quiet=quiet, spec_mode=spec_mode, spec_k=spec_k,
                         draft=draft, think=think, no_think=no_think, hide_thinking=hide_thinking)
    if prompt is None:
        prompt = sys.stdin.read()
    path = resolve_model(model)
    note = note_printer(quiet)
    with progress_bars(quiet) as progress:
        eng = Engine(path, backend=backend, n_ctx=ctx_size, progress=progress, note=note, use_graph=not no_graph,
                     kv_types=kv, tensor_parallel=tensor_parallel, draft=draft)
    use_chat = eng.has_template if chat is None else chat
    if use_chat and not eng.has_template and note:
        note("note: the model has no chat template; using a plain ChatML layout")
    parser = None  # a thinking model's: its reasoning printed apart from the answer
    if use_chat:
        variables = think_vars(eng, thinks, model or os.path.basename(path))
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        ids = eng.encode_chat(messages, **variables)
        parser = answer_parser(eng, ids, constrained=spec is not None)
    else:
        if thinks:  # the file has no template, so no reasoning to turn on
            think_vars(eng, thinks, model or os.path.basename(path))
        ids = eng.encode_raw(prompt)
    constraint = eng.constraint(*spec) if spec else None
    gen = eng.generate(ids, n_predict=n_predict, params=params, constraint=constraint, spec=spec_mode,
                       spec_k=spec_k)
    out = sys.stdout
    view = ThinkingPrinter(out, hide=hide_thinking) if parser is not None else None
    try:
        for piece in gen:
            if view is None:
                out.write(piece)
                out.flush()
            else:
                view.show(parser.feed(piece))
        if view is not None:
            view.show(parser.finish())
    except KeyboardInterrupt:  # what was generated stays; the stats cover it; exit 130
        out.write("\n")
        out.flush()
        if verbose:
            print_stats(gen.stats)
        raise
    out.write("\n")
    out.flush()
    if verbose:
        print_stats(gen.stats)


def read_grammar_spec(json_schema: str | None, grammar: str | None) -> tuple[str, str] | None:
    """(kind, text) of --json-schema (inline when it starts with '{', else a file) or --grammar (a
    file), read before the model loads so a missing file costs no load."""
    if json_schema is None and grammar is None:
        return None
    if json_schema is not None and json_schema.lstrip().startswith("{"):
        return "json_schema", json_schema
    path = json_schema if json_schema is not None else grammar
    if json_schema is not None and not os.path.exists(path):
        try:  # inline JSON that is not an object (a list, a string, true) rather than a missing file
            json.loads(json_schema)
        except ValueError:
            pass
        else:
            raise GGUFRunError(f"--json-schema {json_schema[:40]} is JSON but not an object: a schema is an object "
                               "such as '{\"type\": \"object\"}', or give its file")
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read(1 << 20)
    except (OSError, UnicodeDecodeError) as e:
        raise GGUFRunError(f"cannot read {path}: {e.strerror if isinstance(e, OSError) else e}") from None
    return ("json_schema" if json_schema is not None else "gbnf"), text
