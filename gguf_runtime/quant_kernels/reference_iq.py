"""numpy reference dequantization of the non-linear types: MXFP4 (gpt-oss), IQ4_NL, IQ4_XS and the
1- to 3-bit i-quants IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M.

The oracle the CUDA kernels (quant_iq.cuh, the table types in quant_types.cuh) are tested against,
as reference.py is for the linear types. Layouts and float32
arithmetic follow ggml-quants.c ``dequantize_row_*`` (results equal the ``gguf`` package's bit for
bit, tests/test_reference_iq.py). Element j < 16 of a 32-value group is the low nibble of byte j,
element j + 16 its high nibble; the nibble indexes a table of 16 values.

* MXFP4 (17 bytes / 32): e @0 (E8M0 exponent), qs[16] @1.    y = KV_MXFP4[q] * 2^(e - 128)
  (the table holds the E2M1 values doubled, so the scale is half of 2^(e - 127))
* IQ4_NL (18 / 32): d f16 @0, qs[16] @2.                      y = d * KV_IQ4[q]
* IQ4_XS (136 / 256): d f16 @0, scales_h u16 @2, scales_l[4] @4, qs[128] @8; group g of 32 has
  the 6-bit scale ls = low nibble g of scales_l | bits 2g..2g+1 of scales_h << 4, dl = d * (ls - 32),
  y = dl * KV_IQ4[q].

The i-quants (256 values a block, eight groups of 32; d is an f16 at @0 except in IQ1_M) index
grids of 8 or 4 values (iq_grids.py: ggml's iq*_grid tables, generated once from the gguf package's).
A "sign index" picks a KSIGNS byte whose bit j negates value j of a row of 8. Each value is
``db * grid[j] * (+-1)`` in that order (IQ1: ``dl * (grid[j] + delta)``), db computed once a group
(or half group) in float32 exactly as ggml writes it:

* IQ2_XXS (66 / 256): d @0, u32 pairs @2, one a group: the first's 4 bytes index IQ2XXS_GRID, the
  second holds four 7-bit sign indices (bits 0..27) and s (bits 28..31); db = d * (0.5 + s) * 0.25.
* IQ2_XS (74 / 256): d @0, qs u16[32] @2 (9-bit IQ2XS_GRID index, 7-bit sign index above it),
  scales[8] @66: a nibble a half group (low nibble first), db = d * (0.5 + s) * 0.25.
* IQ2_S (82 / 256): d @0, qs[32] @2, signs[32] @34 (a bit a value), qh[8] @66 (bits 2l..2l+1 of
  group g's byte are bits 8..9 of its row l's IQ2S_GRID index), scales[8] @74 as in IQ2_XS.
* IQ3_XXS (98 / 256): d @0, qs[64] @2 (a byte a row of 4, IQ3XXS_GRID), u32[8] @66: a group's four
  sign indices and s as in IQ2_XXS; db = d * (0.5 + s) * 0.5.
* IQ3_S (110 / 256): d @0, qs[64] @2, qh[8] @66 (bit k of group g's byte is bit 8 of its k-th
  IQ3S_GRID index), signs[32] @74 (a bit a value), scales[4] @106 (a nibble a group, low first);
  db = d * (1 + 2 s).
* IQ1_S (50 / 256): d @0, qs[32] @2, qh u16[8] @34, one a group: bits 3l..3l+2 are bits 8..10 of
  row l's IQ1S_GRID index, s is bits 12..14, bit 15 the sign of delta = +-1/8; dl = d * (2 s + 1).
* IQ1_M (56 / 256): qs[32] @0, qh[16] @32 (a nibble a row, low first: 3 high index bits, then the
  sign of delta), scales u16[4] @48: d is the f16 made of the four words' top nibbles (word 0's
  lowest), the 12 bits below are four 3-bit s, one a half group; dl = d * (2 s + 1).
"""

from __future__ import annotations

import numpy as np

from .iq_grids import IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS

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


# ---- 1- to 3-bit i-quants -------------------------------------------------------------------------

# The grids as float32, as the dequantizers multiply them (values up to 62: exact).
_G2XXS, _G2XS, _G2S, _G3XXS, _G3S, _G1S = (g.astype(np.float32) for g in
                                           (IQ2XXS_GRID, IQ2XS_GRID, IQ2S_GRID, IQ3XXS_GRID, IQ3S_GRID, IQ1S_GRID))
_IQ1_DELTA = np.float32(0.125)


def _words(b: np.ndarray, lo: int, hi: int, dtype: str) -> np.ndarray:
    """Bytes lo:hi of each block as little-endian words: (n, (hi - lo) / size)."""
    return np.ascontiguousarray(b[:, lo:hi]).view(dtype)


