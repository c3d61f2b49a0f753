"""numpy reference of the KV-cache element types (issue 32 item 3): the values a cache of each type
holds for the keys and values written into it, and its bytes per element.

f32 keeps them; f16 rounds each one; q8_0 and q4_0 quantize every 32 consecutive values of a head
(the last axis) as llama.cpp's reference quantizers do (``quantize_row_q8_0_ref``: d = amax / 127,
q = roundf(x / d); ``quantize_row_q4_0_ref``: d = (the value of largest magnitude) / -8,
q = min(15, (int)(x / d + 8.5)) - 8), the scale stored as f16. Tests check the roundtrips against
the gguf package's quantizers bit for bit. This is the oracle of the numpy backend's ``kv_types``
and of the CUDA caches (kv_layout.py lays the blocks out as the kernels keep them).
"""

from __future__ import annotations

import numpy as np

from .formats import BY_NAME, FORMATS

KV_TYPES = ("f32", "f16", "q8_0", "q4_0")
BLOCK = 32  # values per quantized block (q8_0, q4_0)
_FMT = {t: FORMATS[BY_NAME[t.upper()]] for t in KV_TYPES}  # the ggml type table's rows
BYTES_PER_BLOCK = {t: f.block_bytes * BLOCK // f.block_elems for t, f in _FMT.items()}  # q8_0 34, q4_0 18


def bytes_per_element(kv_type: str) -> float:
    """A cache element's bytes, scales included (q8_0: 34 / 32, q4_0: 18 / 32)."""
    return BYTES_PER_BLOCK[check(kv_type)] / BLOCK


def check(kv_type: str, head_dim: int | None = None) -> str:
    if kv_type not in KV_TYPES:
        raise ValueError(f"{kv_type!r} is not a KV cache type: {', '.join(KV_TYPES)}")
    if head_dim is not None and kv_type in ("q8_0", "q4_0") and head_dim % BLOCK:
        raise ValueError(f"a {kv_type} cache needs heads of a multiple of {BLOCK} values, not {head_dim}")
    return kv_type


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _roundf(x: np.ndarray) -> np.ndarray:
    """C's roundf: halves away from zero."""
    return np.trunc(x + np.copysign(np.float32(0.5), x)).astype(np.float32)


def quantize(x: np.ndarray, kv_type: str) -> tuple[np.ndarray, np.ndarray]:
    """q8_0 / q4_0 blocks of float32 values x (..., n): (d as f16 (..., n / 32), q as int8 (..., n) with
    x ~ d q, q4_0's q already less 8)."""
    x = np.asarray(x, np.float32)
    check(kv_type, x.shape[-1])
    assert kv_type in ("q8_0", "q4_0"), kv_type
    b = x.reshape(-1, BLOCK)
    with np.errstate(divide="ignore"):
        if kv_type == "q8_0":
            d = (np.abs(b).max(1) / np.float32(127)).astype(np.float32)
            inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
            q = _roundf((b * inv[:, None]).astype(np.float32))
        else:  # q4_0
            mx = b[np.arange(b.shape[0]), np.abs(b).argmax(1)]
            d = (mx / np.float32(-8)).astype(np.float32)
            inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
            q = np.minimum(np.float32(15), np.trunc((b * inv[:, None]).astype(np.float32) + np.float32(8.5))) - 8
    return d.astype(np.float16).reshape(x.shape[:-1] + (-1,)), q.astype(np.int8).reshape(x.shape)


def roundtrip(x: np.ndarray, kv_type: str) -> np.ndarray:
    """float32 values as a cache of ``kv_type`` returns them (x: float32 (..., n))."""
    x = np.asarray(x, np.float32)
    check(kv_type, x.shape[-1])
    if kv_type == "f32":
        return x
    if kv_type == "f16":
        return _f16(x)
    d, q = quantize(x, kv_type)
    return dequantize(d, q)


def dequantize(d: np.ndarray, q: np.ndarray) -> np.ndarray:
    """quantize's blocks as float32 values: d (f16, one per 32) times q."""
    qb = q.astype(np.float32).reshape(-1, BLOCK)
    return (qb * d.astype(np.float32).reshape(-1, 1)).astype(np.float32).reshape(q.shape)
