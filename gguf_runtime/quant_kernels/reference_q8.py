"""numpy mirror of the kernels' int8 activations (quant_int8.cuh ``quant16``), bit for bit.

Per 16 consecutive values v: amax = max |v|; d = amax / 127 and q = rint(v * (127 / amax)) in
float32 (zeros when amax < 1e-30); s = d * sum(q). The q8 matvecs compute W (d q) exactly up to
f32 rounding, so tests compare them with ``dequantize_q8(quantize_q8(x))``.

With rests (Tuning.q8_res, quant16_rest): r = v - d q in float32 (the product rounded, then the
difference), quantized the same way into (q2, d2); s = d sum(q) + d2 sum(q2); the kernels multiply
d q + d2 q2 (``dequantize_q8_rest``).
"""

from __future__ import annotations

import numpy as np

MIN_AMAX = np.float32(1e-30)


def quantize_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x: float32 (..., n), n % 16 == 0 -> (q int8 (..., n), d float32 (..., n / 16), s float32 (..., n / 16))."""
    x = np.asarray(x, np.float32)
    if x.shape[-1] % 16:
        raise ValueError(f"the last axis ({x.shape[-1]}) is not a multiple of 16")
    v = x.reshape(*x.shape[:-1], -1, 16)
    amax = np.abs(v).max(-1)
    live = amax >= MIN_AMAX
    with np.errstate(divide="ignore"):
        inv = np.where(live, np.float32(127) / np.where(live, amax, np.float32(1)), np.float32(0)).astype(np.float32)
    d = np.where(live, amax / np.float32(127), np.float32(0)).astype(np.float32)
    q = np.rint((v * inv[..., None]).astype(np.float32)).astype(np.int32)
    s = (d * q.sum(-1).astype(np.float32)).astype(np.float32)
    return q.astype(np.int8).reshape(x.shape), d, s


def dequantize_q8(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The values the q8 matvecs multiply: q * d per 16 columns (float64)."""
    v = q.astype(np.float64).reshape(*q.shape[:-1], -1, 16) * d.astype(np.float64)[..., None]
    return v.reshape(q.shape)


def quantize_q8_rest(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x -> (q, d, s, q2, d2): quantize_q8's pieces and their rests' (s covers both)."""
    x = np.asarray(x, np.float32)
    q, d, s = quantize_q8(x)
    v = x.reshape(*x.shape[:-1], -1, 16)
    r = (v - (d[..., None] * q.reshape(v.shape).astype(np.float32)).astype(np.float32)).astype(np.float32)
    q2, d2, s2 = quantize_q8(r.reshape(x.shape))
    return q, d, (s + s2).astype(np.float32), q2, d2


def dequantize_q8_rest(q: np.ndarray, d: np.ndarray, q2: np.ndarray, d2: np.ndarray) -> np.ndarray:
    """The values the q8 matvecs multiply with rests: q * d + q2 * d2 per 16 columns (float64)."""
    return dequantize_q8(q, d) + dequantize_q8(q2, d2)
