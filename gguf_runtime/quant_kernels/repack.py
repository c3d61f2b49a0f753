"""Repacking quantized matrices at load into the planes the CUDA kernels read.

A ggml block interleaves scales and quants (Q4_1: 4 bytes of scales, then 16 of quants), so
block strides like 18, 20, 22, 34 or 210 bytes forbid aligned 16-byte loads. At load we split
every block into up to four *planes*, each a [rows, blocks, bytes] array holding the same byte
range of every block: ``qs`` (low quant bits), ``qh`` (high bits / masks), ``sc`` (packed
sub-block scales, sometimes with d/dmin) and ``d`` (f16 block scales). Each plane keeps a row
contiguous, so a warp reading one row reads consecutive 16-byte chunks. Nothing is decoded or
rounded: ``unrepack`` gives back the exact original bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .formats import BY_NAME, FORMATS

PLANE_NAMES = ("qs", "qh", "sc", "d")
ALIGN = 256  # byte alignment of each plane inside a packed buffer


class Plane(NamedTuple):
    name: str
    parts: tuple[tuple[int, int], ...]  # (start, stop) byte ranges of the block, concatenated
    pad: int = 0  # zero bytes appended per block (keeps 16-byte loads aligned)

    @property
    def nbytes(self) -> int:
        return sum(b - a for a, b in self.parts) + self.pad


# type name -> planes, in PLANE_NAMES order (absent planes omitted)
LAYOUTS: dict[str, tuple[Plane, ...]] = {
    "Q4_0": (Plane("qs", ((2, 18),)), Plane("d", ((0, 2),))),
    "Q4_1": (Plane("qs", ((4, 20),)), Plane("d", ((0, 4),))),  # d, m
    "Q5_0": (Plane("qs", ((6, 22),)), Plane("qh", ((2, 6),)), Plane("d", ((0, 2),))),
    "Q5_1": (Plane("qs", ((8, 24),)), Plane("qh", ((4, 8),)), Plane("d", ((0, 4),))),  # d, m
    "Q8_0": (Plane("qs", ((2, 34),)), Plane("d", ((0, 2),))),
    "Q2_K": (Plane("qs", ((16, 80),)), Plane("sc", ((0, 16),)), Plane("d", ((80, 84),))),  # d, dmin
    "Q3_K": (Plane("qs", ((32, 96),)), Plane("qh", ((0, 32),)), Plane("sc", ((96, 110),), pad=2)),  # scales12, d
    "Q4_K": (Plane("qs", ((16, 144),)), Plane("sc", ((0, 16),))),  # d, dmin, scales12
    "Q5_K": (Plane("qs", ((48, 176),)), Plane("qh", ((16, 48),)), Plane("sc", ((0, 16),))),
    "Q6_K": (Plane("qs", ((0, 128),)), Plane("qh", ((128, 192),)), Plane("sc", ((192, 208),)),
             Plane("d", ((208, 210),))),
    # table types: the nibbles, then the scales (MXFP4: one E8M0 byte; IQ4_XS: d, scales_h, scales_l)
    "MXFP4": (Plane("qs", ((1, 17),)), Plane("d", ((0, 1),))),
    "IQ4_NL": (Plane("qs", ((2, 18),)), Plane("d", ((0, 2),))),
    "IQ4_XS": (Plane("qs", ((8, 136),)), Plane("sc", ((0, 8),))),
    # i-quants (quant_iq.cuh): grid indices (and IQ2_S's sign bytes) in qs, high bits, signs and scales
    "IQ2_XXS": (Plane("qs", ((2, 66),)), Plane("d", ((0, 2),))),
    "IQ2_XS": (Plane("qs", ((2, 66),)), Plane("sc", ((66, 74),)), Plane("d", ((0, 2),))),
    "IQ2_S": (Plane("qs", ((2, 66),)), Plane("sc", ((66, 82),)), Plane("d", ((0, 2),))),  # qh, scales
    "IQ3_XXS": (Plane("qs", ((2, 66),)), Plane("sc", ((66, 98),)), Plane("d", ((0, 2),))),
    "IQ3_S": (Plane("qs", ((2, 66),)), Plane("qh", ((66, 74),)), Plane("sc", ((74, 110),), pad=12),  # signs, scales
              Plane("d", ((0, 2),))),
    "IQ1_S": (Plane("qs", ((2, 34),)), Plane("qh", ((34, 50),)), Plane("d", ((0, 2),))),
    "IQ1_M": (Plane("qs", ((0, 32),)), Plane("qh", ((32, 48),)), Plane("sc", ((48, 56),))),
    # float types: one plane, the row as stored
    "F32": (Plane("qs", ((0, 4),)),),
    "F16": (Plane("qs", ((0, 2),)),),
    "BF16": (Plane("qs", ((0, 2),)),),
}


def _check_layouts() -> None:
    for name, planes in LAYOUTS.items():
        fmt = FORMATS[BY_NAME[name]]
        covered = sorted(r for p in planes for r in p.parts)
        pos = 0
        for a, b in covered:
            assert a == pos, (name, covered)
            pos = b
        assert pos == fmt.block_bytes, (name, pos)


_check_layouts()


class Packed(NamedTuple):
    """A repacked matrix: one uint8 buffer and each plane's byte offset in it (or -1)."""

    type_id: int
    rows: int
    cols: int
    buffer: np.ndarray  # uint8, planes at ALIGN-aligned offsets
    offsets: dict[str, int]

    def plane(self, name: str) -> np.ndarray:
        """The plane as [rows, blocks, bytes] (a view into buffer)."""
        planes = {p.name: p for p in LAYOUTS[FORMATS[self.type_id].name]}
        p = planes[name]
        nb = self.cols // FORMATS[self.type_id].block_elems
        off = self.offsets[name]
        return self.buffer[off:off + self.rows * nb * p.nbytes].reshape(self.rows, nb, p.nbytes)


