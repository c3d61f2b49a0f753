"""The numpy oracle of MXFP4, IQ4_NL and IQ4_XS (reference_iq.py) against the gguf package, bit
for bit, on random bytes (every scale and index pattern, subnormal MXFP4 exponents included)."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize

from gguf_runtime.quant_kernels.reference_iq import (KERNELS, KV_IQ4, KV_MXFP4, dequantize_iq, e8m0_half,
                                                     random_iq_blocks)


def random_raw(name: str, n_blocks: int, rng) -> np.ndarray:
    block_bytes = KERNELS[name][0]
    raw = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
    if name != "MXFP4":  # f16 scales: finite ones of every magnitude (random bytes give NaN / inf too)
        d = (rng.standard_normal(n_blocks) * 10.0 ** rng.integers(-4, 3, n_blocks)).astype(np.float16)
        raw[:, :2] = d.view(np.uint8).reshape(n_blocks, 2)
    else:  # exponents up to 2^122 (x 12 stays finite), with the subnormal halves and the smallest normal
        raw[:, 0] = rng.integers(0, 251, n_blocks)
        raw[:4, 0] = [0, 1, 2, 250]
    return raw


@pytest.mark.parametrize("name", list(KERNELS))
def test_equals_gguf_package(name, rng):
    raw = random_raw(name, 512, rng)
    elems = KERNELS[name][1]
    ours = dequantize_iq(raw, name, (512 * elems // 64, 64))
    ref = gguf_dequantize(raw, QT[name]).reshape(ours.shape)
    assert ours.dtype == np.float32 and np.isfinite(ours).all()
    assert np.array_equal(ours.view(np.uint32), ref.astype(np.float32).view(np.uint32))  # bit for bit
    assert np.abs(ours).max() > 0


def test_tables_and_scales():
    assert KV_IQ4[0] == -127 and KV_IQ4[15] == 113 and KV_MXFP4[7] == 12 and KV_MXFP4[15] == -12
    assert e8m0_half(np.array([128], np.uint8))[0] == 1.0 and e8m0_half(np.array([130], np.uint8))[0] == 4.0
    assert e8m0_half(np.array([0], np.uint8))[0] == 2.0 ** -128


def test_layout_by_hand():
    """One IQ4_XS block written by hand: group 3 has scale 40 (ls 8 + 32), nibble 15 at element
    3 * 32 + 16 + 2 (the high nibble of byte 2 of the group) and 0 elsewhere."""
    b = np.zeros(136, np.uint8)
    b[:2] = np.array([0.5], np.float16).view(np.uint8)
    b[4 + 1] = 0x80 | 0x0  # scales_l byte 1: group 3's low nibble (high half) = 8
    b[2:4] = np.array([2 << 6], np.uint16).view(np.uint8)  # scales_h bits 6-7: group 3's high bits = 2
    b[8 + 3 * 16 + 2] = 0xF0
    y = dequantize_iq(b, "IQ4_XS", (256,))
    ls = 8 | (2 << 4)
    assert y[3 * 32 + 16 + 2] == np.float32(0.5 * (ls - 32)) * 113
    assert y[3 * 32 + 2] == np.float32(0.5 * (ls - 32)) * -127
    with pytest.raises(ValueError, match="whole blocks"):
        dequantize_iq(b, "IQ4_XS", (255,))


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("scale", [0.02, 1.0])
def test_random_blocks_have_the_asked_rms(name, scale, rng):
    """synth's weights of these types: finite, RMS within a factor of two of the scale, and the
    gguf package reads the same values."""
    n = 256 * 64
    raw = random_iq_blocks(name, n, rng, scale)
    y = dequantize_iq(raw, name, (n,))
    assert np.isfinite(y).all() and 0.5 < np.sqrt(np.mean(y.astype(np.float64) ** 2)) / scale < 2
    assert np.array_equal(y, gguf_dequantize(raw.reshape(-1, KERNELS[name][0]), QT[name]).reshape(-1))
    with pytest.raises(ValueError):
        random_iq_blocks(name, n + 1, rng, scale)
