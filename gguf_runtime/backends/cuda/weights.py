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
from ...quant_kernels.repack import repack


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

    def mat(self, name: str) -> Mat:
        return self.mats[name]

    def vec(self, name: str) -> cp.ndarray:
        return self.vecs[name]
