"""numpy reference dequantization of ggml tensor types, and random well-formed quantized blocks.

The ground truth the CUDA kernels are tested against, and the numpy backend's weight decoder.
Block layouts and float32 arithmetic follow ggml-quants.c ``dequantize_row_*`` exactly (same
operation order; results equal the ``gguf`` package's bit for bit). Block sizes come from
``formats.py`` only. The K-quant kernels live in ``reference_k.py``.

Public API::

    dequantize(raw, type_id, shape) -> float32 array of `shape`
    dequantize_rows(raw, type_id, row_elems, rows) -> float32 (*rows.shape, row_elems)
    random_blocks(type_id, n_elems, rng, scale=1.0) -> uint8 array of nbytes(type_id, n_elems)

Legacy 32-element block layouts (byte offsets; f16 little-endian; element j < 16 is the low
nibble of qs[j], element j + 16 its high nibble; Q5 high bit of element i = bit i of qh):

* Q4_0 (18): d @0, qs[16] @2.               y = (q - 8) * d
* Q4_1 (20): d @0, m @2, qs[16] @4.         y = q * d + m
* Q5_0 (22): d @0, qh[4] @2, qs[16] @6.      y = (q - 16) * d
* Q5_1 (24): d @0, m @2, qh[4] @4, qs @8.    y = q * d + m
* Q8_0 (34): d @0, qs[32] int8 @2.          y = q * d
"""

from __future__ import annotations

import math

import numpy as np

from . import reference_iq
from .formats import FORMATS, SUPPORTED, SUPPORTED_IDS, Format, nbytes
from .reference_k import KERNELS as _K_KERNELS
from .reference_k import f16_field

__all__ = ["dequantize", "dequantize_rows", "random_blocks"]

