"""f16 weights for the cuBLAS prefill path, with each layer's Q/K/V and gate/up stacked by rows.

Eager prefill of more than MAX_MMV_TOKENS rows multiplies f16 weights with cuBLAS. Stacking Q, K
and V (their outputs are adjacent columns of the QKV buffer) and gate and up (adjacent halves of
the GLU buffer) makes a layer four products instead of seven. When the f16 copies of all layer
matrices fit the tuning table's f16_resident_max_bytes they are made once at load (small models, whose prefill is bound
by launches: no dequantize launch per product); otherwise each group is dequantized into one
scratch buffer just before its product.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import cupy as cp

from .weights import DeviceWeights
from ...format.model_config import ModelConfig
from ...quant_kernels import launchers as L
from ...quant_kernels import launch_layers as LL

@dataclass(frozen=True)
class W16:
    ptr: int  # f16 [rows, cols], row-major
    rows: int
    cols: int


def layer_groups(cfg: ModelConfig, layer: int) -> list[tuple[str, ...]]:
    """The products of a layer's cuBLAS prefill path (a mixture of experts runs moe.cu's kernels)."""
    p = f"blk.{layer}."
    attn = [(p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"), (p + "attn_output.weight",)]
    if cfg.n_expert:
        return attn
    return attn + [(p + "ffn_gate.weight", p + "ffn_up.weight"), (p + "ffn_down.weight",)]


class F16Weights:
    def __init__(self, cfg: ModelConfig, w: DeviceWeights, kernels: L.Kernels, resident_max: int) -> None:
        self.w, self.k = w, kernels
        groups = [g for i in range(cfg.n_layer) for g in layer_groups(cfg, i)]
        size = {g: sum(w.mat(n).rows * w.mat(n).cols for n in g) for g in groups}
        self.resident = 2 * sum(size.values()) <= resident_max
        self._cache: dict[tuple[str, ...], cp.ndarray] = {}
        self._scratch: cp.ndarray | None = None
        if self.resident:  # filled by fill(), once the kernels are compiled
            self._cache = {g: cp.empty(size[g], cp.float16) for g in groups}
        else:
            self._scratch = cp.empty(max(size.values()), cp.float16)

    def fill(self) -> None:
        """Dequantize the resident copies (nothing to do for the scratch buffer)."""
        for g, buf in self._cache.items():
            self._dequant(g, buf)
        cp.cuda.get_current_stream().synchronize()  # built on this stream; used on the backend's

    def _dequant(self, names: Sequence[str], buf: cp.ndarray) -> None:
        off = buf.data.ptr
        for n in names:
            m = self.w.mat(n)
            LL.dequant_f16(self.k, m, off)
            off += 2 * m.rows * m.cols

    def get(self, names: Sequence[str]) -> W16:
        """The matrices ``names`` (same column count) stacked by rows, in f16: the resident copy,
        or dequantized now (on the current stream) into the scratch buffer."""
        g = tuple(names)
        assert len({self.w.mat(n).cols for n in g}) == 1, g
        rows, cols = sum(self.w.mat(n).rows for n in g), self.w.mat(g[0]).cols
        if self.resident:
            return W16(self._cache[g].data.ptr, rows, cols)
        assert self._scratch is not None
        self._dequant(g, self._scratch)
        return W16(self._scratch.data.ptr, rows, cols)
