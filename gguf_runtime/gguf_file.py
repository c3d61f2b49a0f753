"""GGUF reader: validate the whole header, then map tensors without reading them.

The file is memory-mapped; the header (metadata and tensor table) is parsed with bounds checks on
every count, length and offset before anything is allocated from it, so a truncated or hostile
file ends in one ``GGUFError`` naming the file, the field or tensor, and what was wrong. Tensor
data stays in the page cache and is handed out as zero-copy uint8 views.

Value-type ids and key names come from the ``gguf`` package (``gguf.constants``); the block table
is ``quant_kernels.formats``. We parse the header ourselves rather than through
``gguf.GGUFReader`` because that reader builds several numpy objects per vocabulary string: 9 s to
open Gemma-3's 262,144-token vocabulary, against about 0.2 s here.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUFValueType

from .errors import GGUFError
from .quant_kernels.formats import FORMATS

MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 2  # arrays of arrays occur (rarely); deeper nesting is refused
MAX_ELEMENTS = 1 << 48  # far above any real tensor, far below int64 overflow in byte counts

_SCALAR = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.FLOAT64: "<d",
    GGUFValueType.BOOL: "<B",
}
_NP = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2", GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.FLOAT64: "<f8",
    GGUFValueType.BOOL: "<u1",
}
_VALUE_TYPES = {int(t): t for t in GGUFValueType}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ne: tuple[int, ...]  # ggml order: ne[0] is the contiguous dimension
    type_id: int
    offset: int  # absolute offset in the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order (rows, ..., contiguous)."""
        return tuple(reversed(self.ne))

    @property
    def n_elems(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n

    @property
    def type_name(self) -> str:
        return FORMATS[self.type_id].name


class _Cursor:
    """Bounds-checked reads from the mapped header."""

    def __init__(self, buf: Any, size: int, path: str) -> None:
        self.buf, self.size, self.path, self.pos = buf, size, path, 0

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what} (at byte {self.pos}); the file is damaged or not a GGUF model")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"truncated: {what} needs {n} bytes but only {self.size - self.pos} remain")

    def scalar(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def u32(self, what: str) -> int:
        return self.scalar("<I", what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", what)

    def raw_string(self, what: str) -> bytes:
        n = self.u64(f"length of {what}")
        if n > self.size - self.pos:
            raise self.fail(f"{what} claims {n} bytes but only {self.size - self.pos} remain")
        b = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return b

    def string(self, what: str, strict: bool = True) -> str:
        b = self.raw_string(what)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            if strict:
                raise self.fail(f"{what} is not valid UTF-8") from None
            return b.decode("utf-8", errors="replace")


def _read_value(cur: _Cursor, vtype: int, key: str, depth: int = 0) -> Any:
    t = _VALUE_TYPES.get(vtype)
    if t is None:
        raise cur.fail(f"metadata '{key}' has unknown value type {vtype}")
    if t == GGUFValueType.STRING:
        return cur.string(f"string value of '{key}'", strict=False)
    if t == GGUFValueType.ARRAY:
        if depth >= MAX_ARRAY_DEPTH:
            raise cur.fail(f"metadata '{key}' nests arrays deeper than {MAX_ARRAY_DEPTH}")
        item_type = cur.u32(f"item type of array '{key}'")
        count = cur.u64(f"length of array '{key}'")
        it = _VALUE_TYPES.get(item_type)
        if it is None:
            raise cur.fail(f"array '{key}' has unknown item type {item_type}")
        if it in _NP:
            item = np.dtype(_NP[it]).itemsize
            if count > (cur.size - cur.pos) // item:
                raise cur.fail(f"array '{key}' claims {count} items of {item} bytes, more than the file holds")
            arr = np.frombuffer(cur.buf, dtype=_NP[it], count=count, offset=cur.pos).copy()
            cur.pos += count * item
            return arr.astype(bool) if it == GGUFValueType.BOOL else arr
        # strings and arrays take at least 8 bytes per item (their length field)
        if count > (cur.size - cur.pos) // 8:
            raise cur.fail(f"array '{key}' claims {count} items, more than the file can hold")
        if it == GGUFValueType.STRING:
            return _read_string_array(cur, count, key)
        return [_read_value(cur, item_type, key, depth + 1) for _ in range(count)]
    v = cur.scalar(_SCALAR[t], f"value of '{key}'")
    return bool(v) if t == GGUFValueType.BOOL else v


def _read_string_array(cur: _Cursor, count: int, key: str) -> list[str]:
    buf, size, pos = cur.buf, cur.size, cur.pos
    unpack = struct.Struct("<Q").unpack_from
    out: list[str] = []
    append = out.append
    for i in range(count):
        if pos + 8 > size:
            cur.pos = pos
            raise cur.fail(f"truncated: item {i} of array '{key}'")
        (n,) = unpack(buf, pos)
        pos += 8
        if n > size - pos:
            cur.pos = pos
            raise cur.fail(f"item {i} of array '{key}' claims {n} bytes but only {size - pos} remain")
        append(str(buf[pos:pos + n], "utf-8", "replace"))
        pos += n
    cur.pos = pos
    return out


class GGUFFile:
    """A validated, memory-mapped GGUF file. Use ``open_gguf``."""

    def __init__(self, path: str, check_data: bool = True) -> None:
        self.path = str(path)
        try:
            self._fh = open(self.path, "rb")
        except FileNotFoundError:
            raise GGUFError(f"{self.path}: no such file; check the path") from None
        except IsADirectoryError:
            raise GGUFError(f"{self.path}: is a directory, not a GGUF file") from None
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot open ({e.strerror})") from None
        try:
            self.size = os.fstat(self._fh.fileno()).st_size
            if self.size < 24:
                raise GGUFError(f"{self.path}: {self.size} bytes is too short for a GGUF header (24 bytes); "
                                "the file is truncated or not a GGUF model")
            self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ)
            self._parse(check_data)
        except BaseException:
            self.close()
            raise

    def _parse(self, check_data: bool) -> None:
        cur = _Cursor(self._mm, self.size, self.path)
        magic = cur.u32("magic")
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {bytes(self._mm[:4])!r}, expected b'GGUF')")
        self.version = cur.u32("version")
        if self.version not in (2, 3):
            hint = " (big-endian files are not supported)" if self.version > 0xFFFF else ""
            raise cur.fail(f"unsupported GGUF version {self.version}{hint}; versions 2 and 3 are supported")
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        # a key-value pair takes at least 13 bytes, a tensor entry at least 32
        if n_kv > (self.size - cur.pos) // 13:
            raise cur.fail(f"metadata count {n_kv} is more than the file can hold")
        if n_tensors > (self.size - cur.pos) // 32:
            raise cur.fail(f"tensor count {n_tensors} is more than the file can hold")

        self.metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, int] = {}
        for i in range(n_kv):
            key = cur.string(f"key of metadata entry {i}")
            if key in self.metadata:
                raise cur.fail(f"metadata key '{key}' appears twice")
            vtype = cur.u32(f"value type of '{key}'")
            self.metadata[key] = _read_value(cur, vtype, key)
            self.metadata_types[key] = vtype

        align = self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if (not isinstance(align, int) or isinstance(align, bool) or align <= 0
                or align & (align - 1) or align > 1 << 20):
            raise GGUFError(f"{self.path}: metadata 'general.alignment' = {align!r} is not a power of two")
        self.alignment = align

        entries = []
        names: set[str] = set()
        for i in range(n_tensors):
            name = cur.string(f"name of tensor {i}")
            if name in names:
                raise cur.fail(f"tensor '{name}' appears twice")
            names.add(name)
            n_dims = cur.u32(f"dimension count of tensor '{name}'")
            if not 1 <= n_dims <= MAX_DIMS:
                raise cur.fail(f"tensor '{name}' has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
            ne = tuple(cur.u64(f"dimension {d} of tensor '{name}'") for d in range(n_dims))
            type_id = cur.u32(f"type of tensor '{name}'")
            rel = cur.u64(f"data offset of tensor '{name}'")
            entries.append((name, ne, type_id, rel))

        self.data_offset = (cur.pos + align - 1) // align * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, ne, type_id, rel in entries:
            self.tensors[name] = self._check_tensor(name, ne, type_id, rel, check_data)
        if check_data:
            self._check_overlaps()

    def _check_tensor(self, name: str, ne: tuple[int, ...], type_id: int, rel: int,
                      check_data: bool) -> TensorInfo:
        where = f"{self.path}: tensor '{name}'"
        fmt = FORMATS.get(type_id)
        if fmt is None:
            raise GGUFError(f"{where} has unknown tensor type {type_id}; the file is damaged or needs a newer runtime")
        n = 1
        for d in ne:
            if d == 0 or d > MAX_ELEMENTS:
                raise GGUFError(f"{where} has dimension {d}; the file is damaged")
            n *= d
            if n > MAX_ELEMENTS:
                raise GGUFError(f"{where} has {n}+ elements, more than any real model; the file is damaged")
        if ne[0] % fmt.block_elems:
            raise GGUFError(f"{where}: row length {ne[0]} is not a multiple of {fmt.name}'s block of "
                            f"{fmt.block_elems}; the file is damaged")
        if rel % self.alignment:
            raise GGUFError(f"{where}: data offset {rel} is not aligned to {self.alignment}; the file is damaged")
        nbytes = n // fmt.block_elems * fmt.block_bytes
        start = self.data_offset + rel
        if check_data and (start > self.size or nbytes > self.size - start):
            raise GGUFError(f"{where}: data [{start}, {start + nbytes}) lies past the end of the file "
                            f"({self.size} bytes); the file is truncated")
        return TensorInfo(name, ne, type_id, start, nbytes)

    def _check_overlaps(self) -> None:
        prev = None
        for t in sorted(self.tensors.values(), key=lambda t: t.offset):
            if prev is not None and t.offset < prev.offset + prev.nbytes:
                raise GGUFError(f"{self.path}: tensors '{prev.name}' and '{t.name}' overlap; the file is damaged")
            prev = t

    # ---- access -----------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the mapped file (no copy)."""
        t = self.tensors[name]
        if t.offset + t.nbytes > self.size:
            raise GGUFError(f"{self.path}: tensor '{name}' has no data (header-only file)")
        return np.frombuffer(self._mm, dtype=np.uint8, count=t.nbytes, offset=t.offset)

    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None

    def header_bytes(self) -> bytes:
        """Everything before the tensor data (what ``synth --header-only`` keeps)."""
        return bytes(self._mm[:self.data_offset])

    def close(self) -> None:
        mm, self._mm = getattr(self, "_mm", None), None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # numpy views still alive: leave the map to the garbage collector
                pass
        fh = getattr(self, "_fh", None)
        if fh is not None:
            fh.close()

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_gguf(path: str | os.PathLike, check_data: bool = True) -> GGUFFile:
    """Open and validate a GGUF file; raises ``GGUFError`` on any defect.

    ``check_data=False`` accepts header-only files (tensor data missing past the header).
    """
    return GGUFFile(os.fspath(path), check_data=check_data)
