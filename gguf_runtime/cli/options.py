"""Options shared by several commands (model, sampling, context, backend)."""

from __future__ import annotations

import os
import sys
from typing import Optional

import typer

from .default_model import default_model_path
from ..engine.engine import check_spec
from ..errors import GGUFRunError
from ..format.model_store import resolve
from ..sampling import SamplingParams

ModelArg = typer.Argument(None, metavar="[MODEL]", show_default=False,
                          help="GGUF model file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
N_PREDICT_DEFAULT = 256
BATCHES = (1, 2, 4, 8, 16, 32, 64)  # serve --max-batch's values: the batch decode graphs' sizes
NPredict = typer.Option(N_PREDICT_DEFAULT, "-n", "--n-predict", help="tokens to generate at most (-1: until the context is full)")
Temp = typer.Option(0.8, "--temp", min=0.0, help="temperature; 0 = greedy")
TopK = typer.Option(40, "--top-k", min=0, help="keep the k most likely tokens; 0 = off")
TopP = typer.Option(0.95, "--top-p", min=0.0, max=1.0, help="nucleus sampling threshold; 1 = off")
MinP = typer.Option(0.05, "--min-p", min=0.0, max=1.0, help="drop tokens below min-p x the top probability; 0 = off")
RepeatPenalty = typer.Option(1.0, "--repeat-penalty", min=0.0, help="penalize the last 64 tokens; 1 = off")
Seed = typer.Option(None, "--seed", min=0, help="random seed (same seed, same text)")
CtxSize = typer.Option(None, "-c", "--ctx-size", min=0,
                       help="context size in tokens (default: min(4096, the model's); 0: the model's own)")
Backend = typer.Option("auto", "--backend", help="auto | cuda | numpy (auto: cuda when a GPU and CuPy are there)")
Quiet = typer.Option(False, "--quiet", "-q", help="no progress bars or notes")
TensorParallel = typer.Option(1, "-tp", "--tensor-parallel", min=1, metavar="N",
                              help="cuda: split the model over N GPUs of this machine (one process a GPU, NCCL)")
SpecMode = typer.Option("none", "--spec", help="speculative decoding: none, ngram (tokens proposed by prompt "
                                               "lookup) or draft (by --draft's model), checked k at a time: the "
                                               "same greedy text")
Draft = typer.Option(None, "--draft", metavar="FILE", help="a smaller model of the same family proposing tokens "
                                                         "for --spec draft (implied when given)")
SpecK = typer.Option(4, "--spec-k", help="--spec: tokens proposed a step at most (adapts to acceptance)")
NoGraph = typer.Option(False, "--no-graph", help="cuda: launch kernels one by one instead of replaying CUDA graphs")
CACHE_TYPES = ("auto", "f16", "f32", "q8_0", "q4_0")
OTHER_CACHE_TYPES = ("q4_1", "q5_0", "q5_1", "iq4_nl", "bf16")  # llama.cpp's, not here
CacheTypeK = typer.Option("auto", "-ctk", "--cache-type-k",
                          help="KV cache type of the keys, auto | f16 | f32 | q8_0 | q4_0 (auto: f16; f32 for "
                               "heads over 128 wide; the cuda backend keeps keys and values in one type)")
CacheTypeV = typer.Option("auto", "-ctv", "--cache-type-v", help="KV cache type of the values (as -ctk)")


def models_folder(models: Optional[str]) -> Optional[str]:
    """--models as given, once it names a folder (a typo would otherwise list or serve nothing of it)."""
    if models is not None and not os.path.isdir(models):
        what = "is a file, not a folder" if os.path.exists(models) else "does not exist"
        raise GGUFRunError(f"--models {models} {what}: give a folder of .gguf files")
    return models


def resolve_model(model: Optional[str], models_dir: Optional[str] = None) -> str:
    """A file path, a file of the models folder, or an Ollama name (format/model_store.py); no
    model: the embedded default."""
    return resolve(model, models_dir) if model else default_model_path()


def kv_types(cache_type_k: str, cache_type_v: str) -> tuple[str, str]:
    """(keys, values) cache types from llama.cpp-style -ctk / -ctv; the backend says what it takes."""
    for hint, v in (("'-ctk' / '--cache-type-k'", cache_type_k), ("'-ctv' / '--cache-type-v'", cache_type_v)):
        if v in OTHER_CACHE_TYPES:
            raise typer.BadParameter(f"{v} KV caches are not supported; use f16, f32, q8_0 or q4_0", param_hint=hint)
        if v not in CACHE_TYPES:
            raise typer.BadParameter(f"{v!r} is not a KV cache type: {', '.join(CACHE_TYPES)}", param_hint=hint)
    return cache_type_k, cache_type_v


def spec_choice(spec_mode: str, spec_k: int, draft: Optional[str]) -> str:
    """The speculative mode of --spec / --spec-k / --draft (--draft alone means --spec draft); one
    line for a combination that cannot run, before any model loads."""
    if draft is not None and spec_mode == "none":
        spec_mode = "draft"
    check_spec(spec_mode, spec_k, draft is not None)
    if draft is not None and spec_mode != "draft":
        raise GGUFRunError(f"--draft goes with --spec draft, not --spec {spec_mode}; drop one")
    return spec_mode


def check_n_predict(n_predict: int) -> None:
    if n_predict < -1:
        raise typer.BadParameter("must be -1 (no limit) or more", param_hint="'-n' / '--n-predict'")


def sampling_params(temp: float, top_k: int, top_p: float, min_p: float, repeat_penalty: float,
                    seed: Optional[int]) -> SamplingParams:
    p = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                       repeat_penalty=repeat_penalty, seed=seed)
    try:
        p.validate()
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    return p


def note_printer(quiet: bool):
    if quiet:
        return None
    return lambda msg: print(msg, file=sys.stderr, flush=True)
