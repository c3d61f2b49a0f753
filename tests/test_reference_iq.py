"""The numpy oracle of MXFP4, IQ4_NL, IQ4_XS and the 1- to 3-bit i-quants (reference_iq.py) against
the gguf package, bit for bit, on random bytes (every scale, index and sign pattern, subnormal MXFP4
exponents, zero / all-ones blocks included); the i-quant grids (iq_grids.py) against its tables."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants as gguf_quants
from gguf.quants import dequantize as gguf_dequantize

from gguf_runtime.format.blocks import BY_NAME, FORMATS
from gguf_runtime.quant_kernels import iq_grids
from gguf_runtime.quant_kernels.reference_iq import (KERNELS, KV_IQ4, KV_MXFP4, dequantize_iq, e8m0_half,
                                                     random_iq_blocks)

LOW_BIT = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"]


def put_f16(name: str, raw: np.ndarray, d: np.ndarray) -> None:
    """Writes f16 scales d (n,): at @0, or for IQ1_M as the top nibbles of the four u16 @48 (word 0
    holds bits 0..3), written here independently of reference_iq."""
    h = d.astype(np.float16).view(np.uint16)
    if name != "IQ1_M":
        raw[:, :2] = h.astype("<u2").view(np.uint8).reshape(-1, 2)
        return
    for w in range(4):  # the high byte of word w: its low nibble is scale bits, its high nibble d's
        byte = raw[:, 48 + 2 * w + 1]
        raw[:, 48 + 2 * w + 1] = (byte & 0x0F) | (((h >> (4 * w)) & 0xF) << 4).astype(np.uint8)


def random_raw(name: str, n_blocks: int, rng) -> np.ndarray:
    block_bytes = KERNELS[name][0]
    raw = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
    if name == "MXFP4":  # exponents up to 2^122 (x 12 stays finite), with the subnormal halves and the smallest normal
        raw[:, 0] = rng.integers(0, 251, n_blocks)
        raw[:4, 0] = [0, 1, 2, 250]
        return raw
    # f16 scales: finite ones of every magnitude (random bytes give NaN / inf too)
    d = (rng.standard_normal(n_blocks) * 10.0 ** rng.integers(-4, 3, n_blocks)).astype(np.float16)
    if name in LOW_BIT:  # edge blocks: every bit set (largest indices and group scales, every sign),
        raw[0], raw[1], raw[2] = 0xFF, 0x00, 0xFF  # none set, and every bit set under d = 0
        d[:6] = [1.5, -3.0, 0.0, 2.0 ** -24, 65504.0, -0.0]  # d: the smallest subnormal, the largest, -0
    put_f16(name, raw, d)
    return raw


@pytest.mark.parametrize("name", list(KERNELS))
def test_equals_gguf_package(name, rng):
    raw = random_raw(name, 512, rng)
    elems = KERNELS[name][1]
    ours = dequantize_iq(raw, name, (512 * elems // 64, 64))
    ref = gguf_dequantize(raw, QT[name]).reshape(ours.shape)
    assert ours.dtype == np.float32 and np.isfinite(ours).all()
    assert np.array_equal(ours.view(np.uint32), ref.astype(np.float32).view(np.uint32))  # bit for bit
    assert np.abs(ours).max() > 0 and (ours < 0).any() and (ours > 0).any()
    if name in LOW_BIT:  # the edge blocks (see random_raw)
        y = ours.reshape(512, -1)
        if name.startswith("IQ1"):  # no signs: grid rows 2047 and 0 are all +1 and all -1; delta -1/8, +1/8
            assert (y[0] == np.float32(1.5 * 15 * 0.875)).all() and (y[1] == np.float32(-3 * -0.875)).all()
        else:  # every sign set under d > 0, no sign under d < 0: negative values only (grids are > 0)
            assert (y[0] < 0).all() and (y[1] < 0).all()
        assert not y[2].any() and (y[3] != 0).any() and np.abs(y[4]).max() > 1e4


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


GRIDS = [("IQ2XXS_GRID", gguf_quants.IQ2_XXS), ("IQ2XS_GRID", gguf_quants.IQ2_XS), ("IQ2S_GRID", gguf_quants.IQ2_S),
         ("IQ3XXS_GRID", gguf_quants.IQ3_XXS), ("IQ3S_GRID", gguf_quants.IQ3_S), ("IQ1S_GRID", gguf_quants.IQ1_S)]


@pytest.mark.parametrize("table,cls", GRIDS, ids=[g[0] for g in GRIDS])
def test_grids_equal_gguf_package(table, cls):
    ours = getattr(iq_grids, table)
    cls.init_grid()
    ref = cls.grid.reshape(cls.grid_shape)
    assert ours.shape == ref.shape and np.array_equal(ours, ref)
    assert len(np.unique(ours, axis=0)) == len(ours)  # distinct rows: not a decoding of zeros


def test_ksigns_equal_gguf_package():
    ref = np.frombuffer(gguf_quants.IQ2_XXS.ksigns, np.uint8)
    assert np.array_equal(iq_grids.KSIGNS, ref)
    assert iq_grids.KSIGNS[127] == 0xFF and iq_grids.KSIGNS[1] == 0x81  # the 8th bit makes the count even


def test_block_sizes_match_the_file_table():
    """synth sizes a tensor's blocks with format.blocks and fills them with KERNELS' bytes."""
    for name, (block_bytes, block_elems, _) in KERNELS.items():
        assert FORMATS[BY_NAME[name]][1:] == (block_elems, block_bytes), name


def test_iq2_xxs_by_hand():
    """One IQ2_XXS block: group 5's first u32 indexes rows (0, 255, 1, 2), its second has sign index
    127 (all eight negative) for row 1 and s = 3: db = d * 3.5 * 0.25."""
    b = np.zeros(66, np.uint8)
    b[:2] = np.array([2.0], np.float16).view(np.uint8)
    b[2 + 8 * 5:2 + 8 * 5 + 4] = [0, 255, 1, 2]
    b[2 + 8 * 5 + 4:2 + 8 * 5 + 8] = np.array([(127 << 7) | (3 << 28)], "<u4").view(np.uint8)
    y = dequantize_iq(b, "IQ2_XXS", (256,)).reshape(8, 4, 8)
    db = np.float32(2.0 * 3.5 * 0.25)
    assert np.array_equal(y[5, 1], -db * iq_grids.IQ2XXS_GRID[255].astype(np.float32))
    assert np.array_equal(y[5, 0], db * iq_grids.IQ2XXS_GRID[0].astype(np.float32))
    assert np.array_equal(y[0, 0], np.float32(2.0 * 0.5 * 0.25) * iq_grids.IQ2XXS_GRID[0].astype(np.float32))


def test_synth_fills_the_low_bit_types(tmp_path):
    """synth (which takes its types from KERNELS) fills twins' tensors of each new type with
    random_iq_blocks: the twin's values have the asked RMS and the gguf package reads the same."""
    from gguf.constants import GGUFValueType as VT

    from gguf_runtime.format.gguf_file import open_gguf
    from gguf_runtime.tools.synth import write_twin
    from gguf_runtime.tools.synth_presets import pack_header
    table = [(f"blk.0.w{i}.weight", (256, 16), BY_NAME[name]) for i, name in enumerate(LOW_BIT)]
    hdr = tmp_path / "iq.hdr.gguf"
    hdr.write_bytes(pack_header([("general.architecture", VT.STRING, "llama")], table))
    write_twin(hdr, tmp_path / "iq.gguf", seed=1, scale=0.02, threads=1)
    f = open_gguf(tmp_path / "iq.gguf")
    for (tname, _, _), name in zip(table, LOW_BIT):
        raw, t = f.raw(tname), f.tensors[tname]
        assert t.type_name == name
        y = dequantize_iq(raw, name, t.shape)
        rms = float(np.sqrt(np.mean(y.astype(np.float64) ** 2)))
        assert np.isfinite(y).all() and 0.01 < rms < 0.04, (name, rms)
        ref = gguf_dequantize(np.asarray(raw).reshape(-1, KERNELS[name][0]), QT[name]).reshape(y.shape)
        assert np.array_equal(y, ref)