def packed_size(type_id: int, rows: int, cols: int) -> int:
    fmt = FORMATS[type_id]
    nb = cols // fmt.block_elems
    total = 0
    for p in LAYOUTS[fmt.name]:
        total = _align(total) + rows * nb * p.nbytes
    return _align(total)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def repack(raw: np.ndarray, type_id: int, rows: int, cols: int, out: np.ndarray | None = None) -> Packed:
    """Split the blocks of a [rows, cols] matrix into planes (into ``out`` if given)."""
    fmt = FORMATS.get(type_id)
    if fmt is None or fmt.name not in LAYOUTS:
        raise ValueError(f"cannot repack tensor type {fmt.name if fmt else type_id}")
    if cols % fmt.block_elems:
        raise ValueError(f"{fmt.name}: {cols} columns is not whole {fmt.block_elems}-element blocks")
    nb = cols // fmt.block_elems
    if raw.dtype != np.uint8 or raw.size != rows * nb * fmt.block_bytes:
        raise ValueError(f"{fmt.name}: expected {rows * nb * fmt.block_bytes} bytes, got {raw.size}")
    blocks = raw.reshape(rows * nb, fmt.block_bytes)
    size = packed_size(type_id, rows, cols)
    buf = np.empty(size, np.uint8) if out is None else out[:size]
    offsets: dict[str, int] = {}
    pos = 0
    for p in LAYOUTS[fmt.name]:
        pos = _align(pos)
        offsets[p.name] = pos
        n = rows * nb * p.nbytes
        dst = buf[pos:pos + n].reshape(rows * nb, p.nbytes)
        col = 0
        for a, b in p.parts:
            dst[:, col:col + b - a] = blocks[:, a:b]
            col += b - a
        if p.pad:
            dst[:, col:] = 0
        pos += n
    buf[pos:size] = 0
    return Packed(type_id, rows, cols, buf, offsets)


def row_offsets(type_id: int, cols: int, row0: int) -> dict[str, int]:
    """Bytes from each plane's start to row ``row0``'s: the planes of rows [row0, ...) of a
    repacked matrix begin there (a plane keeps each row contiguous), so a row slice (Phi-3's
    fused QKV and gate-up parts) is the same planes with their pointers moved."""
    fmt = FORMATS[type_id]
    nb = cols // fmt.block_elems
    return {p.name: row0 * nb * p.nbytes for p in LAYOUTS[fmt.name]}


def unrepack(packed: Packed) -> np.ndarray:
    """The original raw bytes of a repacked matrix (for tests)."""
    fmt = FORMATS[packed.type_id]
    nb = packed.cols // fmt.block_elems
    blocks = np.empty((packed.rows * nb, fmt.block_bytes), np.uint8)
    for p in LAYOUTS[fmt.name]:
        src = packed.plane(p.name).reshape(packed.rows * nb, p.nbytes)
        col = 0
        for a, b in p.parts:
            blocks[:, a:b] = src[:, col:col + b - a]
            col += b - a
    return blocks.reshape(-1)
