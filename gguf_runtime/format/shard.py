"""One rank's part of a model split for tensor parallelism (Megatron's split, as vLLM and
llama.cpp's ``-sm tensor``): a ``ShardedFile`` that reads as a GGUF file of its own, and the
``ModelConfig`` of that part.

Rank r of N holds heads [r H/N, (r+1) H/N) and KV heads likewise, and FFN rows [r F/N, (r+1) F/N):
- Q, K, V (and their biases), gate and up: those rows (Phi-3's fused QKV and gate-up: the rows of
  each part, concatenated);
- O and down: those columns, so each rank's product is a partial sum of the full one, and an
  all-reduce over the ranks finishes it. Their biases (O's: gpt-oss, Qwen2 has none) stay on rank
  0 alone (zeros elsewhere), so the sum adds them once;
- the output head: vocabulary rows [r V', (r+1) V'), V' = ceil(V/N), the last rank's part padded
  with zero rows (an all-gather puts the logits back together; columns past V are dropped);
- mixtures of experts likewise inside every expert: each expert's gate and up rows [r F'/N, (r+1)
  F'/N) (F' its FFN width; their biases those columns), down those columns (its biases rank 0's
  alone), the shared expert as a dense FFN; the router (and the shared expert's gate) whole, so
  every rank picks the same experts and the all-reduce after down sums each expert's parts;
- the embedding table stays whole on every rank: a lookup reads one row a token, where a split
  table costs one more all-reduce a token for ~2% of the weights;
- norms, RoPE factors and the rest are the same on every rank.

Quantized rows split on whole blocks: a column split must start and end on a block boundary of
the tensor's type (256 values for the K-quants), which ``check_split`` says in one line when it
does not.
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


def _rows(cfg: ModelConfig, name: str) -> list[tuple[int, int]] | None:
    """The row ranges (start, count) of the full tensor that a rank's part stacks, per rank unit:
    returned for rank 0; a rank r adds r times the unit to each start. None: not split by rows."""
    hd, hdv = cfg.head_dim, cfg.head_dim_v
    suffix = name.split(".", 2)[-1] if name.startswith("blk.") else name
    stem = suffix.rsplit(".", 1)[0]
    if stem == "attn_q":
        return [(0, cfg.n_head * hd)]
    if stem == "attn_k":
        return [(0, cfg.n_head_kv * hd)]
    if stem == "attn_v":
        return [(0, cfg.n_head_kv * hdv)]
    if stem == "attn_qkv":  # Phi-3: Q | K | V
        return [(0, cfg.n_head * hd), (cfg.n_head * hd, cfg.n_head_kv * hd),
                ((cfg.n_head + cfg.n_head_kv) * hd, cfg.n_head_kv * hdv)]
    if stem == "attn_sinks":
        return [(0, cfg.n_head)]
    if stem == "ffn_gate":
        return [(0, cfg.n_ff)]
    if stem == "ffn_up":
        return [(0, cfg.n_ff), (cfg.n_ff, cfg.n_ff)] if cfg.fused_gate_up else [(0, cfg.n_ff)]
    if stem in ("ffn_gate_shexp", "ffn_up_shexp"):
        return [(0, cfg.n_ff_shexp)]
    return None


def _expert_rows(cfg: ModelConfig, name: str) -> list[tuple[int, int]] | None:
    """A stacked expert gate or up matrix [experts, F', columns]: each expert's rows, in the rows
    of its [experts * F', row bytes] view (rank 0's; a rank r adds r times the unit to each start)."""
    if name.startswith("blk.") and name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):
        return [(e * cfg.n_ff_exp, cfg.n_ff_exp) for e in range(cfg.n_expert)]
    return None


def _cols(name: str) -> bool:
    """Split by columns: O and down (the experts' and the shared one's too), and the experts' gate
    and up biases ([experts, F']: each expert's part of F')."""
    return name.startswith("blk.") and name.endswith(
        ("attn_output.weight", "ffn_down.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight",
         "ffn_gate_exps.bias", "ffn_up_exps.bias"))


def _rank_bias(name: str) -> bool:
    """Biases of outputs that are not split (summed by the all-reduce): rank 0's alone."""
    return name.startswith("blk.") and name.endswith(("attn_output.bias", "ffn_down.bias", "ffn_down_exps.bias",
                                                      "ffn_down_shexp.bias"))


def check_split(f: GGUFFile, cfg: ModelConfig, world: int) -> None:
    """One line when the model cannot be split over ``world`` ranks."""
    if world < 1:
        raise UnsupportedModelError(f"--tensor-parallel {world}: give a number of GPUs of 1 or more")
    if world == 1:
        return
    ffn = [("experts' FFN rows", cfg.n_ff_exp)] if cfg.n_expert else [("FFN rows", cfg.n_ff)]
    if cfg.n_ff_shexp:
        ffn.append(("shared expert's FFN rows", cfg.n_ff_shexp))
    for what, n in (("attention heads", cfg.n_head), ("KV heads", cfg.n_head_kv), *ffn):
        if n % world:
            raise UnsupportedModelError(
                f"--tensor-parallel {world}: the model's {n} {what} do not divide into {world} equal parts; "
                f"use a GPU count that divides {cfg.n_head_kv} (its KV heads)")
    for name, t in f.tensors.items():
        if _cols(name):
            be = FORMATS[t.type_id].block_elems
            part = t.ne[0] // world
            if part % be:
                raise UnsupportedModelError(
                    f"--tensor-parallel {world}: tensor '{name}' ({FORMATS[t.type_id].name}, {t.ne[0]} columns) "
                    f"splits into parts of {part} columns, not whole {be}-value blocks; use fewer GPUs")


def shard_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The config of one rank's part: heads, KV heads and FFN rows divided, an untied output
    head (the part's own rows); the vocabulary (the sampler's, after the all-gather) is whole."""
    if world == 1:
        return cfg
    return dataclasses.replace(cfg, n_head=cfg.n_head // world, n_head_kv=cfg.n_head_kv // world,
                               n_ff=cfg.n_ff // world, n_ff_exp=cfg.n_ff_exp // world,
                               n_ff_shexp=cfg.n_ff_shexp // world, tied_embeddings=False)


def vocab_part(cfg: ModelConfig, world: int) -> int:
    """Rows of the output head on each rank (the last rank's padded)."""
    return -(-cfg.n_vocab // world)


class ShardedFile:
    """Rank ``rank`` of ``world``'s tensors of ``f`` (module docstring), read as a GGUFFile reads:
    ``tensors``, ``raw``, ``get``, ``metadata``, ``path``; bytes are sliced at each ``raw`` call."""

    def __init__(self, f: GGUFFile, cfg: ModelConfig, rank: int, world: int) -> None:
        check_split(f, cfg, world)
        self.f, self.cfg, self.rank, self.world = f, cfg, rank, world
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
        rows = _rows(self.cfg, name) if n > 1 else None
        if experts is not None:  # [experts, F', columns] -> [experts, F' / n, columns]
            parts = [(start + r * (count // n), count // n) for start, count in experts]
            self._put(name, t, (t.ne[0], t.ne[1] // n, *t.ne[2:]), ("rows", parts))
        elif rows is not None:
            parts = [(start + r * (count // n), count // n) for start, count in rows]
            count = sum(c for _, c in parts)
            ne = (count,) if len(t.ne) == 1 else (t.ne[0], count, *t.ne[2:])
            self._put(name, t, ne, ("rows", parts))
        elif _cols(name) and n > 1:
            part = t.ne[0] // n
            self._put(name, t, (part, *t.ne[1:]), ("cols", (r * part, part)))
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