def _bits(x: np.ndarray, n: int, step: int = 1, width: int = 1) -> np.ndarray:
    """(..., n) fields of ``width`` bits of x, at bits 0, step, 2 step, ..."""
    return (x[..., None] >> (step * np.arange(n)).astype(x.dtype)) & x.dtype.type((1 << width) - 1)


def _nibbles(x: np.ndarray) -> np.ndarray:
    """(n, k) bytes -> (n, 2k) nibbles in order: byte 0 low, byte 0 high, byte 1 low, ..."""
    return _bits(x, 2, 4, 4).reshape(x.shape[0], -1)


def _sign(bits: np.ndarray) -> np.ndarray:
    """-1.0 where a bit is set, +1.0 elsewhere (the ``signs & kmask ? -1.f : 1.f`` factor)."""
    return np.where(bits != 0, np.float32(-1), np.float32(1))


def _ksign_bits(idx: np.ndarray) -> np.ndarray:
    """(...) 7-bit sign indices -> (..., 8) sign bits of their KSIGNS bytes."""
    return _bits(KSIGNS[idx], 8)


def deq_iq2_xxs(b: np.ndarray) -> np.ndarray:
    """(n, 66) blocks -> (n, 256) float32."""
    n = b.shape[0]
    aux = _words(b, 2, 66, "<u4").reshape(n, 8, 2)
    db = _f16(b, 0) * (np.float32(0.5) + (aux[..., 1] >> 28).astype(np.float32)) * np.float32(0.25)
    grid = _G2XXS[b[:, 2:66].reshape(n, 8, 8)[:, :, :4]]  # (n, 8, 4, 8)
    sign = _sign(_ksign_bits(_bits(aux[..., 1], 4, 7, 7)))
    return (db[..., None, None] * grid * sign).reshape(n, 256)


def deq_iq2_xs(b: np.ndarray) -> np.ndarray:
    """(n, 74) blocks -> (n, 256) float32."""
    n = b.shape[0]
    qs = _words(b, 2, 66, "<u2").reshape(n, 16, 2)  # two rows of 8 a scale
    db = _f16(b, 0) * (np.float32(0.5) + _nibbles(b[:, 66:74]).astype(np.float32)) * np.float32(0.25)
    grid = _G2XS[qs & np.uint16(511)]  # (n, 16, 2, 8)
    return (db[..., None, None] * grid * _sign(_ksign_bits(qs >> np.uint16(9)))).reshape(n, 256)


def deq_iq2_s(b: np.ndarray) -> np.ndarray:
    """(n, 82) blocks -> (n, 256) float32."""
    n = b.shape[0]
    qh = _bits(b[:, 66:74], 4, 2, 2).reshape(n, 32).astype(np.uint16)
    grid = _G2S[b[:, 2:34].astype(np.uint16) | (qh << np.uint16(8))].reshape(n, 16, 2, 8)
    sign = _sign(_bits(b[:, 34:66], 8)).reshape(n, 16, 2, 8)
    db = _f16(b, 0) * (np.float32(0.5) + _nibbles(b[:, 74:82]).astype(np.float32)) * np.float32(0.25)
    return (db[..., None, None] * grid * sign).reshape(n, 256)


def deq_iq3_xxs(b: np.ndarray) -> np.ndarray:
    """(n, 98) blocks -> (n, 256) float32."""
    n = b.shape[0]
    aux = _words(b, 66, 98, "<u4")  # (n, 8)
    db = _f16(b, 0) * (np.float32(0.5) + (aux >> 28).astype(np.float32)) * np.float32(0.5)
    grid = _G3XXS[b[:, 2:66]].reshape(n, 8, 4, 8)  # two rows of 4 a sign byte
    sign = _sign(_ksign_bits(_bits(aux, 4, 7, 7)))
    return (db[..., None, None] * grid * sign).reshape(n, 256)


def deq_iq3_s(b: np.ndarray) -> np.ndarray:
    """(n, 110) blocks -> (n, 256) float32."""
    n = b.shape[0]
    qh = _bits(b[:, 66:74], 8).reshape(n, 64).astype(np.uint16)
    grid = _G3S[b[:, 2:66].astype(np.uint16) | (qh << np.uint16(8))].reshape(n, 8, 32)
    sign = _sign(_bits(b[:, 74:106], 8)).reshape(n, 8, 32)
    db = _f16(b, 0) * (1 + 2 * _nibbles(b[:, 106:110]).astype(np.int32)).astype(np.float32)
    return (db[..., None] * grid * sign).reshape(n, 256)


def deq_iq1_s(b: np.ndarray) -> np.ndarray:
    """(n, 50) blocks -> (n, 256) float32."""
    n = b.shape[0]
    qh = _words(b, 34, 50, "<u2")  # (n, 8)
    dl = _f16(b, 0) * (2 * ((qh >> 12) & 7).astype(np.int32) + 1).astype(np.float32)
    delta = np.where(qh & np.uint16(0x8000), -_IQ1_DELTA, _IQ1_DELTA)
    idx = b[:, 2:34].astype(np.uint16) | (_bits(qh, 4, 3, 3).reshape(n, 32) << np.uint16(8))
    return (dl[..., None] * (_G1S[idx].reshape(n, 8, 32) + delta[..., None])).reshape(n, 256)


