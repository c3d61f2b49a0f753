"""The CUDA KV cache's page layout of each element type (kv_cache.cuh's, on the host side): the C
type the attention kernels are compiled for, the code rope_kv takes, the bytes of a key row, and a
numpy packer and unpacker of whole (page, KV head) blocks for tests and inspection.

A layer's cache is pages of [n_head_kv][page_size] rows. f32 and f16: a row is head_dim elements.
q8_0 / q4_0: a (page, KV head) block holds its page_size rows of values first (q8_0: head_dim
int8; q4_0: head_dim / 2 bytes, value 2i in the low nibble of byte i and 2i + 1 in the high one,
stored as q + 8), then the rows' scales (head_dim / 32 f16 each), so rows of values stay 16-byte
aligned for cp.async. The values are reference_kv's quantizers' (llama.cpp's), bit for bit.
"""

from __future__ import annotations

import numpy as np

from . import reference_kv as RK

KV_TYPES = RK.KV_TYPES
CTYPE = {"f32": "float", "f16": "u16", "q8_0": "kvq8", "q4_0": "kvq4"}
KIND = {"f32": 0, "f16": 1, "q8_0": 2, "q4_0": 3}  # rope_kv's ``kv`` argument
QUANT = ("q8_0", "q4_0")


def row_bytes(kv: str, head_dim: int) -> tuple[int, int]:
    """(bytes of a key row's values, of its scales) in a cache of type ``kv``."""
    RK.check(kv, head_dim)
    vb = {"f32": 4 * head_dim, "f16": 2 * head_dim, "q8_0": head_dim, "q4_0": head_dim // 2}[kv]
    return vb, head_dim // 16 if kv in QUANT else 0


def block_bytes(kv: str, page_size: int, head_dim: int) -> int:
    """Bytes of one (page, KV head) block."""
    vb, sb = row_bytes(kv, head_dim)
    return page_size * (vb + sb)


def pack(x: np.ndarray, kv: str) -> np.ndarray:
    """float32 rows x (..., page_size, head_dim), the last two axes one (page, KV head) block each,
    as the cache holds them: (..., block_bytes) uint8 (f32 / f16: the values' own bytes)."""
    x = np.ascontiguousarray(x, np.float32)
    lead, (ps, d) = x.shape[:-2], x.shape[-2:]
    if kv == "f32":
        return x.view(np.uint8).reshape(lead + (-1,))
    if kv == "f16":
        return x.astype(np.float16).view(np.uint8).reshape(lead + (-1,))
    scale, q = RK.quantize(x, kv)
    if kv == "q8_0":
        vals = q.view(np.uint8).reshape(lead + (ps * d,))
    else:
        u = (q.astype(np.int16) + 8).astype(np.uint8).reshape(lead + (ps, d // 2, 2))
        vals = (u[..., 0] | (u[..., 1] << 4)).reshape(lead + (ps * d // 2,))
    return np.concatenate([vals, scale.view(np.uint8).reshape(lead + (-1,))], axis=-1)


def unpack(raw: np.ndarray, kv: str, page_size: int, head_dim: int) -> np.ndarray:
    """pack's inverse: the float32 values (..., page_size, head_dim) blocks of raw uint8 hold."""
    raw = np.ascontiguousarray(raw, np.uint8)
    lead = raw.shape[:-1]
    shape = lead + (page_size, head_dim)
    if kv == "f32":
        return raw.view(np.float32).reshape(shape).copy()
    if kv == "f16":
        return raw.view(np.float16).astype(np.float32).reshape(shape)
    vb, _ = row_bytes(kv, head_dim)
    vals, sc = raw[..., :page_size * vb], raw[..., page_size * vb:]
    scale = np.ascontiguousarray(sc).view(np.float16).reshape(lead + (page_size, head_dim // RK.BLOCK))
    if kv == "q8_0":
        q = vals.view(np.int8).reshape(shape)
    else:
        b = vals.reshape(lead + (page_size, head_dim // 2))
        q = (np.stack([b & 15, b >> 4], axis=-1).reshape(shape).astype(np.int16) - 8).astype(np.int8)
    return RK.dequantize(scale, q).reshape(shape)
