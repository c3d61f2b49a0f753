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
    return dll


def ptr(a):
    return ctypes.c_void_p(a.ctypes.data) if a is not None else ctypes.c_void_p(0)


@pytest.mark.parametrize("name", SUPPORTED)
def test_host_decoder_matches_reference(lib, name):
    rng = np.random.default_rng()
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
