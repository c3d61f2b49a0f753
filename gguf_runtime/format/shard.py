"""One rank's part of a model split for tensor parallelism (Megatron's split, as vLLM and
llama.cpp's ``-sm tensor``): a ``ShardedFile`` that reads as a GGUF file of its own, and the
``ModelConfig`` of that part.

Rank r of N holds heads [r H/N, (r+1) H/N) and KV heads likewise, and a range of FFN rows: F/N
each ([r F/N, (r+1) F/N)) where that keeps down's columns on whole quant blocks, else whole blocks
as evenly as they go, the first ranks one more (Qwen3-30B-A3B's 768 Q6_K down columns an expert
over 2 GPUs: 512 and 256; ``FfnSplit``):
- Q, K, V (and their biases), gate and up: those rows (Phi-3's fused QKV and gate-up: the rows of
  each part, concatenated);
- O and down: those columns, so each rank's product is a partial sum of the full one, and an
  all-reduce over the ranks finishes it. Their biases (O's: gpt-oss, Qwen2 has none) stay on rank
  0 alone (zeros elsewhere), so the sum adds them once;
- the output head: vocabulary rows [r V', (r+1) V'), V' = ceil(V/N), the last rank's part padded
  with zero rows (an all-gather puts the logits back together; columns past V are dropped);
- mixtures of experts likewise inside every expert: each expert's gate and up rows, the rank's range
  of F' (its FFN width; their biases those columns), down those columns (its biases rank 0's
  alone), the shared expert as a dense FFN; the router (and the shared expert's gate) whole, so
  every rank picks the same experts and the all-reduce after down sums each expert's parts;
- the embedding table stays whole on every rank: a lookup reads one row a token, where a split
  table costs one more all-reduce a token for ~2% of the weights;
- norms, RoPE factors and the rest are the same on every rank.

Quantized rows split on whole blocks: a column split must start and end on a block boundary of
the tensor's type (256 values for the K-quants); ``check_split`` says in one line where no split
does (O's columns of a rank's heads, or fewer whole blocks of down's columns than ranks).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from ..errors import UnsupportedModelError
from .blocks import FORMATS
from .gguf_file import GGUFFile, TensorInfo
from .model_config import ModelConfig

HEAD = "output.weight"


def _rows(cfg: ModelConfig, name: str) -> list[tuple[int, str]] | None:
    """The units of rows of the full tensor that a rank's part stacks: (the unit's first row, the
    dimension it splits: FfnSplit.part's names). None: not split by rows."""
    hd = cfg.head_dim
    suffix = name.split(".", 2)[-1] if name.startswith("blk.") else name
    stem = suffix.rsplit(".", 1)[0]
    if stem == "attn_qkv":  # Phi-3: Q | K | V
        return [(0, "q"), (cfg.n_head * hd, "k"), ((cfg.n_head + cfg.n_head_kv) * hd, "v")]
    if stem == "ffn_up" and cfg.fused_gate_up:  # Phi-3: gate | up
        return [(0, "ff"), (cfg.n_ff, "ff")]
    dim = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_sinks": "heads", "ffn_gate": "ff", "ffn_up": "ff",
           "ffn_gate_shexp": "ff_shexp", "ffn_up_shexp": "ff_shexp"}.get(stem)
    return None if dim is None else [(0, dim)]


def _expert_rows(cfg: ModelConfig, name: str) -> list[tuple[int, str]] | None:
    """A stacked expert gate or up matrix [experts, F', columns]: each expert's rows, in the rows
    of its [experts * F', row bytes] view."""
    if name.startswith("blk.") and name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):
        return [(e * cfg.n_ff_exp, "ff_exp") for e in range(cfg.n_expert)]
    return None


_COLS = {"attn_output.weight": "o", "ffn_down.weight": "ff", "ffn_down_exps.weight": "ff_exp",
         "ffn_down_shexp.weight": "ff_shexp", "ffn_gate_exps.bias": "ff_exp", "ffn_up_exps.bias": "ff_exp"}


def _cols(name: str) -> str | None:
    """The dimension a tensor split by columns splits: O's (the heads'), down's (the experts' and the
    shared one's too: their FFN rows), and the experts' gate and up biases ([experts, F']: each
    expert's part of F'). None: not split by columns."""
    return _COLS.get(name.split(".", 2)[-1]) if name.startswith("blk.") else None


def _rank_bias(name: str) -> bool:
    """Biases of outputs that are not split (summed by the all-reduce): rank 0's alone."""
    return name.startswith("blk.") and name.endswith(("attn_output.bias", "ffn_down.bias", "ffn_down_exps.bias",
                                                      "ffn_down_shexp.bias"))


_WHAT = {"ff": "FFN rows", "ff_exp": "experts' FFN rows", "ff_shexp": "shared expert's FFN rows"}


