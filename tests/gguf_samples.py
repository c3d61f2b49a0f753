"""Small GGUF files for the reader tests, a layout walker, a raw header builder, and ways to damage files.

* ``write_sample`` writes a small valid file through ``gguf.GGUFWriter`` (scalars of every kind, strings,
  string arrays, numeric and bool arrays, a nested array; F32/F16/Q8_0/Q4_K tensors) and returns what
  it wrote, so tests can compare.
* ``layout`` walks a GGUF header independently of the reader under test and returns the byte span of
  every field, so damage can be aimed at a region (a key length, a dim, tensor data) instead of at
  magic numbers.
* ``build`` and the ``p_*``/``kv_*``/``tensor_info`` helpers pack hostile headers field by field.
* ``probe`` opens a file under a time limit (and optionally a memory trace) and checks the only allowed
  outcomes: a valid open whose every tensor and value can be read, or one one-line ``GGUFError``.
"""

from __future__ import annotations

import contextlib
import signal
import struct
import threading
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT
from gguf import GGUFWriter

from gguf_runtime.errors import GGUFError
from gguf_runtime.format.gguf_file import GGUFFile, open_gguf

U64_MAX = (1 << 64) - 1

# ---- valid samples ---------------------------------------------------------------------------------

SAMPLE_KVS: list[tuple[str, VT, Any]] = [
    ("general.name", VT.STRING, "tiny ünïcode ☃"),
    ("test.u8", VT.UINT8, 200),
    ("test.i8", VT.INT8, -100),
    ("test.u16", VT.UINT16, 60000),
    ("test.i16", VT.INT16, -30000),
    ("test.u32", VT.UINT32, 4_000_000_000),
    ("test.i32", VT.INT32, -2_000_000_000),
    ("test.u64", VT.UINT64, (1 << 64) - 2),
    ("test.i64", VT.INT64, -(1 << 62)),
    ("test.f32", VT.FLOAT32, 1.5),
    ("test.f64", VT.FLOAT64, -2.25e300),
    ("test.bool_true", VT.BOOL, True),
    ("test.bool_false", VT.BOOL, False),
    ("test.empty_string", VT.STRING, ""),
    ("tokenizer.ggml.tokens", VT.ARRAY, ["<s>", "</s>", "hello", "", "wörld", "▁the", "\n"]),
    ("tokenizer.ggml.scores", VT.ARRAY, [0.0, -1.5, 2.25]),
    ("tokenizer.ggml.token_type", VT.ARRAY, [1, 3, 1, 1, 6]),
    ("test.bools", VT.ARRAY, [True, False, True]),
    ("test.nested", VT.ARRAY, [[1, 2], [3, 4, 5], [6]]),
    ("test.after_nested", VT.UINT32, 7),
]


@dataclass
class Sample:
    path: Path
    metadata: dict[str, tuple[int, Any]]  # key -> (value type, value); arrays as lists
    tensors: dict[str, tuple[int, tuple[int, ...], bytes]]  # name -> (type id, ne, bytes)
    alignment: int


