"""The CUDA kernels' decoders (quant_types.cuh), built for the host, against numpy.

The same source the GPU compiles is built here with nvcc as host code, so the bit layouts of
every type are checked on a CPU-only machine (CI) on fresh random blocks.
"""

import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest

from gguf_runtime.quant_kernels.formats import BY_NAME, FORMATS, SUPPORTED
from gguf_runtime.quant_kernels.reference import dequantize, random_blocks
from gguf_runtime.quant_kernels.reference_q8 import dequantize_q8, dequantize_q8_rest, quantize_q8, quantize_q8_rest
from gguf_runtime.quant_kernels.repack import repack

KERNELS = os.path.join(os.path.dirname(__file__), "..", "gguf_runtime", "quant_kernels")
SRC = os.path.join(os.path.dirname(__file__), "native", "decode_host.cu")


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed on this machine")
    out = tmp_path_factory.mktemp("native") / "libdecode.so"
    subprocess.run([nvcc, "-O2", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-I", KERNELS,
                    "-arch=sm_90", "-o", str(out), SRC], check=True)
    dll = ctypes.CDLL(str(out))
    dll.decode_rows.restype = ctypes.c_int
    dll.decode_rows_i8.restype = ctypes.c_int
    dll.dp4a_host.restype = ctypes.c_int
    return dll


def ptr(a):
    return ctypes.c_void_p(a.ctypes.data) if a is not None else ctypes.c_void_p(0)


@pytest.mark.parametrize("name", SUPPORTED)
def test_host_decoder_matches_reference(lib, name, rng):
    t = BY_NAME[name]
    fmt = FORMATS[t]
    rows = 5
    K = 512 if fmt.block_elems == 256 else 96
    raw = random_blocks(t, rows * K, rng, scale=0.7)
    want = dequantize(raw, t, (rows, K))
    p = repack(raw, t, rows, K)
    planes = {n: p.plane(n) if n in p.offsets else None for n in ("qs", "qh", "sc", "d")}
    out = np.full((rows, K), np.nan, np.float32)  # poisoned: every element must be written
    rc = lib.decode_rows(t, *(ptr(planes[n]) for n in ("qs", "qh", "sc", "d")), rows, K, ptr(out))
    assert rc == 0
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


INT_TYPES = [n for n in SUPPORTED if n not in ("F32", "F16", "BF16")]


@pytest.mark.parametrize("name", INT_TYPES)
def test_int8_words_match_reference(lib, name, rng):
    """The q8 path's decoding (I8<T>::words: signed bytes q, weight = d q + m) gives the weights."""
    t = BY_NAME[name]
    rows = 4
    K = 512 if FORMATS[t].block_elems == 256 else 96
    raw = random_blocks(t, rows * K, rng, scale=0.7)
    want = dequantize(raw, t, (rows, K))
    p = repack(raw, t, rows, K)
    planes = {n: p.plane(n) if n in p.offsets else None for n in ("qs", "qh", "sc", "d")}
    out = np.full((rows, K), np.nan, np.float32)
    assert lib.decode_rows_i8(t, *(ptr(planes[n]) for n in ("qs", "qh", "sc", "d")), rows, K, ptr(out)) == 0
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_quant16_matches_numpy_bit_for_bit(lib, rng):
    n = 16 * 64
    x = (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 40.0], n // 16).repeat(16)).astype(np.float32)
    x[:16] = 0  # an all-zero piece quantizes to zeros with d = 0
    x[16:32] = np.float32(1e-35)  # under the amax floor: zeros too
    x[40] = 63.5 * np.abs(x[32:48]).max() / 127  # a tie case somewhere in the piece
    q = np.full(n, 0x55, np.uint8)
    d = np.full(n // 16, np.nan, np.float32)
    s = np.full(n // 16, np.nan, np.float32)
    lib.quant_rows(ptr(x), n, ptr(q), ptr(d), ptr(s))
    wq, wd, ws = quantize_q8(x)
    assert (q.view(np.int8) == wq).all()
    assert (d == wd).all() and (s == ws).all()
    assert (wq[:32] == 0).all() and (wd[:2] == 0).all()
    assert np.abs(wq).max() == 127
    err = np.abs(dequantize_q8(wq, wd) - x).reshape(-1, 16).max(-1)
    bound = np.where(wd > 0, wd.astype(np.float64) * 0.5 * (1 + 1e-5), 1e-30)  # half a step; floor pieces: 0
    assert (err <= bound).all()


def test_quant16_rest_matches_numpy_bit_for_bit(lib, rng):
    """The rests (q8_res): the second int8 of v - d q, bit for bit, and d q + d2 q2 within half a
    step of the rest's grid (~15 bits a value where int8 alone keeps ~8)."""
    n = 16 * 64
    x = (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 40.0], n // 16).repeat(16)).astype(np.float32)
    x[:16] = 0
    x[16:32] = np.float32(1e-35)
    x[37] = 90 * np.abs(x[32:48]).max()  # an outlier: the piece's other values keep few int8 steps
    x[64:80] = np.round(x[64:80] * (127 / np.abs(x[64:80]).max())) * (np.abs(x[64:80]).max() / 127)  # rests ~0
    q, q2 = (np.full(n, 0x55, np.uint8) for _ in range(2))
    d, s, d2 = (np.full(n // 16, np.nan, np.float32) for _ in range(3))
    lib.quant_rows_rest(ptr(x), n, ptr(q), ptr(d), ptr(s), ptr(q2), ptr(d2))
    wq, wd, ws, wq2, wd2 = quantize_q8_rest(x)
    assert (q.view(np.int8) == wq).all() and (d == wd).all()
    assert (q2.view(np.int8) == wq2).all() and (d2 == wd2).all()
    assert (s == ws).all()
    assert (wq2[:32] == 0).all() and (wd2[:2] == 0).all()
    got = dequantize_q8_rest(wq, wd, wq2, wd2)
    err, err8 = (np.abs(v - x).reshape(-1, 16).max(-1) for v in (got, dequantize_q8(wq, wd)))
    ulp = 2.0 ** -23 * np.abs(x).reshape(-1, 16).max(-1)  # the rest is computed in float32
    assert (err <= np.where(wd2 > 0, wd2.astype(np.float64) * 0.5 * (1 + 1e-5), 1e-30) + ulp).all()
    live = wd2 > 0  # pieces with a rest (piece 4 lies on the int8 grid: nothing left)
    assert wd2[4] == 0 and live.sum() == 61
    assert (err[live] <= err8[live] / 100).all()  # the rest took at least two more digits off every piece


def test_dp4a_is_a_signed_byte_dot(lib, rng):
    for _ in range(50):
        a, b = rng.integers(-128, 128, 4, dtype=np.int8), rng.integers(-128, 128, 4, dtype=np.int8)
        c = int(rng.integers(-1000, 1000))
        got = lib.dp4a_host(ctypes.c_uint32(int(a.view(np.uint32)[0])), ctypes.c_uint32(int(b.view(np.uint32)[0])), c)
        assert got == c + int((a.astype(np.int64) * b.astype(np.int64)).sum())


def test_iq_tables_header_is_generated_from_the_grids():
    """iq_tables.cuh (the decoders' grids) is gen_iq_tables' output from iq_grids.py (the numpy
    oracle's grids, checked against the gguf package's): regenerate it when they change."""
    from gguf_runtime.quant_kernels import gen_iq_tables

    with open(gen_iq_tables.PATH) as fh:
        assert fh.read() == gen_iq_tables.text()
