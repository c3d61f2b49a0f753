"""numpy reference dequantization (gguf_runtime.quant_kernels.reference) against the gguf package.

Inputs are fresh random bytes every run; the seed is printed (shown by pytest on failure) and
can be pinned with QUANT_TEST_SEED=<n>.

Random raw bytes can hold f16 NaN/inf block scales. ``test_matches_gguf_finite_scales`` patches
every f16 scale/min field with a random *finite* f16 (full range: subnormals, negatives, up to
65504) and requires bit-identical, all-finite results; ``test_matches_gguf_raw_bytes`` keeps the
bytes as they are and requires bit-identical results except that NaNs only need the same positions.
"""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from gguf_runtime.quant_kernels import formats
from gguf_runtime.format.blocks import BY_NAME, FORMATS, SUPPORTED, nbytes
from gguf_runtime.quant_kernels.reference import dequantize, dequantize_rows, random_blocks

# Byte offsets of the f16 scale / min fields inside one block (ggml-common.h block structs).
from gguf_runtime.quant_kernels.reference import F16_FIELDS, TABLE_TYPES, all_finite  # noqa: E402
from gguf_runtime.quant_kernels.reference_iq import KERNELS as NONLINEAR  # noqa: E402
FLOATS = ("F32", "F16", "BF16")
IQ_TYPES = tuple(n for n in NONLINEAR if n not in TABLE_TYPES)  # the 1- to 3-bit i-quants
# (the table types, MXFP4 / IQ4_NL / IQ4_XS, and the i-quants dequantize through reference_iq:
# test_reference_iq)
QUANTS = tuple(n for n in SUPPORTED if n not in FLOATS + tuple(NONLINEAR))
assert set(F16_FIELDS) == set(QUANTS)


@pytest.fixture
def rng(request):
    seed = int(os.environ.get("QUANT_TEST_SEED", np.random.SeedSequence().entropy % 2**63))
    print(f"{request.node.name}: seed {seed} (rerun with QUANT_TEST_SEED={seed})")
    return np.random.default_rng(seed)


def shapes_for(name: str) -> list[tuple[int, ...]]:
    b = FORMATS[BY_NAME[name]].block_elems
    return [(b,), (1, b), (3, 5 * b), (2, 3, 7 * b), (4, 2 * b)]


def raw_bytes(rng, name: str, n_elems: int, finite: bool) -> np.ndarray:
    t = BY_NAME[name]
    raw = rng.integers(0, 256, nbytes(t, n_elems), dtype=np.uint8)
    if finite and name in F16_FIELDS:
        blocks = raw.reshape(-1, FORMATS[t].block_bytes)
        for off in F16_FIELDS[name]:
            h = blocks[:, off:off + 2].view("<u2")
            h[(h & 0x7C00) == 0x7C00] ^= 0x4000  # exponent 31 (inf/NaN) -> 15: finite, same sign/mantissa
    return raw


def gguf_deq(raw: np.ndarray, name: str, shape) -> np.ndarray:
    t = GGMLQuantizationType(BY_NAME[name])
    rows = raw.reshape(*shape[:-1], -1)
    return np.asarray(gguf.quants.dequantize(rows, t), dtype=np.float32).reshape(shape)


