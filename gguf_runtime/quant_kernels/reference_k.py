"""numpy reference dequantizers for ggml's K-quants (256-element super-blocks).

Each kernel takes ``blocks`` (n_blocks, block_bytes) uint8 and writes ``out`` (n_blocks, 256)
float32, with the byte layouts and the float32 arithmetic of ggml-quants.c ``dequantize_row_*``
(same operation order, so results match ggml and the ``gguf`` package bit for bit).
Used through :func:`gguf_runtime.quant_kernels.reference.dequantize`; block sizes live in
``formats.py``.

Layouts (byte offsets inside one block):

* Q2_K (84):  scales[16] @0 (low nibble scale, high nibble min, per 16 elements), qs[64] @16
  (2 bits), d f16 @80, dmin f16 @82.  y = d*(sc&15) * q - dmin*(sc>>4).
* Q3_K (110): hmask[32] @0, qs[64] @32 (low 2 bits), scales[12] @96 (16 six-bit scales, biased
  by 32), d f16 @108.  y = d*(sc-32) * ((q2 | h<<2) - 4)  (a *clear* hmask bit subtracts 4).
* Q4_K (144): d @0, dmin @2, scales[12] @4 (8 six-bit scales + 8 six-bit mins), qs[128] @16.
* Q5_K (176): d @0, dmin @2, scales[12] @4, qh[32] @16, qs[128] @48.
* Q6_K (210): ql[128] @0, qh[64] @128, scales[16] int8 @192, d f16 @208.  y = d*sc * (q6 - 32).

Common bit order: in the 2-bit/high-bit planes, element ``32*s + l`` of a 256-block takes its
bits from byte ``l`` (of the relevant 32-byte group) at bit position ``s`` (or ``2s``).
"""

from __future__ import annotations

import numpy as np

_SH2 = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
_SH4 = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
_SH8 = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
_F16 = np.dtype("<f2")


def f16_field(blocks: np.ndarray, off: int) -> np.ndarray:
    """The little-endian f16 at byte ``off`` of every block, as float32 (n_blocks, 1)."""
    return blocks[:, off:off + 2].view(_F16).astype(np.float32)


def high_bits(qh: np.ndarray) -> np.ndarray:
    """(n, 32) bytes -> (n, 8, 32) bits: [:, s, l] = bit s of qh[:, l]."""
    return (qh[:, None, :] >> _SH8) & np.uint8(1)


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """(n, 64) bytes of 2-bit quants -> (n, 8, 32): [:, 4h+j, l] = (qs[32h+l] >> 2j) & 3."""
    n = qs.shape[0]
    return ((qs.reshape(n, 2, 1, 32) >> _SH2) & np.uint8(3)).reshape(n, 8, 32)


def scale_min_k4(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml ``get_scale_min_k4`` for all 8 sub-blocks: (n, 12) bytes -> scales, mins (n, 8) uint8."""
    a, b, c = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scales = np.concatenate([a & np.uint8(63), (c & np.uint8(15)) | ((a >> np.uint8(6)) << np.uint8(4))], axis=1)
    mins = np.concatenate([b & np.uint8(63), (c >> np.uint8(4)) | ((b >> np.uint8(6)) << np.uint8(4))], axis=1)
    return scales, mins


def _scale_q(q: np.ndarray, scale: np.ndarray, out: np.ndarray, groups: int, offset=None) -> None:
    """out = scale[group] * q  (- offset[group]), everything viewed as (n, groups, 256/groups)."""
    n = out.shape[0]
    o = out.reshape(n, groups, -1)
    np.multiply(q.reshape(n, groups, -1), scale[:, :, None], out=o)
    if offset is not None:
        np.subtract(o, offset[:, :, None], out=o)


def deq_q2_k(blocks: np.ndarray, out: np.ndarray) -> None:
    sc = blocks[:, 0:16]
    d, dmin = f16_field(blocks, 80), f16_field(blocks, 82)
    dl = d * (sc & np.uint8(15))
    ml = dmin * (sc >> np.uint8(4))
    _scale_q(_crumbs(blocks[:, 16:80]), dl, out, 16, ml)


def deq_q3_k(blocks: np.ndarray, out: np.ndarray) -> None:
    n = blocks.shape[0]
    s = blocks[:, 96:108]
    low = np.concatenate([s[:, :8] & np.uint8(15), s[:, :8] >> np.uint8(4)], axis=1)
    high = ((s[:, None, 8:12] >> _SH2[0]) & np.uint8(3)).reshape(n, 16)
    sc = (low | (high << np.uint8(4))).view(np.int8) - np.int8(32)
    dl = f16_field(blocks, 108) * sc
    q = _crumbs(blocks[:, 32:96])
    q |= high_bits(blocks[:, 0:32]) << np.uint8(2)
    q = q.view(np.int8)
    q -= np.int8(4)
    _scale_q(q, dl, out, 16)


def _deq_k4_k5(blocks: np.ndarray, out: np.ndarray, qs_off: int, qh_off: int | None) -> None:
    n = blocks.shape[0]
    sc, m = scale_min_k4(blocks[:, 4:16])
    ds = f16_field(blocks, 0) * sc
    dm = f16_field(blocks, 2) * m
    q = ((blocks[:, qs_off:qs_off + 128].reshape(n, 4, 1, 32) >> _SH4) & np.uint8(15)).reshape(n, 8, 32)
    if qh_off is not None:
        q |= high_bits(blocks[:, qh_off:qh_off + 32]) << np.uint8(4)
    _scale_q(q, ds, out, 8, dm)


def deq_q4_k(blocks: np.ndarray, out: np.ndarray) -> None:
    _deq_k4_k5(blocks, out, 16, None)


def deq_q5_k(blocks: np.ndarray, out: np.ndarray) -> None:
    _deq_k4_k5(blocks, out, 48, 16)


def deq_q6_k(blocks: np.ndarray, out: np.ndarray) -> None:
    n = blocks.shape[0]
    lo = (blocks[:, 0:128].reshape(n, 2, 1, 64) >> _SH4) & np.uint8(15)  # (n, 2, 2, 64) = (n, 2, 4, 32)
    hi = (blocks[:, 128:192].reshape(n, 2, 1, 32) >> _SH2) & np.uint8(3)  # (n, 2, 4, 32)
    lo = lo.reshape(n, 2, 4, 32)
    lo |= hi << np.uint8(4)
    q = lo.view(np.int8)
    q -= np.int8(32)
    ds = f16_field(blocks, 208) * blocks[:, 192:208].view(np.int8)
    _scale_q(q, ds, out, 16)


KERNELS = {
    "Q2_K": deq_q2_k,
    "Q3_K": deq_q3_k,
    "Q4_K": deq_q4_k,
    "Q5_K": deq_q5_k,
    "Q6_K": deq_q6_k,
}