def write_sample(path: Path, *, alignment: int | None = None, seed: int = 0) -> Sample:
    """A small valid GGUF file with every kind of metadata and four tensor types."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "llama")
    meta: dict[str, tuple[int, Any]] = {"general.architecture": (int(VT.STRING), "llama")}
    if alignment is not None:
        w.add_custom_alignment(alignment)
        meta["general.alignment"] = (int(VT.UINT32), alignment)
    for key, vt, val in SAMPLE_KVS:
        w.add_key_value(key, val, vt)
        meta[key] = (int(vt), val)
    arrays = {
        "token_embd.weight": (QT.Q4_K, rng.integers(0, 256, (3, 144), dtype=np.uint8)),  # ne (256, 3)
        "blk.0.attn_q.weight": (QT.Q8_0, rng.integers(0, 256, (2, 2, 68), dtype=np.uint8)),  # (64, 2, 2)
        "output_norm.weight": (QT.F32, rng.standard_normal(48).astype(np.float32)),
        "blk.0.ffn_up.weight": (QT.F16, rng.standard_normal((3, 5)).astype(np.float16)),
        "rope_freqs.weight": (QT.F32, rng.standard_normal(5).astype(np.float32)),  # 20 bytes: odd size
    }
    tensors = {}
    for name, (qt, arr) in arrays.items():
        if arr.dtype == np.uint8:
            w.add_tensor(name, arr, raw_dtype=qt)
        else:
            w.add_tensor(name, arr)
        tensors[name] = (int(qt), (), arr.tobytes())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    lay = layout(Path(path).read_bytes())
    for name in tensors:  # fill in ne from the written header
        tensors[name] = (tensors[name][0], lay.tensor_ne[name], tensors[name][2])
    return Sample(Path(path), meta, tensors, alignment or 32)


# ---- an independent header walker -------------------------------------------------------------------

@dataclass(frozen=True)
class Span:
    region: str  # magic, version, tensor_count, kv_count, key_len, key, value_type, value, string_len,
    # string, array_type, array_len, array_items, string_item_len, string_item, tensor_name_len,
    # tensor_name, n_dims, dim, tensor_type, tensor_offset, padding, data
    label: str  # the key or tensor name it belongs to ("" for the fixed header)
    start: int
    end: int


@dataclass
class Layout:
    spans: list[Span]
    header_end: int  # end of the tensor table
    data_offset: int
    tensor_ne: dict[str, tuple[int, ...]]

    def find(self, region: str, label: str | None = None, nth: int = 0) -> Span:
        hits = [s for s in self.spans if s.region == region and (label is None or s.label == label)]
        return hits[nth]

    def all(self, region: str) -> list[Span]:
        return [s for s in self.spans if s.region == region]


_SIZES = {VT.UINT8: 1, VT.INT8: 1, VT.UINT16: 2, VT.INT16: 2, VT.UINT32: 4, VT.INT32: 4, VT.FLOAT32: 4,
          VT.BOOL: 1, VT.UINT64: 8, VT.INT64: 8, VT.FLOAT64: 8}
_BLOCKS = {0: (1, 4), 1: (1, 2), 8: (32, 34), 12: (256, 144)}  # the sample's types only


def layout(data: bytes) -> Layout:
    """Field spans of a well-formed GGUF (v3, little-endian) header; raises on anything odd."""
    spans: list[Span] = []
    pos = 0

    def take(region: str, label: str, n: int) -> int:
        nonlocal pos
        spans.append(Span(region, label, pos, pos + n))
        pos += n
        return pos - n

    def u32(region: str, label: str) -> int:
        return struct.unpack_from("<I", data, take(region, label, 4))[0]

    def u64(region: str, label: str) -> int:
        return struct.unpack_from("<Q", data, take(region, label, 8))[0]

    def string(len_region: str, region: str, label: str) -> bytes:
        n = u64(len_region, label)
        return data[take(region, label, n):pos]

    def value(vt: int, key: str, item: bool = False) -> None:
        if vt == VT.STRING:
            string("string_item_len" if item else "string_len", "string_item" if item else "string", key)
        elif vt == VT.ARRAY:
            it, n = u32("array_type", key), u64("array_len", key)
            if it in (VT.STRING, VT.ARRAY):
                for _ in range(n):
                    value(it, key, item=True)
            elif n:
                take("array_items", key, n * _SIZES[VT(it)])
        else:
            take("array_items" if item else "value", key, _SIZES[VT(vt)])

    assert data[:4] == b"GGUF"
    take("magic", "", 4)
    assert u32("version", "") == 3
    n_tensors, n_kv = u64("tensor_count", ""), u64("kv_count", "")
    alignment = 32
    for _ in range(n_kv):
        key = string("key_len", "key", "").decode()
        spans[-1] = Span("key", key, spans[-1].start, spans[-1].end)
        spans[-2] = Span("key_len", key, spans[-2].start, spans[-2].end)
        vt = u32("value_type", key)
        if key == "general.alignment":
            alignment = struct.unpack_from("<I", data, pos)[0]
        value(vt, key)
    infos = []
    for _ in range(n_tensors):
        name = string("tensor_name_len", "tensor_name", "").decode()
        spans[-1] = Span("tensor_name", name, spans[-1].start, spans[-1].end)
        spans[-2] = Span("tensor_name_len", name, spans[-2].start, spans[-2].end)
        ne = tuple(u64("dim", name) for _ in range(u32("n_dims", name)))
        infos.append((name, ne, u32("tensor_type", name), u64("tensor_offset", name)))
    header_end = pos
    data_offset = -(-pos // alignment) * alignment
    if data_offset > header_end:
        spans.append(Span("padding", "", header_end, data_offset))
    for name, ne, tid, off in infos:
        be, bb = _BLOCKS[tid]
        nbytes = int(np.prod(ne)) // be * bb
        spans.append(Span("data", name, data_offset + off, data_offset + off + nbytes))
    return Layout(spans, header_end, data_offset, {name: ne for name, ne, _, _ in infos})


# ---- a raw builder for hostile headers ---------------------------------------------------------------

def p_u32(v: int) -> bytes:
    return struct.pack("<I", v & 0xFFFFFFFF)


def p_u64(v: int) -> bytes:
    return struct.pack("<Q", v & U64_MAX)


def p_str(s: str | bytes, length: int | None = None) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return p_u64(len(b) if length is None else length) + b


def kv(key: str | bytes, vtype: int, payload: bytes, key_len: int | None = None) -> bytes:
    return p_str(key, key_len) + p_u32(vtype) + payload


def kv_u32(key: str | bytes, v: int) -> bytes:
    return kv(key, VT.UINT32, p_u32(v))


def kv_str(key: str | bytes, s: str | bytes, length: int | None = None) -> bytes:
    return kv(key, VT.STRING, p_str(s, length))


def kv_arr(key: str | bytes, item_type: int, count: int, items: bytes = b"") -> bytes:
    return kv(key, VT.ARRAY, arr_payload(item_type, count, items))


def arr_payload(item_type: int, count: int, items: bytes = b"") -> bytes:
    return p_u32(item_type) + p_u64(count) + items


def tensor_info(name: str | bytes, ne: tuple[int, ...], type_id: int = 0, offset: int = 0,
                n_dims: int | None = None, name_len: int | None = None) -> bytes:
    return (p_str(name, name_len) + p_u32(len(ne) if n_dims is None else n_dims)
            + b"".join(p_u64(d) for d in ne) + p_u32(type_id) + p_u64(offset))


def build(kvs: list[bytes] = (), tensors: list[bytes] = (), data: bytes = b"", *, n_kv: int | None = None,
          n_tensors: int | None = None, version: int = 3, magic: bytes = b"GGUF", alignment: int = 32) -> bytes:
    """Magic, version, counts, the given metadata and tensor entries, zero padding, then data."""
    head = (magic + p_u32(version) + p_u64(len(tensors) if n_tensors is None else n_tensors)
            + p_u64(len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + b"".join(tensors))
    return head + bytes(-len(head) % alignment) + data


# ---- damage -------------------------------------------------------------------------------------------

def patch(data: bytes, pos: int, new: bytes) -> bytes:
    return data[:pos] + new + data[pos + len(new):]


def flip_bit(data: bytes, pos: int, bit: int) -> bytes:
    return patch(data, pos, bytes([data[pos] ^ (1 << bit)]))


def insert(data: bytes, pos: int, new: bytes) -> bytes:
    return data[:pos] + new + data[pos:]


# ---- probing ------------------------------------------------------------------------------------------

class Hang(Exception):
    """Raised by ``time_limit`` when the reader runs too long."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Interrupt the block with ``Hang`` after ``seconds`` (main thread on POSIX; a no-op elsewhere)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise Hang(f"the reader ran longer than {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def exercise(f: GGUFFile, check_data: bool) -> None:
    """Read everything an opened file offers; every tensor's view must lie inside the file."""
    for key, value in f.metadata.items():
        assert key in f.metadata_types
        if isinstance(value, np.ndarray):
            value.sum()
        elif isinstance(value, list):
            len(value)
        str(value)[:100]
    f.get("general.architecture")
    f.architecture
    assert len(f.header_bytes()) == min(f.data_offset, f.size)
    assert f.data_offset % f.alignment == 0
    for name, t in f.tensors.items():
        assert t.name == name and t.type_name and t.n_elems > 0 and len(t.shape) == len(t.ne)
        assert t.offset >= f.data_offset and t.offset % f.alignment == 0
        if check_data or t.offset + t.nbytes <= f.size:
            view = f.raw(name)
            assert len(view) == t.nbytes and t.offset + t.nbytes <= f.size
            int(view[0]), int(view[-1])
            del view
        else:
            try:
                f.raw(name)
            except GGUFError:
                pass
            else:
                raise AssertionError(f"raw({name!r}) handed out data past the end of the file")


# A guard against a reader that never returns (a loop over a count read from the file), not a
# timing claim: opening any of these files takes milliseconds, and the guard is generous enough that
# a busy machine never trips it. Work bounds are checked by memory (max_memory), not by time.
HANG_GUARD_S = 30.0


def probe(path: Path, check_data: bool = True, *, seconds: float = HANG_GUARD_S,
          max_memory: int | None = None) -> str | None:
    """Open ``path``: ``None`` if it opened (and everything in it was read), else the GGUFError message.

    Any other exception propagates; so does ``Hang`` (after ``seconds``). With ``max_memory`` the
    open runs under ``tracemalloc`` and its peak allocation must stay below that many bytes.
    """
    if max_memory is not None:
        tracemalloc.start()
    msg: str | None = None
    try:
        with time_limit(seconds):
            try:
                f = open_gguf(path, check_data=check_data)
            except GGUFError as e:
                msg = str(e)
            else:
                with f:
                    exercise(f, check_data)
        if max_memory is not None:
            peak = tracemalloc.get_traced_memory()[1]
            assert peak < max_memory, f"{path}: opening it allocated {peak / 1e6:.1f} MB"
    finally:
        if max_memory is not None:
            tracemalloc.stop()
    if msg is not None:
        assert "\n" not in msg and "\r" not in msg, f"message is not one line: {msg!r}"
        assert msg.startswith(f"{path}: "), f"message does not start with the path: {msg!r}"
        assert len(msg) < 600, f"message is {len(msg)} characters long"
    return msg