class FfnSplit:
    """Each rank's range of every split dimension: heads, KV heads and O's columns in equal parts
    (the KV heads a rank's queries share must be its own); the FFN widths (F, an expert's F', the
    shared expert's) equal where down's columns stay on whole blocks, else whole blocks as evenly as
    they go, the first ranks one block more. Raises check_split's one line where no split does."""

    def __init__(self, f: GGUFFile, cfg: ModelConfig, world: int) -> None:
        if world < 1:
            raise UnsupportedModelError(f"--tensor-parallel {world}: give a number of GPUs of 1 or more")
        self.cfg, self.world = cfg, world
        self.ffn: dict[str, list[tuple[int, int]]] = {}
        if world == 1:
            return
        for what, n in (("attention heads", cfg.n_head), ("KV heads", cfg.n_head_kv)):
            if n % world:
                raise UnsupportedModelError(
                    f"--tensor-parallel {world}: the model's {n} {what} do not divide into {world} equal parts; "
                    f"use a GPU count that divides {cfg.n_head_kv} (its KV heads)")
        # the FFN widths the file's column-split tensors use (a mixture of experts may have dense layers too)
        full = {"ff": cfg.n_ff, "ff_exp": cfg.n_ff_exp, "ff_shexp": cfg.n_ff_shexp}
        sizes = {d: full[d] for d in map(_cols, f.tensors) if d in full}
        grain: dict[str, tuple[int, str | None]] = {d: (1, None) for d in sizes}  # blocks of down's columns
        o_cols = cfg.n_head * cfg.head_dim_v // world
        for name, t in f.tensors.items():
            dim = _cols(name)
            be = FORMATS[t.type_id].block_elems
            if dim == "o" and o_cols % be:
                raise UnsupportedModelError(
                    f"--tensor-parallel {world}: tensor '{name}' ({FORMATS[t.type_id].name}, {t.ne[0]} columns) "
                    f"splits into parts of {o_cols} columns, not whole {be}-value blocks; use fewer GPUs")
            if dim in grain and math.lcm(grain[dim][0], be) != grain[dim][0]:
                grain[dim] = (math.lcm(grain[dim][0], be), name)
        for dim, n in sizes.items():
            g, name = grain[dim]
            if n % (world * g) == 0:
                self.ffn[dim] = [(r * (n // world), n // world) for r in range(world)]
                continue
            units = n // g
            if n % g or units < world:
                what = _WHAT[dim]
                why = (f"'{name}' ({FORMATS[f.tensors[name].type_id].name}) has {units} whole {g}-value blocks of them"
                       if name else f"fewer than {world}")
                raise UnsupportedModelError(f"--tensor-parallel {world}: the model's {n} {what} do not split into "
                                            f"{world} parts: {why}; use fewer GPUs")
            counts = [(units // world + (r < units % world)) * g for r in range(world)]
            self.ffn[dim] = [(sum(counts[:r]), c) for r, c in enumerate(counts)]

    def part(self, dim: str, rank: int) -> tuple[int, int]:
        """Rank ``rank``'s (first, count) of a dimension: "q", "k", "v" (rows of the heads' Q, K, V),
        "heads" (one a head), "o" (O's columns), "ff", "ff_exp", "ff_shexp" (FFN rows)."""
        if dim in self.ffn:
            return self.ffn[dim][rank]
        cfg, n = self.cfg, self.world
        size = {"q": cfg.n_head * cfg.head_dim, "k": cfg.n_head_kv * cfg.head_dim, "v": cfg.n_head_kv * cfg.head_dim_v,
                "heads": cfg.n_head, "o": cfg.n_head * cfg.head_dim_v, "ff": cfg.n_ff}[dim]  # ("ff": a MoE model's)
        return rank * (size // n), size // n

    def uneven(self) -> str:
        """The FFN widths split into unequal parts, in words ("" where none is): the first GPUs then
        do more of the FFN's work than the others."""
        return "; ".join(f"{_WHAT[d]} {' / '.join(str(c) for _, c in parts)} a GPU (whole blocks of down's columns)"
                         for d, parts in self.ffn.items() if len({c for _, c in parts}) > 1)


def check_split(f: GGUFFile, cfg: ModelConfig, world: int) -> None:
    """One line when the model cannot be split over ``world`` ranks."""
    FfnSplit(f, cfg, world)


def shard_config(cfg: ModelConfig, split: FfnSplit, rank: int) -> ModelConfig:
    """The config of rank ``rank``'s part: heads and KV heads divided, its FFN rows, an untied output
    head (the part's own rows); the vocabulary (the sampler's, after the all-gather) is whole."""
    world = split.world
    if world == 1:
        return cfg
    ff = {d: split.part(d, rank)[1] for d in split.ffn}
    return dataclasses.replace(cfg, n_head=cfg.n_head // world, n_head_kv=cfg.n_head_kv // world,
                               n_ff=ff.get("ff", cfg.n_ff // world), n_ff_exp=ff.get("ff_exp", 0),
                               n_ff_shexp=ff.get("ff_shexp", 0), tied_embeddings=False)


def vocab_part(cfg: ModelConfig, world: int) -> int:
    """Rows of the output head on each rank (the last rank's padded)."""
    return -(-cfg.n_vocab // world)


class ShardedFile:
    """Rank ``rank`` of ``world``'s tensors of ``f`` (module docstring), read as a GGUFFile reads:
    ``tensors``, ``raw``, ``get``, ``metadata``, ``path``; bytes are sliced at each ``raw`` call."""

    def __init__(self, f: GGUFFile, cfg: ModelConfig, rank: int, world: int) -> None:
        self.split = FfnSplit(f, cfg, world)
        self.f, self.cfg, self.rank, self.world = f, cfg, rank, world
        self.config = shard_config(cfg, self.split, rank)  # the part's ModelConfig
        self.path, self.metadata = f.path, f.metadata
        self.tensors: dict[str, TensorInfo] = {}
        self._how: dict[str, tuple[str, Any]] = {}
        head = "token_embd.weight" if cfg.tied_embeddings else HEAD
        for name, t in f.tensors.items():
            self._add(name, t)
        vr = vocab_part(cfg, world)
        t = f.tensors[head]
        self._put(HEAD, t, (t.ne[0], vr), ("vocab", (head, rank * vr, vr)))

    @property
    def architecture(self) -> str | None:
        return self.f.architecture

    def get(self, key: str, default: Any = None) -> Any:
        return self.f.get(key, default)

    def _put(self, name: str, t: TensorInfo, ne: tuple[int, ...], how: tuple[str, Any]) -> None:
        fmt = FORMATS[t.type_id]
        nbytes = math.prod(ne) // fmt.block_elems * fmt.block_bytes
        self.tensors[name] = TensorInfo(name, ne, t.type_id, t.offset, nbytes)
        self._how[name] = how

    def _add(self, name: str, t: TensorInfo) -> None:
        r, n = self.rank, self.world
        if name == HEAD:
            return  # (the part's head: __init__)
        experts = _expert_rows(self.cfg, name) if n > 1 else None
        units = experts or (_rows(self.cfg, name) if n > 1 else None)
        cols = _cols(name) if n > 1 else None
        if units is not None:  # (stacked experts [experts, F', columns] -> [experts, the rank's F', columns])
            parts = [(start + first, count) for start, dim in units for first, count in [self.split.part(dim, r)]]
            if experts is not None:
                ne = (t.ne[0], parts[0][1], *t.ne[2:])
            else:
                total = sum(c for _, c in parts)
                ne = (total,) if len(t.ne) == 1 else (t.ne[0], total, *t.ne[2:])
            self._put(name, t, ne, ("rows", parts))
        elif cols is not None:
            first, count = self.split.part(cols, r)
            self._put(name, t, (count, *t.ne[1:]), ("cols", (first, count)))
        elif _rank_bias(name) and n > 1 and r:
            self._put(name, t, t.ne, ("zero", None))
        else:
            self._put(name, t, t.ne, ("same", None))

    def raw(self, name: str) -> np.ndarray:
        how, arg = self._how[name]
        t = self.tensors[name]
        if how == "same":
            return self.f.raw(name)
        if how == "zero":
            return np.zeros(t.nbytes, np.uint8)
        if how == "vocab":
            src, start, count = arg
            full = self.f.tensors[src]
            mat = self._matrix(src, full)
            out = np.zeros((count, mat.shape[1]), np.uint8)  # zero blocks: zero weights
            take = mat[start:start + count]
            out[:take.shape[0]] = take
            return out.reshape(-1)
        full = self.f.tensors[name]
        mat = self._matrix(name, full)
        if how == "rows":
            return np.concatenate([mat[s:s + c] for s, c in arg]).reshape(-1)
        start, count = arg  # "cols": byte columns of whole blocks
        fmt = FORMATS[full.type_id]
        b0, nb = start // fmt.block_elems * fmt.block_bytes, count // fmt.block_elems * fmt.block_bytes
        return np.ascontiguousarray(mat[:, b0:b0 + nb]).reshape(-1)

    def _matrix(self, name: str, t: TensorInfo) -> np.ndarray:
        """The tensor's bytes as [rows, row bytes] (a 1-D tensor: one value a row)."""
        raw = self.f.raw(name)
        if len(t.ne) == 1:
            return raw.reshape(t.ne[0], -1)
        rows = math.prod(t.ne[1:])
        return raw.reshape(rows, -1)