def iq1_m_scale(b: np.ndarray) -> np.ndarray:
    """(n, 56) IQ1_M blocks -> (n, 1) float32 d: the f16 whose nibbles are the four scale words' tops."""
    sc = _words(b, 48, 56, "<u2")
    bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0x00F0) | ((sc[:, 2] >> 4) & 0x0F00) | (sc[:, 3] & 0xF000)
    return bits.astype(np.uint16).view(np.float16).astype(np.float32)[:, None]


def deq_iq1_m(b: np.ndarray) -> np.ndarray:
    """(n, 56) blocks -> (n, 256) float32."""
    n = b.shape[0]
    s = _bits(_words(b, 48, 56, "<u2"), 4, 3, 3).reshape(n, 16)  # a 3-bit scale a half group
    dl = iq1_m_scale(b) * (2 * s.astype(np.int32) + 1).astype(np.float32)
    qh = _nibbles(b[:, 32:48])  # (n, 32): a nibble a row of 8
    delta = np.where(qh & np.uint8(8), -_IQ1_DELTA, _IQ1_DELTA)
    idx = b[:, 0:32].astype(np.uint16) | ((qh & np.uint8(7)).astype(np.uint16) << np.uint16(8))
    rows = (_G1S[idx] + delta[..., None]).reshape(n, 16, 16)
    return (dl[..., None] * rows).reshape(n, 256)


KERNELS = {"MXFP4": (17, 32, deq_mxfp4), "IQ4_NL": (18, 32, deq_iq4_nl), "IQ4_XS": (136, 256, deq_iq4_xs),
           "IQ2_XXS": (66, 256, deq_iq2_xxs), "IQ2_XS": (74, 256, deq_iq2_xs), "IQ2_S": (82, 256, deq_iq2_s),
           "IQ3_XXS": (98, 256, deq_iq3_xxs), "IQ3_S": (110, 256, deq_iq3_s), "IQ1_S": (50, 256, deq_iq1_s),
           "IQ1_M": (56, 256, deq_iq1_m)}


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
    (synth's weights for twins of MXFP4 / IQ models): uniform indices (and signs, group scales),
    scales within a factor of two of the one that gives ``scale``."""
    block_bytes, block_elems, _ = KERNELS[name]
    if n_elems % block_elems:
        raise ValueError(f"{name}: {n_elems} elements are not whole blocks of {block_elems}")
    if not (np.isfinite(scale) and 1e-6 <= scale <= 1e3):
        raise ValueError(f"{name} weights of RMS {scale:g}: give a scale from 1e-6 to 1e3")
    n = n_elems // block_elems
    jitter = rng.uniform(-1.0, 1.0, n)  # log2 of the factor around the target scale
    if name not in ("MXFP4", "IQ4_NL", "IQ4_XS"):  # the blocks' RMS set exactly: the whole's is scale
        rms = 2.0 ** jitter
        return _random_low_bit(name, n, rng, rms * (scale / np.sqrt(np.mean(rms * rms))))
    b = np.empty((n, block_bytes), np.uint8)
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


def _set_d(name: str, b: np.ndarray, d: np.ndarray) -> None:
    """Writes each block's f16 d (n,): at @0, or for IQ1_M into the top nibbles of its scale words."""
    h = np.asarray(d).astype(np.float16).view(np.uint16)
    if name != "IQ1_M":
        b[:, :2] = h.astype("<u2").reshape(-1, 1).view(np.uint8)
        return
    sc = _words(b, 48, 56, "<u2") & np.uint16(0x0FFF)
    sc |= _bits(h, 4, 4, 4) << np.uint16(12)
    b[:, 48:56] = sc.astype("<u2").view(np.uint8)


def _random_low_bit(name: str, n: int, rng: np.random.Generator, rms: np.ndarray) -> np.ndarray:
    """n blocks of a 1- to 3-bit i-quant with RMS ``rms`` (n,) each: random bytes (every index,
    sign and group scale pattern is well-formed), then d = rms / the block's RMS at d = 1 (the
    values are d times what the other bits say; that RMS is > 0, as no grid value, nor grid value
    plus delta, is 0)."""
    block_bytes, _, fn = KERNELS[name]
    b = rng.integers(0, 256, (n, block_bytes), dtype=np.uint8)
    _set_d(name, b, np.ones(n))
    at_one = np.sqrt(np.mean(np.square(fn(b), dtype=np.float64), axis=1))
    _set_d(name, b, rms / at_one)
    return b.reshape(-1)