_CHUNK_ELEMS = 1 << 18  # elements per kernel call: bounds the temporaries (a few MB) and call overhead


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16) bytes -> (n, 32) uint8 in element order: low nibbles, then high nibbles."""
    n = qs.shape[0]
    q = np.empty((n, 2, 16), np.uint8)
    np.bitwise_and(qs, np.uint8(15), out=q[:, 0])
    np.right_shift(qs, np.uint8(4), out=q[:, 1])
    return q.reshape(n, 32)


def _q5(blocks: np.ndarray, qh_off: int) -> np.ndarray:
    q = _nibbles(blocks[:, qh_off + 4:qh_off + 20])
    q |= np.unpackbits(blocks[:, qh_off:qh_off + 4], axis=1, bitorder="little") << np.uint8(4)
    return q


def _deq_q4_0(b: np.ndarray, out: np.ndarray) -> None:
    q = _nibbles(b[:, 2:18]).view(np.int8)
    q -= np.int8(8)
    np.multiply(q, f16_field(b, 0), out=out)


def _deq_q4_1(b: np.ndarray, out: np.ndarray) -> None:
    np.multiply(_nibbles(b[:, 4:20]), f16_field(b, 0), out=out)
    np.add(out, f16_field(b, 2), out=out)


def _deq_q5_0(b: np.ndarray, out: np.ndarray) -> None:
    q = _q5(b, 2).view(np.int8)
    q -= np.int8(16)
    np.multiply(q, f16_field(b, 0), out=out)


def _deq_q5_1(b: np.ndarray, out: np.ndarray) -> None:
    np.multiply(_q5(b, 4), f16_field(b, 0), out=out)
    np.add(out, f16_field(b, 2), out=out)


def _deq_q8_0(b: np.ndarray, out: np.ndarray) -> None:
    np.multiply(b[:, 2:34].view(np.int8), f16_field(b, 0), out=out)


_KERNELS = {"Q4_0": _deq_q4_0, "Q4_1": _deq_q4_1, "Q5_0": _deq_q5_0, "Q5_1": _deq_q5_1,
            "Q8_0": _deq_q8_0, **_K_KERNELS}
# the table types' and the 1- to 3-bit i-quants' dequantizers are reference_iq's
TABLE_TYPES = ("MXFP4", "IQ4_NL", "IQ4_XS")
assert set(_KERNELS) | {"F32", "F16", "BF16"} | set(reference_iq.KERNELS) == set(SUPPORTED)


def _check_type(type_id: int) -> Format:
    if type_id not in SUPPORTED_IDS:
        raise ValueError(f"ggml type id {type_id} is not supported by the reference "
                         f"dequantizer; supported: {', '.join(SUPPORTED)}")
    return FORMATS[type_id]


def _as_bytes(raw: np.ndarray) -> np.ndarray:
    raw = np.asarray(raw)  # drops np.memmap (no copy)
    if raw.dtype != np.uint8:
        raise ValueError(f"raw must be a uint8 array, got {raw.dtype}")
    return raw.reshape(-1)


# byte offsets of each block's f16 fields (scales, minimums): the only values of a quantized
# block that can be NaN or infinite
F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}


def all_finite(raw: np.ndarray, type_id: int) -> bool:
    """Whether every value the blocks of ``raw`` encode is finite: the f16 fields of quantized
    blocks, every element of float tensors (BF16: exponent bits not all set)."""
    fmt = _check_type(type_id)
    if fmt.name == "BF16":
        return not ((raw.view("<u2") & 0x7F80) == 0x7F80).any()
    if fmt.name in ("F32", "F16"):
        return bool(np.isfinite(raw.view("<f4" if fmt.name == "F32" else "<f2")).all())
    blocks = raw.reshape(-1, fmt.block_bytes)
    if fmt.name == "MXFP4":  # an E8M0 scale of 0xFF is NaN
        return not (blocks[:, 0] == 0xFF).any()
    if fmt.name == "IQ1_M":  # its f16 scale is spread over the scale words' top nibbles
        return bool(np.isfinite(reference_iq.iq1_m_scale(blocks)).all())
    # an f16 is NaN or infinite when its exponent bits (0x7C of the high byte) are all set
    fields = (0,) if fmt.name in reference_iq.KERNELS else F16_FIELDS[fmt.name]  # the i-quants: d at 0
    return not any(((blocks[:, o + 1] & 0x7C) == 0x7C).any() for o in fields)


def dequantize(raw: np.ndarray, type_id: int, shape: tuple[int, ...]) -> np.ndarray:
    """Decode ``raw`` (uint8, exactly ``nbytes(type_id, prod(shape))`` bytes) into float32 ``shape``.

    numpy order: the last dimension is contiguous and must be a whole number of blocks.
    Raises ValueError for an unsupported type, a bad shape or a wrong byte count.
    F32 returns a view of ``raw`` (read-only if ``raw`` is); every other type returns a new array.
    """
    fmt = _check_type(type_id)
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    if fmt.block_elems > 1 and (not shape or shape[-1] % fmt.block_elems):
        raise ValueError(f"{fmt.name}: last dimension of shape {shape} is not a multiple of the "
                         f"{fmt.block_elems}-element block")
    n = math.prod(shape)
    raw = _as_bytes(raw)
    if raw.size != nbytes(type_id, n):
        raise ValueError(f"{fmt.name} {shape}: expected {nbytes(type_id, n)} bytes, got {raw.size}")
    if fmt.name == "F32":
        return raw.view("<f4").reshape(shape)
    if fmt.name == "F16":
        return raw.view("<f2").astype(np.float32).reshape(shape)
    if fmt.name == "BF16":
        out = np.empty(n, np.uint32)
        np.left_shift(raw.view("<u2"), np.uint32(16), out=out, dtype=np.uint32)
        return out.view(np.float32).reshape(shape)
    nb = n // fmt.block_elems
    blocks = raw.reshape(nb, fmt.block_bytes)
    out = np.empty((nb, fmt.block_elems), np.float32)
    step = max(1, _CHUNK_ELEMS // fmt.block_elems)
    for i in range(0, nb, step):
        if fmt.name in reference_iq.KERNELS:  # reference_iq's dequantizers return their blocks' values
            out[i:i + step] = reference_iq.KERNELS[fmt.name][2](blocks[i:i + step])
        else:
            _KERNELS[fmt.name](blocks[i:i + step], out[i:i + step])
    return out.reshape(shape)


def dequantize_rows(raw: np.ndarray, type_id: int, row_elems: int, rows: np.ndarray) -> np.ndarray:
    """Decode only the selected rows of a row-major matrix stored in ``raw``.

    ``raw`` holds whole rows of ``row_elems`` elements each (``nbytes(type_id, row_elems)`` bytes
    per row). ``rows`` is an integer array of row indices (any shape, repeats allowed); the result
    is float32 of shape ``(*rows.shape, row_elems)``. Only those rows' bytes are read, so this is
    the embedding lookup. Out-of-range or negative indices raise ValueError.
    """
    fmt = _check_type(type_id)
    row_elems = int(row_elems)
    if row_elems <= 0 or row_elems % fmt.block_elems:
        raise ValueError(f"{fmt.name}: row of {row_elems} elements is not a positive whole number "
                         f"of {fmt.block_elems}-element blocks")
    raw = _as_bytes(raw)
    row_bytes = nbytes(type_id, row_elems)
    if raw.size % row_bytes:
        raise ValueError(f"{fmt.name}: {raw.size} bytes is not a whole number of {row_bytes}-byte rows")
    n_rows = raw.size // row_bytes
    rows = np.asarray(rows)
    if rows.dtype.kind not in "iu":
        raise ValueError(f"row indices must be integers, got {rows.dtype}")
    flat = rows.reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() >= n_rows):
        raise ValueError(f"row index out of range [0, {n_rows}): min {flat.min()}, max {flat.max()}")
    picked = raw.reshape(n_rows, row_bytes)[flat]  # copies just the selected rows
    return dequantize(picked, type_id, (flat.size, row_elems)).reshape(*rows.shape, row_elems)


# ---------------------------------------------------------------------------------------------
# random well-formed blocks

def _msq(lo: int, hi: int) -> float:
    """E[x^2] for x uniform on the integers lo..hi."""
    k = np.arange(lo, hi + 1, dtype=np.float64)
    return float(np.mean(k * k))


def _msq_min(a_hi: int, q_hi: int) -> float:
    """E[(a*q - E[q]*b)^2] for a, b ~ U{0..a_hi}, q ~ U{0..q_hi} independent (K-quants with mins)."""
    ea, eq = a_hi / 2, q_hi / 2
    return _msq(0, a_hi) * (_msq(0, q_hi) + eq * eq) - 2 * eq * eq * ea * ea


# name -> (d offset, min offset or None, min / d ratio, min jitter, E[y^2] per block at d = 1).
# Legacy mins are added (m = d * (ratio + U(-1, 1))); K-quant mins are subtracted (dmin = ratio*d).
_RANDOM = {
    "Q4_0": (0, None, 0.0, 0.0, _msq(-8, 7)),
    "Q4_1": (0, 2, -7.5, 1.0, _msq(0, 15) - 7.5 ** 2 + 1 / 3),
    "Q5_0": (0, None, 0.0, 0.0, _msq(-16, 15)),
    "Q5_1": (0, 2, -15.5, 1.0, _msq(0, 31) - 15.5 ** 2 + 1 / 3),
    "Q8_0": (0, None, 0.0, 0.0, _msq(-128, 127)),
    "Q2_K": (80, 82, 1.5, 0.0, _msq_min(15, 3)),
    "Q3_K": (108, None, 0.0, 0.0, _msq(-32, 31) * _msq(-4, 3)),
    "Q4_K": (0, 2, 7.5, 0.0, _msq_min(63, 15)),
    "Q5_K": (0, 2, 15.5, 0.0, _msq_min(63, 31)),
    "Q6_K": (208, None, 0.0, 0.0, _msq(-128, 127) * _msq(-32, 31)),
}
_JITTER_MSQ = 13 / 12  # E[J^2] for the per-block factor J ~ U(0.5, 1.5)
_F16_LO, _F16_HI = 2.0 ** -20, 60000.0  # allowed range of every stored f16 scale / min


def random_blocks(type_id: int, n_elems: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """Random but well-formed data: ``nbytes(type_id, n_elems)`` uint8.

    Value distribution of the dequantized result: root-mean-square ``scale`` (to within ~1% on
    1M elements; pass ``scale=0.02`` for LLM-like weights), mean ~0 except where ggml's grid is
    asymmetric (Q4_0: -0.10*scale, Q5_0: -0.05*scale, Q8_0: -0.007*scale).

    * F32 / F16 / BF16: N(0, scale^2) (BF16 rounded to nearest even).
    * Quantized types: every quant bit *and every packed sub-block scale / min* is uniformly
      random (so all 6-bit K scales, Q6_K's signed int8 scales, Q3_K's hmask... are exercised);
      only the f16 super-scales are set: per block d = d0 * J with J ~ U(0.5, 1.5) and d0 chosen
      so that E[y^2] = scale^2. Offsets are chosen so the mean is ~0: Q4_1 / Q5_1 m = -d * (7.5 /
      15.5 + U(-1, 1)); K-quant dmin = d * E[q] (1.5, 7.5, 15.5 for Q2_K, Q4_K, Q5_K). Values
      are therefore uniform on each block's grid (a mixture of uniforms), not Gaussian:
      |y| <= ~2.5*scale for the 32-element types, <= ~5.5*scale for the K-quants.

    Every stored f16 is finite and lies in [2^-20, 60000] (possibly subnormal, as in real Q6_K
    files), so the output never has NaN/inf; a ``scale`` that would need f16 values outside that
    range raises ValueError ([0.003, 1e4] is valid for every type; F16/BF16 need [1e-3, 1e3]).
    """
    fmt = _check_type(type_id)
    n_elems = int(n_elems)
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be positive and finite, got {scale}")
    if n_elems < 0 or n_elems % fmt.block_elems:
        raise ValueError(f"{fmt.name}: {n_elems} elements is not a whole number of {fmt.block_elems}-element blocks")
    if fmt.block_elems == 1:
        if fmt.name != "F32" and not 1e-3 <= scale <= 1e3:
            raise ValueError(f"{fmt.name}: scale {scale} outside [1e-3, 1e3]")
        x = rng.standard_normal(n_elems, dtype=np.float32)
        x *= np.float32(scale)
        if fmt.name == "F32":
            return x.view(np.uint8)
        if fmt.name == "F16":
            return x.astype("<f2").view(np.uint8)
        u = x.view(np.uint32)
        u += np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))  # round to nearest even
        return (u >> np.uint32(16)).astype("<u2").view(np.uint8)

    if fmt.name in TABLE_TYPES:
        return _random_table_blocks(fmt.name, n_elems, rng, scale)
    if fmt.name in reference_iq.KERNELS:  # the 1- to 3-bit i-quants: reference_iq's generator
        return reference_iq.random_iq_blocks(fmt.name, n_elems, rng, scale)
    d_off, m_off, ratio, jitter, msq = _RANDOM[fmt.name]
    d0 = scale / math.sqrt(msq * _JITTER_MSQ)
    extremes = [d0 * 0.5, d0 * 1.5]
    if m_off is not None:
        extremes += [d0 * 0.5 * max(abs(ratio) - jitter, 0.5), d0 * 1.5 * (abs(ratio) + jitter)]
    if not (_F16_LO <= min(extremes) and max(extremes) <= _F16_HI):
        raise ValueError(f"{fmt.name}: scale {scale} needs f16 block scales outside [2^-20, 60000]")
    nb = n_elems // fmt.block_elems
    n_bytes = nb * fmt.block_bytes
    words = rng.bit_generator.random_raw((n_bytes + 7) // 8)
    blocks = words.view(np.uint8)[:n_bytes].reshape(nb, fmt.block_bytes)
    d = rng.uniform(0.5, 1.5, nb).astype(np.float32)
    d *= np.float32(d0)
    blocks[:, d_off:d_off + 2] = d.astype("<f2").view(np.uint8).reshape(nb, 2)
    if m_off is not None:
        c = np.float32(ratio) + (rng.uniform(-jitter, jitter, nb).astype(np.float32) if jitter else np.float32(0))
        blocks[:, m_off:m_off + 2] = (d * c).astype("<f2").view(np.uint8).reshape(nb, 2)
    return blocks.reshape(-1)



def _random_table_blocks(name: str, n_elems: int, rng: np.random.Generator, scale: float) -> np.ndarray:
    """MXFP4 / IQ4_NL / IQ4_XS with every quant bit random (IQ4_XS: all 64 group scales, negative
    ones too) and the block scales set for an RMS of ``scale``: IQ4 d = d0 J, J ~ U(0.5, 1.5);
    MXFP4's power-of-two scales mix the two around the target so the mean square is its square."""
    block_bytes, block_elems, _ = reference_iq.KERNELS[name]
    nb = n_elems // block_elems
    b = rng.integers(0, 256, (nb, block_bytes), dtype=np.uint8)
    table = reference_iq.KV_MXFP4 if name == "MXFP4" else reference_iq.KV_IQ4
    msq = float(np.mean(table.astype(np.float64) ** 2)) * (_msq(-32, 31) if name == "IQ4_XS" else 1.0)
    if name == "MXFP4":
        t2 = scale * scale / msq  # the mean square of the scales 2^(e - 128)
        e0 = math.floor(math.log2(t2) / 2)
        p = (t2 / 4.0 ** e0 - 1) / 3
        e = 128 + e0 + (rng.random(nb) < p)
        if not (1 <= e.min() and e.max() <= 254):
            raise ValueError(f"MXFP4: scale {scale} needs E8M0 scales outside 2^-127..2^126")
        b[:, 0] = e.astype(np.uint8)
        return b.reshape(-1)
    d = rng.uniform(0.5, 1.5, nb) * (scale / math.sqrt(msq * _JITTER_MSQ))
    b[:, :2] = d.astype("<f2").view(np.uint8).reshape(nb, 2)
    return b.reshape(-1)
