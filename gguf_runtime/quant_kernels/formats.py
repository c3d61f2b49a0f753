"""The tensor types these kernels and their numpy references compute with: ggml type id, block
size in elements and bytes per block.

The file format's table of every ggml type is ``format/blocks.py``; this package keeps its own
rows so that it imports nothing of the runtime (``tests/test_quant_reference.py`` holds the two
equal).
"""

from __future__ import annotations

from typing import NamedTuple


class Format(NamedTuple):
    name: str
    block_elems: int  # elements per block
    block_bytes: int  # bytes per block


# id -> format, for the types with kernels
FORMATS: dict[int, Format] = {
    0: Format("F32", 1, 4),
    1: Format("F16", 1, 2),
    2: Format("Q4_0", 32, 18),
    3: Format("Q4_1", 32, 20),
    6: Format("Q5_0", 32, 22),
    7: Format("Q5_1", 32, 24),
    8: Format("Q8_0", 32, 34),
    10: Format("Q2_K", 256, 84),
    11: Format("Q3_K", 256, 110),
    12: Format("Q4_K", 256, 144),
    13: Format("Q5_K", 256, 176),
    14: Format("Q6_K", 256, 210),
    30: Format("BF16", 1, 2),
    20: Format("IQ4_NL", 32, 18),
    23: Format("IQ4_XS", 256, 136),
    39: Format("MXFP4", 32, 17),
    # the i-quants (numpy reference: reference_iq.py; kernels: iq_tables.cuh)
    16: Format("IQ2_XXS", 256, 66),
    17: Format("IQ2_XS", 256, 74),
    18: Format("IQ3_XXS", 256, 98),
    19: Format("IQ1_S", 256, 50),
    21: Format("IQ3_S", 256, 110),
    22: Format("IQ2_S", 256, 82),
    29: Format("IQ1_M", 256, 56),
}

BY_NAME: dict[str, int] = {f.name: i for i, f in FORMATS.items()}

# The types this runtime dequantizes and computes with (numpy reference and CUDA kernels).
SUPPORTED: tuple[str, ...] = (
    "F32", "F16", "BF16",
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "MXFP4", "IQ4_NL", "IQ4_XS",
    "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M",
)
SUPPORTED_IDS: frozenset[int] = frozenset(BY_NAME[n] for n in SUPPORTED)


def nbytes(type_id: int, n_elems: int) -> int:
    """Bytes that ``n_elems`` elements of ``type_id`` occupy; n_elems must be whole blocks."""
    f = FORMATS[type_id]
    if n_elems % f.block_elems:
        raise ValueError(f"{f.name}: {n_elems} elements is not a whole number of {f.block_elems}-element blocks")
    return n_elems // f.block_elems * f.block_bytes
