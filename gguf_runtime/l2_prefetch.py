"""Which weights a decode step's attention kernel asks the L2 to fetch.

In a decode step of one or a few tokens the attention kernel reads little (the cache of a few
hundred positions) and leaves DRAM idle for its whole run, while every product after it is bound
by the bytes of its weights. So the attention kernel's threads issue L2 prefetches (common.cuh's
``l2_prefetch``) for the weights used next, in the order they are used: the output projection,
then the first rows of gate and up (a matvec's blocks start in row order), the down projection,
and the next layer's Q, K and V, until ``budget`` bytes. The products then read those bytes from
the L2 instead of DRAM. A hint only: results are the same bits with or without it.
"""

from __future__ import annotations

import numpy as np

from typing import Protocol

from .model_config import ModelConfig
from .quant_kernels.formats import FORMATS
from .quant_kernels.repack import LAYOUTS

MAX_REGIONS = 32  # (address, bytes) pairs per layer: 4 planes of up to 8 matrices
ROW_STEP = 16  # partial matrices are prefetched in whole groups of this many rows
MIB = 1 << 20


class Mat(Protocol):  # launch_core.Mat (not imported: this module plans on machines without CuPy)
    type_id: int
    rows: int
    cols: int
    qs: int
    qh: int
    sc: int
    d: int


def _planes(m: Mat) -> list[tuple[int, int]]:
    """(address, bytes per row) of each plane of a repacked matrix."""
    fmt = FORMATS[m.type_id]
    nb = m.cols // fmt.block_elems
    addr = {"qs": m.qs, "qh": m.qh, "sc": m.sc, "d": m.d}
    return [(addr[p.name], nb * p.nbytes) for p in LAYOUTS[fmt.name]]


def row_bytes(m: Mat) -> int:
    return sum(b for _, b in _planes(m))


def _first_rows(m: Mat, rows: int) -> list[tuple[int, int]]:
    """The regions holding rows [0, rows) of every plane, each rounded up to 16 bytes (the planes
    are padded to 256 bytes, so the rounding stays inside the matrix's buffer)."""
    return [(a, -(-rows * b // 16) * 16) for a, b in _planes(m)]


def _take(groups: list[list[Mat]], budget: int) -> list[tuple[int, int]]:
    """Regions for each group of matrices in turn (a group's matrices share a row range: gate and
    up) until the budget is spent; a group that does not fit whole gets its first rows."""
    out: list[tuple[int, int]] = []
    for mats in groups:
        per_row = sum(row_bytes(m) for m in mats)
        rows = min(mats[0].rows, budget // per_row)
        if rows < mats[0].rows:
            rows -= rows % ROW_STEP
        if rows <= 0:
            break
        for m in mats:
            out += _first_rows(m, rows)
        budget -= rows * per_row
        if rows < mats[0].rows or budget <= 0:
            break
    return out


def plan(cfg: ModelConfig, mat, layer: int, budget: int) -> list[tuple[int, int]]:
    """The (address, bytes) regions that layer's attention prefetches; mat(name) gives the Mat or
    None (a matrix the architecture lacks: the plan stops there)."""
    if budget <= 0:
        return []
    p, q = f"blk.{layer}.", f"blk.{layer + 1}."
    names = [[p + "attn_output.weight"], [p + "ffn_gate.weight", p + "ffn_up.weight"], [p + "ffn_down.weight"]]
    if layer + 1 < cfg.n_layer:
        names += [[q + n] for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight")]
    groups = []
    for group in names:
        mats = [mat(n) for n in group]
        if any(m is None for m in mats):
            break
        groups.append(mats)
    regions = _take(groups, budget)
    assert len(regions) <= MAX_REGIONS
    return regions


def table(cfg: ModelConfig, mat, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """Every layer's plan as an int64 array [n_layer, MAX_REGIONS, 2] and the counts per layer."""
    t = np.zeros((cfg.n_layer, MAX_REGIONS, 2), np.int64)
    n = np.zeros(cfg.n_layer, np.int64)
    for layer in range(cfg.n_layer):
        regions = plan(cfg, mat, layer, budget)
        n[layer] = len(regions)
        if regions:
            t[layer, :len(regions)] = regions
    return t, n
