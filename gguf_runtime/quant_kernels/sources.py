"""The CUDA sources of this folder as NVRTC gets them (standard library only: CPU tests use it)."""

from __future__ import annotations

import functools
import glob
import hashlib
import os

SRC_DIR = os.path.dirname(os.path.abspath(__file__))

# Sources built for one architecture only (its launcher takes them on that GPU alone): Hopper's
# warpgroup MMA needs the arch-specific target.
ARCH = {"glu_wgmma.cu": "sm_90a"}


@functools.lru_cache(maxsize=None)
def source(filename: str, src_dir: str = SRC_DIR) -> str:
    """The text of ``filename``, ending in a digest of the folder's headers: CuPy keys its on-disk
    kernel cache by the source text and options only, so without it an edited header (common.cuh,
    quant_types.cuh) would keep loading binaries built from the old one."""
    with open(os.path.join(src_dir, filename)) as fh:
        text = fh.read()
    digest = hashlib.sha256()
    for name in sorted(glob.glob(os.path.join(src_dir, "*.cuh"))):
        with open(name, "rb") as fh:
            digest.update(os.path.basename(name).encode() + b"\0" + fh.read())
    return f"{text}\n// headers {digest.hexdigest()[:16]}\n"
