"""Repacked planes hold exactly the original blocks, aligned for 16-byte loads."""

import numpy as np
import pytest

from gguf_runtime.quant_kernels.formats import BY_NAME, FORMATS, SUPPORTED
from gguf_runtime.quant_kernels.repack import ALIGN, LAYOUTS, packed_size, repack, row_offsets, unrepack
from gguf_runtime.quant_kernels.reference import random_blocks


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("rows,blocks", [(1, 1), (3, 5), (17, 2)])
def test_repack_roundtrip(name, rows, blocks, rng):
    t = BY_NAME[name]
    fmt = FORMATS[t]
    cols = blocks * fmt.block_elems * (16 if fmt.block_elems == 1 else 1)
    raw = random_blocks(t, rows * cols, rng, scale=0.5)
    p = repack(raw, t, rows, cols)
    assert p.buffer.size == packed_size(t, rows, cols)
    assert all(off % ALIGN == 0 for off in p.offsets.values())
    assert np.array_equal(unrepack(p), raw)
    # the quant plane of row r is the concatenation of that row's blocks' quant bytes
    qs = LAYOUTS[name][0]
    (a, b), = qs.parts
    r = rows - 1
    want = raw.reshape(rows, -1, fmt.block_bytes)[r, :, a:b].reshape(-1)
    assert np.array_equal(p.plane("qs")[r].reshape(-1), want)
    # row strides of every plane are multiples of the plane's own load width
    for pl in LAYOUTS[name]:
        per_row = p.plane(pl.name).shape[1] * pl.nbytes
        assert per_row % min(16, pl.nbytes) == 0 or pl.name == "d"


def test_repack_rejects_bad_input():
    t = BY_NAME["Q4_K"]
    with pytest.raises(ValueError):
        repack(np.zeros(10, np.uint8), t, 1, 256)
    with pytest.raises(ValueError):
        repack(np.zeros(144, np.uint8), t, 1, 250)
    with pytest.raises(ValueError):
        repack(np.zeros(54, np.uint8), 34, 1, 256)  # TQ1_0: no kernels


@pytest.mark.parametrize("name", SUPPORTED)
def test_row_offsets_give_a_row_slice(name, rng):
    """A slice of rows of a repacked matrix (Phi-3's fused QKV / gate-up parts on the GPU) is its
    planes from row_offsets on: byte for byte the planes of those rows repacked alone."""
    t = BY_NAME[name]
    rows, cols, row0, n = 12, 2 * FORMATS[t].block_elems, 5, 4
    raw = random_blocks(t, rows * cols, rng)
    whole = repack(raw, t, rows, cols)
    row_bytes = raw.size // rows
    part = repack(raw[row0 * row_bytes:(row0 + n) * row_bytes], t, n, cols)
    for plane, step in row_offsets(t, cols, row0).items():
        want = part.plane(plane).reshape(-1)
        start = whole.offsets[plane] + step
        np.testing.assert_array_equal(whole.buffer[start:start + want.size], want)
