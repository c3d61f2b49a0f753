"""`gguf-run info` and `gguf-run tokenize`: look inside a model file."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from ..format.blocks import BY_NAME, FORMATS
from ..errors import UnsupportedModelError
from ..format.gguf_file import open_gguf
from ..format.model_config import config_from_gguf
from ..format.model_info import human_bytes, human_count, model_info
from ..format.shard import ShardedFile, check_split
from ..format.tokenizer import Tokenizer
from ..errors import printable
from .app import app
from .options import ModelArg, resolve_model

ARCH_FIELDS = ("arch", "name", "n_layer", "n_embd", "n_ff", "n_head", "n_head_kv", "head_dim", "n_vocab",
               "n_ctx_train", "rope", "activation", "tied_embeddings", "embed_scale", "qk_norm", "attn_bias",
               "post_norms", "attn_softcap", "final_softcap", "layer_window")


def out(*parts: object) -> None:
    """print() with control characters escaped: a model file's strings must not drive the terminal."""
    print(*("\n".join(printable(line) for line in str(p).split("\n")) for p in parts))


@app.command("info", epilog="Examples:\n\n  gguf-run info\n\n  gguf-run info model.gguf --metadata\n\n"
             "  gguf-run info model.gguf -tp 2 --no-metadata")
def info(
    model: Optional[str] = ModelArg,
    metadata: bool = typer.Option(True, "--metadata/--no-metadata", help="print every metadata key"),
    tensor_parallel: int = typer.Option(1, "-tp", "--tensor-parallel", min=1, metavar="N",
                                        help="also what each of N GPUs would hold under -tp N (or why it cannot split)"),
) -> None:
    """Print a model's metadata, architecture summary, quant type histogram and sizes."""
    with open_gguf(resolve_model(model)) as f:
        i = model_info(f)
        split = _split_lines(f, tensor_parallel, i["architecture"], i["weight_bytes"]) if tensor_parallel > 1 else []
    out(f"file        {i['path']}")
    out(f"size        {human_bytes(i['file_bytes'])} (GGUF v{i['gguf_version']}, {i['n_tensors']} tensors)")
    out(f"parameters  {human_count(i['params'])} ({i['params']:,}), {human_bytes(i['weight_bytes'])} of "
          f"weights, {i['bits_per_weight']:.2f} bits/weight")
    out("\narchitecture")
    arch = i["architecture"]
    if isinstance(arch, str):
        out(f"  cannot run: {arch}")
    else:
        for k in ARCH_FIELDS:
            v = arch[k]
            if k == "layer_window":
                v = "none" if not any(v) else f"{sum(1 for w in v if w)} of {len(v)} layers local, window {max(v)}"
            elif k == "rope":
                v = ", ".join(f"{a}={b}" for a, b in v.items() if b is not None)
            out(f"  {k:<16}{v}")
        if arch.get("n_expert"):
            out(f"  {'experts':<16}{arch['n_expert']}, {arch['n_expert_used']} a token, {arch['n_ff_exp']} wide "
                f"({'renormalized' if arch['expert_norm'] else 'softmax'} weights)")
        per_token = _kv_elements(arch)
        train = arch["n_ctx_train"]
        out(f"  {'kv_cache':<16}{human_bytes(2 * per_token)} a token in f16, {human_bytes(4 * per_token)} in f32 "
            f"({human_bytes(2 * per_token * train)} / {human_bytes(4 * per_token * train)} at {train:,} tokens)")
        quant = [(n, FORMATS[BY_NAME[n.upper()]]) for n in ("q8_0", "q4_0")]  # -ctk / -ctv: blocks of 32
        out(" " * 18 + ", ".join(f"{human_bytes(per_token * f.block_bytes / f.block_elems)} in {n}" for n, f in quant)
            + " (" + " / ".join(human_bytes(per_token * f.block_bytes / f.block_elems * train) for _, f in quant)
            + f" at {train:,} tokens)")
    for line in split:
        out(line)
    out("\nquant types")
    out(f"  {'type':<8}{'tensors':>8}{'params':>12}{'size':>12}{'share':>8}")
    for r in i["quant"]:
        share = 100 * r.bytes / i["weight_bytes"] if i["weight_bytes"] else 0
        out(f"  {r.type_name:<8}{r.tensors:>8}{human_count(r.params):>12}{human_bytes(r.bytes):>12}{share:>7.1f}%")
    if metadata:
        out("\nmetadata")
        for k, v in i["metadata"].items():
            out(f"  {k} = {v}")


def _kv_elements(arch: dict) -> int:
    """K and V elements a token of context holds over every layer."""
    return arch["n_layer"] * arch["n_head_kv"] * (arch["head_dim"] + arch["head_dim_v"])


def _split_lines(f, world: int, arch, whole: int) -> list[str]:
    """What each GPU holds under -tp world: the largest rank's weights, the KV cache a token (its
    share of the KV heads); or the one line -tp would refuse it with."""
    head = f"\ntensor parallel over {world} GPUs"
    if isinstance(arch, str):
        return [head, f"  cannot run: {arch}"]
    cfg = config_from_gguf(f)
    try:
        check_split(f, cfg, world)
    except UnsupportedModelError as e:
        return [head, f"  cannot split: {e}"]
    parts = [ShardedFile(f, cfg, r, world) for r in range(world)]
    ranks = [sum(t.nbytes for t in p.tensors.values()) for p in parts]
    per_token = _kv_elements(arch) // world  # (check_split: the KV heads divide)
    weights = (f"  {'weights':<16}{human_bytes(max(ranks))} a GPU (the whole model: {human_bytes(whole)}; "
               "the embedding table and norms on every GPU)")
    lines = [head, weights, f"  {'kv_cache':<16}{human_bytes(2 * per_token)} a token a GPU in f16"]
    uneven = parts[0].split.uneven()
    if uneven:
        lines.append(f"  {'ffn_split':<16}{uneven}")
    if cfg.n_expert:
        lines.append(f"  {'note':<16}-tp refuses mixtures of experts until their split has run on GPUs")
    return lines


@app.command("tokenize", epilog="Examples:\n\n  gguf-run tokenize model.gguf 'Hello world'\n\n"
             "  gguf-run tokenize model.gguf '<|im_start|>user' --pieces --parse-special")
def tokenize(
    model: str = typer.Argument(..., help="GGUF model (or vocabulary) file"),
    text: str = typer.Argument(..., help="text to tokenize ('-': read standard input)"),
    pieces: bool = typer.Option(False, "--pieces", help="print each id with its text piece"),
    bos: bool = typer.Option(True, "--bos/--no-bos", help="add BOS/EOS as the file asks"),
    parse_special: bool = typer.Option(False, "--parse-special", help="turn special-token text into its id"),
    as_json: bool = typer.Option(False, "--json", help="print the ids as a JSON list"),
) -> None:
    """Print the token ids of TEXT under MODEL's tokenizer."""
    with open_gguf(model, check_data=False) as f:
        tok = Tokenizer.from_metadata(f.metadata)
    if text == "-":
        text = sys.stdin.read()
    ids = tok.encode(text, add_special=bos, parse_special=parse_special)
    if as_json:
        print(json.dumps(ids))
    elif pieces:
        for t in ids:
            print(f"{t:>8} -> {tok.token_to_piece(t)!r}")
    else:
        print(" ".join(map(str, ids)))
