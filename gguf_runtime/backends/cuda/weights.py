"""Model weights on the GPU: every matrix repacked into kernel planes, every vector in f32.

Uploaded once at load; nothing here allocates afterwards.
"""

from __future__ import annotations

from typing import Callable

import cupy as cp
import numpy as np

from ...errors import GGUFError, UnsupportedModelError
from ...format.gguf_file import GGUFFile
from ...format.model_config import ModelConfig, model_tensors
from ...quant_kernels.launch_core import Mat
from ...quant_kernels.reference import all_finite, dequantize
from ...quant_kernels.repack import repack, row_offsets


def damaged(name: str) -> str:
    return f"tensor '{name}' holds NaN or infinite values: the file's weights are damaged; re-download it"


def _finite_on_device(buf: cp.ndarray, type_name: str, n: int) -> bool:
    """The n elements of a float matrix's buffer (before its alignment padding) all finite."""
    buf = buf[:n * (4 if type_name == "F32" else 2)]
    if type_name == "BF16":
        return not bool(((buf.view(cp.uint16) & 0x7F80) == 0x7F80).any())
    return bool(cp.isfinite(buf.view(cp.float32 if type_name == "F32" else cp.float16)).all())


class DeviceWeights:
    def __init__(self, f: GGUFFile, cfg: ModelConfig,
                 progress: Callable[[str, int, int], None] | None = None) -> None:
        self.mats: dict[str, Mat] = {}
        self.vecs: dict[str, cp.ndarray] = {}
        self._buffers: list[cp.ndarray] = []  # owners of the matrices' memory
        self.nbytes = 0
        names = list(model_tensors(cfg))
        total = sum(f.tensors[n].nbytes for n in names)
        done = 0
        for name in names:
            t = f.tensors[name]
            if len(t.shape) == 1:
                host = dequantize(f.raw(name), t.type_id, t.shape).astype(np.float32)
                if not np.isfinite(host).all():
                    raise GGUFError(damaged(name))
                v = cp.asarray(host)
                self.vecs[name] = v
                self.nbytes += v.nbytes
            else:
                *lead, cols = t.shape  # stacked experts [n_expert, rows, cols]: one matrix of their rows
                rows = int(np.prod(lead))
                if t.type_name in ("F32", "F16", "BF16") and cols % 16:
                    raise UnsupportedModelError(f"tensor '{name}': {cols} columns is not a multiple of 16, "
                                                "which the CUDA kernels need; use --backend numpy")
                floats = t.type_name in ("F32", "F16", "BF16")
                if not floats and not all_finite(f.raw(name), t.type_id):  # (the blocks' f16 scales)
                    raise GGUFError(damaged(name))
                packed = repack(f.raw(name), t.type_id, rows, cols)
                dev = cp.asarray(packed.buffer)
                if floats and not _finite_on_device(dev, t.type_name, rows * cols):  # every element: on the GPU
                    raise GGUFError(damaged(name))
                self._buffers.append(dev)
                self.nbytes += dev.nbytes
                base = dev.data.ptr
                off = packed.offsets
                self.mats[name] = Mat(t.type_id, rows, cols, qs=base + off["qs"],
                                      qh=base + off["qh"] if "qh" in off else 0,
                                      sc=base + off["sc"] if "sc" in off else 0,
                                      d=base + off["d"] if "d" in off else 0)
            done += t.nbytes
            if progress:
                progress("loading weights", done, total)
        for layer in range(cfg.n_layer):
            self._split_fused(cfg, layer)

    def _split_fused(self, cfg: ModelConfig, layer: int) -> None:
        """Phi-3's fused matrices as the row slices the kernels take: attn_qkv as attn_q / attn_k /
        attn_v and ffn_up (gate rows first) as ffn_gate / ffn_up (each plane keeps a row
        contiguous, so a slice is its planes' pointers moved by whole rows)."""
        p = f"blk.{layer}."
        parts: list[tuple[str, str, int]] = []
        if cfg.fused_qkv:
            q, kv = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
            parts += [(p + "attn_qkv.weight", p + "attn_q.weight", q), ("", p + "attn_k.weight", kv),
                      ("", p + "attn_v.weight", cfg.n_head_kv * cfg.head_dim_v)]
        if cfg.fused_gate_up:
            parts += [(p + "ffn_up.weight", p + "ffn_gate.weight", cfg.n_ff), ("", p + "ffn_up.weight", cfg.n_ff)]
        whole, row0 = None, 0
        for src, dst, rows in parts:
            if src:
                whole, row0 = self.mats[src], 0
            if whole.rows < row0 + rows:
                raise GGUFError(f"tensor '{src or dst}' has {whole.rows} rows, fewer than its parts need")
            self.mats[dst] = row_slice(whole, row0, rows)
            row0 += rows

    def mat(self, name: str) -> Mat:
        return self.mats[name]

    def vec(self, name: str) -> cp.ndarray:
        return self.vecs[name]


def row_slice(m: Mat, row0: int, rows: int) -> Mat:
    """Rows [row0, row0 + rows) of a repacked matrix, sharing its memory."""
    step = row_offsets(m.type_id, m.cols, row0)
    return Mat(m.type_id, rows, m.cols, qs=m.qs + step["qs"], qh=m.qh + step["qh"] if m.qh else 0,
               sc=m.sc + step["sc"] if m.sc else 0, d=m.d + step["d"] if m.d else 0)