def assert_bit_equal(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype == np.float32
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    np.testing.assert_array_equal(nan_a, nan_b)
    ua, ub = a.view(np.uint32)[~nan_a], b.view(np.uint32)[~nan_b]
    bad = np.flatnonzero(ua != ub)
    assert bad.size == 0, f"{bad.size} mismatches, first at {bad[0]}: {a[~nan_a][bad[0]]} vs {b[~nan_b][bad[0]]}"


@pytest.mark.parametrize("name", SUPPORTED)
def test_matches_gguf_finite_scales(rng, name):
    for shape in shapes_for(name):
        raw = raw_bytes(rng, name, int(np.prod(shape)), finite=True)
        got = dequantize(raw, BY_NAME[name], shape)
        assert_bit_equal(got, gguf_deq(raw, name, shape))
        if name in QUANTS:
            assert np.isfinite(got).all()


@pytest.mark.parametrize("name", SUPPORTED)
def test_matches_gguf_raw_bytes(rng, name):
    shape = (3, 9 * FORMATS[BY_NAME[name]].block_elems)
    raw = raw_bytes(rng, name, int(np.prod(shape)), finite=False)
    with np.errstate(all="ignore"):  # inf * 0 -> NaN in both
        expected = gguf_deq(raw, name, shape)
        got = dequantize(raw, BY_NAME[name], shape)
    assert_bit_equal(got, expected)


def test_readonly_memmap_slice(rng, tmp_path):
    t = BY_NAME["Q4_K"]
    raw = random_blocks(t, 4 * 512, rng)
    path = tmp_path / "blob.bin"
    path.write_bytes(b"\x00" * 32 + raw.tobytes() + b"\x00" * 7)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    got = dequantize(mm[32:32 + raw.size], t, (4, 512))
    assert type(got) is np.ndarray
    np.testing.assert_array_equal(got, dequantize(raw, t, (4, 512)))
    rows = dequantize_rows(mm[32:32 + raw.size], t, 512, np.array([3, 0]))
    np.testing.assert_array_equal(rows, got[[3, 0]])


def test_q4_0_hand_block():
    # d = 0.5; qs[j] = (15 - j) << 4 | j: element j -> (j - 8) * 0.5, element 16 + j -> (7 - j) * 0.5
    j = np.arange(16, dtype=np.uint8)
    raw = np.concatenate([np.array([0.5], "<f2").view(np.uint8), ((15 - j) << 4) | j])
    expected = np.concatenate([(j - 8.0) * 0.5, (7.0 - j) * 0.5]).astype(np.float32)
    np.testing.assert_array_equal(dequantize(raw, BY_NAME["Q4_0"], (32,)), expected)


@pytest.mark.parametrize("name", SUPPORTED)
def test_random_blocks(rng, name):
    t = BY_NAME[name]
    n = 1 << 18
    for scale in (0.02, 1.0, 5.0):
        raw = random_blocks(t, n, rng, scale=scale)
        assert raw.dtype == np.uint8 and raw.shape == (nbytes(t, n),)
        ref = gguf_deq(raw, name, (n,))
        assert np.isfinite(ref).all()
        assert np.count_nonzero(ref) > n // 2
        rms = float(np.sqrt(np.mean(ref.astype(np.float64) ** 2)))
        assert abs(rms / scale - 1) < 0.1, (scale, rms)
        assert abs(float(ref.mean())) < 0.15 * scale
        assert np.abs(ref).max() < 12 * scale
        assert_bit_equal(dequantize(raw, t, (n // 1024, 1024)), ref.reshape(n // 1024, 1024))
    if name in QUANTS:  # block scales vary from block to block
        d = raw.reshape(-1, FORMATS[t].block_bytes)[:, F16_FIELDS[name][0]:][:, :2].copy().view("<f2")
        assert np.unique(d).size > 10


def test_random_blocks_deterministic_and_errors():
    t = BY_NAME["Q6_K"]
    a = random_blocks(t, 2048, np.random.default_rng(7), 0.02)
    b = random_blocks(t, 2048, np.random.default_rng(7), 0.02)
    np.testing.assert_array_equal(a, b)
    for bad_scale in (0.0, -1.0, float("nan"), float("inf"), 1e-9, 1e12):
        with pytest.raises(ValueError):
            random_blocks(t, 2048, np.random.default_rng(0), bad_scale)
    with pytest.raises(ValueError):
        random_blocks(t, 100, np.random.default_rng(0))
    with pytest.raises(ValueError, match="type id 9 is not supported"):  # Q8_1: no kernels
        random_blocks(BY_NAME["Q8_1"], 32, np.random.default_rng(0))


@pytest.mark.parametrize("name", SUPPORTED)
def test_dequantize_rows(rng, name):
    t = BY_NAME[name]
    row_elems = 3 * FORMATS[t].block_elems
    n_rows = 11
    raw = random_blocks(t, n_rows * row_elems, rng, 0.5)
    full = dequantize(raw, t, (n_rows, row_elems))
    rows = rng.integers(0, n_rows, 6)
    np.testing.assert_array_equal(dequantize_rows(raw, t, row_elems, rows), full[rows])
    rows2d = np.array([[0, 10, 10], [5, 0, 3]], dtype=np.uint32)
    np.testing.assert_array_equal(dequantize_rows(raw, t, row_elems, rows2d), full[rows2d])
    assert dequantize_rows(raw, t, row_elems, np.array([], np.int64)).shape == (0, row_elems)
    for bad in ([11], [-1]):
        with pytest.raises(ValueError):
            dequantize_rows(raw, t, row_elems, np.array(bad))
    with pytest.raises(ValueError):
        dequantize_rows(raw, t, row_elems, np.array([0.0]))
    with pytest.raises(ValueError):
        dequantize_rows(raw[:-1], t, row_elems, np.array([0]))


def test_formats_table_matches_gguf():
    known = {t.value: t for t in GGMLQuantizationType}
    both = set(FORMATS) & set(known)
    assert formats.SUPPORTED_IDS <= both
    for type_id in both:
        f = FORMATS[type_id]
        assert f.name == known[type_id].name
        assert (f.block_elems, f.block_bytes) == GGML_QUANT_SIZES[known[type_id]], f.name
    assert {BY_NAME[n] for n in SUPPORTED} == formats.SUPPORTED_IDS


def test_kernel_table_is_the_file_formats_rows():
    """quant_kernels keeps its own rows (it imports nothing of the runtime): the same ids, names
    and block sizes as format.blocks, for exactly the supported types."""
    assert formats.SUPPORTED == SUPPORTED
    assert formats.FORMATS == {i: FORMATS[i] for i in formats.SUPPORTED_IDS}


def test_errors():
    q4k = BY_NAME["Q4_K"]
    raw = np.zeros(nbytes(q4k, 512), np.uint8)
    with pytest.raises(ValueError, match="block"):
        dequantize(raw, q4k, (4, 128))  # last dim not a whole number of blocks
    with pytest.raises(ValueError):
        dequantize(raw, q4k, ())
    with pytest.raises(ValueError, match="bytes"):
        dequantize(raw[:-1], q4k, (2, 256))
    with pytest.raises(ValueError, match="bytes"):
        dequantize(raw, q4k, (1, 256))
    with pytest.raises(ValueError, match="uint8"):
        dequantize(raw.view(np.int8), q4k, (2, 256))
    for name in ("Q8_1", "Q8_K", "I32", "F64", "TQ1_0", "NVFP4"):  # (the supported types only)
        with pytest.raises(ValueError, match=f"type id {BY_NAME[name]} is not supported"):
            dequantize(np.zeros(nbytes(BY_NAME[name], 256), np.uint8), BY_NAME[name], (256,))
    with pytest.raises(ValueError, match="99"):
        dequantize(raw, 99, (2, 256))
    with pytest.raises(ValueError):
        dequantize_rows(raw, q4k, 128, np.array([0]))
    with pytest.raises(ValueError):
        dequantize_rows(raw, BY_NAME["Q8_1"], 256, np.array([0]))
    # zero-size tensors are fine
    assert dequantize(np.zeros(0, np.uint8), q4k, (0, 256)).shape == (0, 256)


@pytest.mark.parametrize("name", [n for n in SUPPORTED if n not in IQ_TYPES])  # (test_iq_types_through_dequantize)
def test_all_finite_finds_a_damaged_value(name, rng):
    """all_finite: random well-formed blocks pass; one NaN or infinity in any f16 field of any
    block (or any element of a float tensor) fails."""
    t = BY_NAME[name]
    n = 4 * FORMATS[t].block_elems * (8 if FORMATS[t].block_elems == 1 else 1)
    raw = random_blocks(t, n, rng)
    assert all_finite(raw, t)
    bb = FORMATS[t].block_bytes
    offsets = [o for o in F16_FIELDS.get(name, ())]
    for bad in (np.nan, np.inf, -np.inf):
        hit = raw.copy()
        block = int(rng.integers(0, raw.size // bb))
        if name == "F32":
            hit.view("<f4")[block] = bad
        elif name == "F16":
            hit.view("<f2")[block] = bad
        elif name == "BF16":
            hit.view("<u2")[block] = np.float32(bad).view("<u4") >> 16
        elif name == "MXFP4":  # E8M0: 0xFF is NaN (there is no infinity)
            hit[block * bb] = 0xFF
        elif name in TABLE_TYPES:  # IQ4_NL / IQ4_XS: d, f16, at 0
            hit[block * bb:block * bb + 2] = np.frombuffer(np.float16(bad).tobytes(), np.uint8)
        else:
            o = block * bb + offsets[int(rng.integers(0, len(offsets)))]
            hit[o:o + 2] = np.frombuffer(np.float16(bad).tobytes(), np.uint8)
        assert not all_finite(hit, t), (name, bad)



@pytest.mark.parametrize("name", IQ_TYPES)
def test_iq_types_through_dequantize(name):
    """dequantize / dequantize_rows / all_finite read the 1- to 3-bit i-quants (reference_iq.py): the gguf package's values bit for bit, rows picked alike, a NaN or infinite
    scale flagged (MXFP4's E8M0 0xFF, IQ1_M's f16 spread over its scale words, the others' d)."""
    from gguf.quants import dequantize as gguf_dequantize

    from gguf_runtime.quant_kernels.reference_iq import random_iq_blocks
    t, rng = BY_NAME[name], np.random.default_rng(7)
    raw = random_iq_blocks(name, 4 * 256, rng, 0.1)
    x = dequantize(raw, t, (4, 256))
    want = gguf_dequantize(raw.reshape(4, -1), GGMLQuantizationType(t)).astype(np.float32)
    assert np.array_equal(x.view(np.uint32), want.view(np.uint32)) and np.abs(x).max() > 0
    assert np.array_equal(dequantize_rows(raw, t, 256, np.array([3, 0, 3])), x[[3, 0, 3]])
    assert all_finite(raw, t)
    bad = raw.reshape(-1, FORMATS[t].block_bytes).copy()
    if name == "MXFP4":
        bad[1, 0] = 0xFF
    elif name == "IQ1_M":  # f16 0x7C00 (infinity): nibbles 0, 0, C, 7 on top of the four scale words
        bad[1, 49] = (bad[1, 49] & 0x0F)
        bad[1, 51] = (bad[1, 51] & 0x0F)
        bad[1, 53] = (bad[1, 53] & 0x0F) | 0xC0
        bad[1, 55] = (bad[1, 55] & 0x0F) | 0x70
    else:
        bad[1, 0:2] = (0x00, 0x7E)
    assert not all_finite(bad.reshape(-1), t)
