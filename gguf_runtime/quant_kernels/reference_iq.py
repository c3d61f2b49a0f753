"""numpy reference dequantization of the 4-bit non-linear types: MXFP4 (gpt-oss), IQ4_NL, IQ4_XS.

Groundwork for issue 33: these are the oracle the CUDA kernels will be tested against, as
reference.py is for the types already supported; they are not in ``formats.SUPPORTED`` until the
CUDA side reads them too (a file using them still stops with one line). Layouts and float32
arithmetic follow ggml-quants.c ``dequantize_row_*`` (results equal the ``gguf`` package's bit for
bit, tests/test_reference_iq.py). Element j < 16 of a 32-value group is the low nibble of byte j,
element j + 16 its high nibble; the nibble indexes a table of 16 values.

* MXFP4 (17 bytes / 32): e @0 (E8M0 exponent), qs[16] @1.    y = KV_MXFP4[q] * 2^(e - 128)
  (the table holds the E2M1 values doubled, so the scale is half of 2^(e - 127))
* IQ4_NL (18 / 32): d f16 @0, qs[16] @2.                      y = d * KV_IQ4[q]
* IQ4_XS (136 / 256): d f16 @0, scales_h u16 @2, scales_l[4] @4, qs[128] @8; group g of 32 has
  the 6-bit scale ls = low nibble g of scales_l | bits 2g..2g+1 of scales_h << 4, dl = d * (ls - 32),
  y = dl * KV_IQ4[q].
"""

from __future__ import annotations

import numpy as np

KV_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)
KV_IQ4 = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


def _nibble_groups(qs: np.ndarray) -> np.ndarray:
    """(..., 16) bytes -> (..., 32) indices in element order: low nibbles, then high nibbles."""
    return np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=-1)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """ggml_e8m0_to_fp32_half: 2^(e - 128) as float32, subnormal for e < 2."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def _f16(b: np.ndarray, off: int) -> np.ndarray:
    return np.ascontiguousarray(b[:, off:off + 2]).view(np.float16).astype(np.float32)  # (n, 1)


def deq_mxfp4(b: np.ndarray) -> np.ndarray:
    """(n, 17) blocks -> (n, 32) float32."""
    d = e8m0_half(b[:, :1])
    return d * KV_MXFP4[_nibble_groups(b[:, 1:17])].astype(np.float32)


def deq_iq4_nl(b: np.ndarray) -> np.ndarray:
    """(n, 18) blocks -> (n, 32) float32."""
    return _f16(b, 0) * KV_IQ4[_nibble_groups(b[:, 2:18])].astype(np.float32)


def deq_iq4_xs(b: np.ndarray) -> np.ndarray:
    """(n, 136) blocks -> (n, 256) float32."""
    n = b.shape[0]
    d = _f16(b, 0)
    sh = np.ascontiguousarray(b[:, 2:4]).view(np.uint16)  # (n, 1)
    sl = b[:, 4:8]
    g = np.arange(8)
    low = (sl[:, g // 2] >> (4 * (g % 2)).astype(np.uint8)) & np.uint8(15)
    high = ((sh >> (2 * g).astype(np.uint16)) & np.uint16(3)).astype(np.uint8)
    ls = (low | (high << np.uint8(4))).astype(np.int32) - 32
    dl = (d * ls.astype(np.float32))[:, :, None]  # (n, 8, 1)
    q = _nibble_groups(b[:, 8:136].reshape(n, 8, 16))  # (n, 8, 32)
    return (dl * KV_IQ4[q].astype(np.float32)).reshape(n, 256)


KERNELS = {"MXFP4": (17, 32, deq_mxfp4), "IQ4_NL": (18, 32, deq_iq4_nl), "IQ4_XS": (136, 256, deq_iq4_xs)}


def dequantize_iq(raw: np.ndarray, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """float32 array of ``shape`` from the raw bytes of a tensor of type ``name`` (KERNELS)."""
    block_bytes, block_elems, fn = KERNELS[name]
    n = int(np.prod(shape))
    if n % block_elems:
        raise ValueError(f"{name}: {n} elements are not whole blocks of {block_elems}")
    b = np.asarray(raw, np.uint8).reshape(-1)
    if b.size != n // block_elems * block_bytes:
        raise ValueError(f"{name}: {b.size} bytes for {n} elements (want {n // block_elems * block_bytes})")
    return fn(b.reshape(-1, block_bytes)).reshape(shape)


def random_iq_blocks(name: str, n_elems: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """Well-formed random blocks of type ``name`` (KERNELS) whose values have an RMS near ``scale``
    (synth's weights for twins of MXFP4 / IQ4 models): uniform indices, scales within a factor of
    two of the one that gives ``scale``."""
    block_bytes, block_elems, _ = KERNELS[name]
    if n_elems % block_elems:
        raise ValueError(f"{name}: {n_elems} elements are not whole blocks of {block_elems}")
    if not (np.isfinite(scale) and 1e-6 <= scale <= 1e3):
        raise ValueError(f"{name} weights of RMS {scale:g}: give a scale from 1e-6 to 1e3")
    n = n_elems // block_elems
    b = np.empty((n, block_bytes), np.uint8)
    jitter = rng.uniform(-1.0, 1.0, n)  # log2 of the factor around the target scale
    if name == "MXFP4":
        rms = float(np.sqrt(np.mean(KV_MXFP4.astype(np.float64) ** 2)))
        b[:, 0] = np.clip(np.rint(128 + np.log2(scale / rms) + jitter), 0, 254).astype(np.uint8)
        b[:, 1:] = rng.integers(0, 256, (n, 16), dtype=np.uint8)
        return b.reshape(-1)
    rms = float(np.sqrt(np.mean(KV_IQ4.astype(np.float64) ** 2)))
    if name == "IQ4_NL":
        b[:, :2] = (scale / rms * 2.0 ** jitter).astype(np.float16).reshape(n, 1).view(np.uint8)
        b[:, 2:] = rng.integers(0, 256, (n, 16), dtype=np.uint8)
        return b.reshape(-1)
    ls = rng.integers(40, 64, (n, 8))  # 6-bit group scales, ls - 32 from 8 to 31 (rms ~21)
    b[:, :2] = (scale / rms / 21.0 * 2.0 ** jitter).astype(np.float16).reshape(n, 1).view(np.uint8)
    high = ((ls >> 4) << (2 * np.arange(8))).sum(-1).astype(np.uint16)
    b[:, 2:4] = high.reshape(n, 1).view(np.uint8)
    low = (ls & 15).astype(np.uint8)
    b[:, 4:8] = low[:, 0::2] | (low[:, 1::2] << np.uint8(4))
    b[:, 8:] = rng.integers(0, 256, (n, 128), dtype=np.uint8)
    return b.reshape(-1)
