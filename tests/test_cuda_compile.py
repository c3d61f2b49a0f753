"""Every CUDA source compiles for sm_90 with this machine's nvcc (no GPU needed).

The kernels are templates instantiated at run time through NVRTC; GGUF_INSTANTIATE_ALL makes each
file instantiate every kernel for every quant type, so nvcc checks them all here, in CI.
"""

import glob
import os
import shutil
import subprocess

import pytest

KERNELS = os.path.join(os.path.dirname(__file__), "..", "gguf_runtime", "quant_kernels")
SOURCES = sorted(glob.glob(os.path.join(KERNELS, "*.cu")))


def test_sources_found():
    assert {os.path.basename(p) for p in SOURCES} >= {"matvec.cu", "layers.cu", "attention.cu", "sampling.cu"}


@pytest.mark.parametrize("src", SOURCES, ids=os.path.basename)
def test_compiles_for_sm90(src, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed on this machine")
    out = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-DGGUF_INSTANTIATE_ALL", "-Werror", "all-warnings",
                          "-c", src, "-o", str(tmp_path / "k.o")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-4000:]
