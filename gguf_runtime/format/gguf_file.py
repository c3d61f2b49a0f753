"""GGUF reader: validate the whole header, then map tensors without reading them.

The file is memory-mapped; the header (metadata and tensor table) is parsed with bounds checks on
every count, length and offset before anything is allocated from it, so a truncated or hostile
file ends in one ``GGUFError`` naming the file, the field or tensor, and what was wrong. Tensor
data stays in the page cache and is handed out as zero-copy uint8 views.

Value-type ids and key names come from the ``gguf`` package (``gguf.constants``); the block table
is ``format.blocks``. We parse the header ourselves rather than through
``gguf.GGUFReader`` because that reader builds several numpy objects per vocabulary string: 9 s to
open Gemma-3's 262,144-token vocabulary, against about 0.2 s here.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUFValueType

from ..errors import GGUFError
from .blocks import FORMATS

MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 2  # arrays of arrays occur (rarely); deeper nesting is refused
MAX_ELEMENTS = 1 << 48  # far above any real tensor, far below int64 overflow in byte counts

_V = GGUFValueType
_SCALAR = {  # value type -> struct format; numpy dtypes for arrays follow from it
    _V.UINT8: "<B", _V.INT8: "<b", _V.UINT16: "<H", _V.INT16: "<h", _V.UINT32: "<I", _V.INT32: "<i",
    _V.UINT64: "<Q", _V.INT64: "<q", _V.FLOAT32: "<f", _V.FLOAT64: "<d", _V.BOOL: "<B",
}
_NP = {t: np.dtype(f[1]).newbyteorder("<") for t, f in _SCALAR.items()}
_VALUE_TYPES = {int(t): t for t in GGUFValueType}
_DAMAGED = "the file is damaged or not a GGUF model; re-download or re-convert it"


def _q(name: str, limit: int = 80) -> str:
    """A key or tensor name quoted for a one-line message (escapes control characters, truncates)."""
    r = repr(name[:limit])
    return r + "..." if len(name) > limit else r


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
        return GGUFError(f"{self.path}: {what} (at byte {self.pos}); {_DAMAGED}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"truncated: {what} needs {n} bytes but only {self.size - self.pos} remain")

    def room(self, count: int, min_bytes: int, what: str) -> None:
        """Refuse a count of items of at least ``min_bytes`` each that cannot fit in the rest of the file."""
        if count > (self.size - self.pos) // min_bytes:
            raise self.fail(f"{what} is {count}, which needs at least {count * min_bytes} bytes but only "
                            f"{self.size - self.pos} remain")

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
        self.room(n, 1, f"length of {what}")
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
    k = _q(key)
    if t is None:
        raise cur.fail(f"metadata {k} has unknown value type {vtype}")
    if t == GGUFValueType.STRING:
        return cur.string(f"string value of {k}", strict=False)
    if t == GGUFValueType.ARRAY:
        item_type = cur.u32(f"item type of array {k}")
        it = _VALUE_TYPES.get(item_type)
        if it is None:
            raise cur.fail(f"array {k} has unknown item type {item_type}")
        if it == GGUFValueType.ARRAY and depth + 1 >= MAX_ARRAY_DEPTH:
            raise cur.fail(f"array {k} nests arrays more than {MAX_ARRAY_DEPTH} deep")
        count = cur.u64(f"length of array {k}")
        if it in _NP:
            item = _NP[it].itemsize
            cur.room(count, item, f"length of array {k} ({item}-byte {it.name} items)")
            arr = np.frombuffer(cur.buf, dtype=_NP[it], count=count, offset=cur.pos).copy()
            cur.pos += count * item
            return arr.astype(bool) if it == GGUFValueType.BOOL else arr
        # strings take at least 8 bytes per item (their length), arrays 12 (item type and length)
        cur.room(count, 8 if it == GGUFValueType.STRING else 12, f"length of array {k} ({it.name} items)")
        if it == GGUFValueType.STRING:
            return _read_string_array(cur, count, key)
        return [_read_value(cur, item_type, key, depth + 1) for _ in range(count)]
    v = cur.scalar(_SCALAR[t], f"value of {k}")
    return bool(v) if t == GGUFValueType.BOOL else v


def _read_string_array(cur: _Cursor, count: int, key: str) -> list[str]:
    buf, size, pos = cur.buf, cur.size, cur.pos
    unpack = struct.Struct("<Q").unpack_from
    out: list[str] = []
    append = out.append
    for i in range(count):
        if pos + 8 > size:
            cur.pos = pos
            raise cur.fail(f"truncated: length of item {i} of array {_q(key)}")
        (n,) = unpack(buf, pos)
        pos += 8
        if n > size - pos:
            cur.pos = pos
            raise cur.fail(f"length of item {i} of array {_q(key)} is {n} but only {size - pos} bytes remain")
        append(str(buf[pos:pos + n], "utf-8", "replace"))
        pos += n
    cur.pos = pos
    return out


class GGUFFile:
    """A validated, memory-mapped GGUF file. Use ``open_gguf``."""

    def __init__(self, path: str, check_data: bool = True) -> None:
        self.path = str(path)
        self._mm: Any = None
        try:
            mode = os.stat(self.path).st_mode
            if not stat.S_ISREG(mode):  # a directory, or a FIFO or device that could block or never end
                kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
                raise GGUFError(f"{self.path}: is {kind}; pass the .gguf model file itself")
            self._fh = open(self.path, "rb")
        except FileNotFoundError:
            raise GGUFError(f"{self.path}: no such file; check the path") from None
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot open ({e.strerror}); check the path and permissions") from None
        try:
            size = os.fstat(self._fh.fileno()).st_size
            if size < 24:  # too short to map usefully: parse the bytes so the error names the missing field
                try:
                    buf: Any = self._fh.read(24)
                except OSError as e:  # /proc/self/mem and other files that stat as regular but can't be read
                    raise GGUFError(f"{self.path}: cannot be read ({e.strerror}); pass the .gguf model file "
                                    "itself") from None
            else:
                try:
                    self._mm = buf = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ)
                except (OSError, ValueError) as e:
                    raise GGUFError(f"{self.path}: cannot memory-map the file ({e}); "
                                    "copy it to a local disk") from None
            self.size = len(buf)
            self._parse(buf, check_data)
        except BaseException:
            self.close()
            raise

    def _parse(self, buf: Any, check_data: bool) -> None:
        cur = _Cursor(buf, self.size, self.path)
        if cur.u32("magic") != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF'); "
                            "pass a .gguf model file")
        self.version = cur.u32("version")
        if self.version not in (2, 3):
            hint = ", and looks big-endian, which is not supported" if self.version > 0xFFFF else ""
            raise GGUFError(f"{self.path}: GGUF version {self.version} is not supported (only 2 and 3){hint}; "
                            "re-convert the model with a current llama.cpp")
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        # a key-value pair takes at least 13 bytes, a tensor entry at least 32
        cur.room(n_kv, 13, "metadata count")
        cur.room(n_tensors, 32, "tensor count")

        self.metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, int] = {}
        for i in range(n_kv):
            key = cur.string(f"key of metadata entry {i}")
            if key in self.metadata:
                raise cur.fail(f"metadata key {_q(key)} appears twice")
            vtype = cur.u32(f"value type of {_q(key)}")
            self.metadata[key] = _read_value(cur, vtype, key)
            self.metadata_types[key] = vtype

        align = self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or isinstance(align, bool):
            raise GGUFError(f"{self.path}: metadata 'general.alignment' is a {type(align).__name__}, "
                            f"not an integer; {_DAMAGED}")
        if align <= 0 or align & (align - 1) or align > 1 << 20:
            raise GGUFError(f"{self.path}: metadata 'general.alignment' = {align} is not a power of two "
                            f"from 1 to 2^20; {_DAMAGED}")
        self.alignment = align

        entries = []
        names: set[str] = set()
        for i in range(n_tensors):
            name = cur.string(f"name of tensor {i}")
            t = f"tensor {_q(name)}"
            if name in names:
                raise cur.fail(f"{t} appears twice in the tensor table")
            names.add(name)
            n_dims = cur.u32(f"dimension count of {t}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise cur.fail(f"{t} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
            ne = tuple(cur.u64(f"dimension {d} of {t}") for d in range(n_dims))
            type_id = cur.u32(f"type of {t}")
            rel = cur.u64(f"data offset of {t}")
            entries.append((name, ne, type_id, rel))

        self.data_offset = (cur.pos + align - 1) // align * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, ne, type_id, rel in entries:
            self.tensors[name] = self._check_tensor(name, ne, type_id, rel, check_data)
        self._check_overlaps()

    def _check_tensor(self, name: str, ne: tuple[int, ...], type_id: int, rel: int,
                      check_data: bool) -> TensorInfo:
        where = f"{self.path}: tensor {_q(name)}"
        fmt = FORMATS.get(type_id)
        if fmt is None:
            raise GGUFError(f"{where} has unknown tensor type {type_id}; the file is damaged, or it was made "
                            "by a newer llama.cpp than this runtime knows")
        n = 1
        for i, d in enumerate(ne):
            if d == 0 or d > MAX_ELEMENTS:
                raise GGUFError(f"{where}: dimension {i} is {d} (1 to 2^48 allowed); {_DAMAGED}")
            n *= d
            if n > MAX_ELEMENTS:
                raise GGUFError(f"{where}: dimensions {list(ne)} give more than 2^48 elements; {_DAMAGED}")
        if ne[0] % fmt.block_elems:
            raise GGUFError(f"{where}: row length {ne[0]} is not a multiple of {fmt.name}'s block of "
                            f"{fmt.block_elems}; {_DAMAGED}")
        if rel % self.alignment:
            raise GGUFError(f"{where}: data offset {rel} is not aligned to {self.alignment}; {_DAMAGED}")
        nbytes = n // fmt.block_elems * fmt.block_bytes
        start = self.data_offset + rel
        if check_data and start >= self.size:
            raise GGUFError(f"{where}: data offset {rel} points past the end of the file ({self.size} bytes); "
                            "the file is damaged or truncated: re-download it")
        if check_data and nbytes > self.size - start:
            raise GGUFError(f"{where}: data [{start}, {start + nbytes}) runs past the end of the file "
                            f"({self.size} bytes); the file is truncated: re-download it")
        return TensorInfo(name, ne, type_id, start, nbytes)

    def _check_overlaps(self) -> None:
        prev = None
        for t in sorted(self.tensors.values(), key=lambda t: t.offset):
            if prev is not None and t.offset < prev.offset + prev.nbytes:
                raise GGUFError(f"{self.path}: tensors {_q(prev.name)} and {_q(t.name)} overlap "
                                f"(data at {prev.offset}+{prev.nbytes} and {t.offset}); {_DAMAGED}")
            prev = t

    # ---- access -----------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the mapped file (no copy)."""
        t = self.tensors[name]
        if self._mm is None:
            raise ValueError(f"{self.path}: the file is closed")
        if t.offset + t.nbytes > self.size:
            raise GGUFError(f"{self.path}: tensor {_q(name)} has no data in this file (header-only or "
                            "truncated); use the complete model file")
        return np.frombuffer(self._mm, dtype=np.uint8, count=t.nbytes, offset=t.offset)

    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None

    def header_bytes(self) -> bytes:
        """Everything before the tensor data (what ``synth --header-only`` keeps)."""
        if self._mm is None:
            raise ValueError(f"{self.path}: the file is closed")
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
