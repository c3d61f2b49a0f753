"""Hypothesis fuzzing of the GGUF reader: 2,400 cases, each a valid open or one GGUFError.

(a) headers built field by field with struct packing, where every count, length, type, dim and
    offset is either consistent or hostile, so cases get past the early checks and deep into the
    metadata and tensor table;
(b) truncations, overwrites, insertions, deletions and field-aimed patches of valid files.

``probe`` (tests/gguf_samples.py) opens each file under a time limit and a memory trace, reads
everything a successful open offers, and checks that a refusal is one line naming the file.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gguf_runtime.format.blocks import FORMATS

try:
    from gguf_samples import U64_MAX, build, layout, p_u32, p_u64, probe, write_sample
except ImportError:  # tests/ imported as a package
    from tests.gguf_samples import U64_MAX, build, layout, p_u32, p_u64, probe, write_sample

SETTINGS = dict(deadline=2000, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MAX_MEMORY = 16 << 20  # every fuzz file is under 70 kB; the reader may not allocate more than this

EDGE_U64 = [0, 1, 2, 3, 7, 8, 12, 13, 31, 32, 33, 64, 255, 256, 4095, 4096, 1 << 16, (1 << 31) - 1, 1 << 31,
            (1 << 32) - 1, 1 << 32, (1 << 48) - 1, 1 << 48, (1 << 48) + 1, 1 << 61, 1 << 62, (1 << 63) - 1,
            1 << 63, (1 << 63) + 1, U64_MAX - 31, U64_MAX - 1, U64_MAX]
EDGE_U32 = [v for v in EDGE_U64 if v < 1 << 32]
VALUE_TYPES = list(range(13))  # 0..12 are GGUF's value types
SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
TENSOR_TYPES = sorted(FORMATS) + [4, 5, 31, 32, 33, 36, 37, 38, 42, 99, 255]
KEYS = ["general.architecture", "general.alignment", "general.name", "tokenizer.ggml.tokens", "llama.block_count"]


def u64(actual: int | None = None, pct: int = 10) -> st.SearchStrategy[int]:
    """The consistent value (when there is one) except ``pct`` percent of the time: an edge value or anything."""
    hostile = st.one_of(st.sampled_from(EDGE_U64), st.integers(0, U64_MAX), st.integers(0, 300))
    if actual is None:
        return hostile
    return st.integers(0, 99).flatmap(lambda r: hostile if r < pct else st.just(actual))


def u32(actual: int | None = None, pct: int = 10) -> st.SearchStrategy[int]:
    hostile = st.one_of(st.sampled_from(EDGE_U32), st.integers(0, (1 << 32) - 1), st.integers(0, 40))
    if actual is None:
        return hostile
    return st.integers(0, 99).flatmap(lambda r: hostile if r < pct else st.just(actual))


@st.composite
def string_field(draw) -> bytes:
    b = draw(st.one_of(st.text(max_size=12).map(str.encode), st.binary(max_size=12)))  # binary: often not UTF-8
    return p_u64(draw(u64(len(b), pct=5))) + b


@st.composite
def value(draw, vtype: int, depth: int = 0) -> bytes:
    """The payload of one value of ``vtype`` (no type field), sometimes with hostile lengths."""
    if vtype in SCALAR_SIZE:
        return draw(st.binary(min_size=SCALAR_SIZE[vtype], max_size=SCALAR_SIZE[vtype]))
    if vtype == 8:
        return draw(string_field())
    if vtype == 9:
        item = draw(u32(draw(st.sampled_from([0, 4, 5, 7, 8, 8, 10, 12] + ([9] if depth < 2 else []))), pct=5))
        n = draw(st.integers(0, 6))
        items = b"".join(draw(value(item, depth + 1)) for _ in range(n)) if item in SCALAR_SIZE or item in (8, 9) \
            else draw(st.binary(max_size=16))
        return p_u32(item) + p_u64(draw(u64(n, pct=5))) + items
    return draw(st.binary(max_size=16))  # an unknown type: whatever follows


@st.composite
def metadata_entry(draw, index: int) -> bytes:
    r = draw(st.integers(0, 99))
    if r < 2:  # raw bytes: often not UTF-8, sometimes a duplicate
        key = draw(st.binary(max_size=8))
    elif r < 25:  # real keys; general.alignment gets a u32 value half the time
        key = draw(st.sampled_from(KEYS)).encode()
    else:
        key = draw(st.text(max_size=10)).encode() + f".{index}".encode()
    if key == b"general.alignment" and draw(st.booleans()):
        return p_u64(len(key)) + key + p_u32(4) + p_u32(draw(st.sampled_from([0, 1, 3, 8, 32, 64, 1 << 31])))
    vtype = draw(u32(draw(st.sampled_from(VALUE_TYPES)), pct=5))
    return p_u64(draw(u64(len(key), pct=4))) + key + p_u32(vtype) + draw(value(vtype))


@st.composite
def tensor_entry(draw, index: int) -> tuple[bytes, int]:
    """A tensor-table entry and the data bytes it would need if it were consistent."""
    r = draw(st.integers(0, 99))
    name = draw(st.binary(max_size=6)) if r < 5 else b"t0" if r < 8 else f"t{index}".encode()
    tid = draw(st.sampled_from(TENSOR_TYPES))  # includes unknown ids
    fmt = FORMATS.get(tid, FORMATS[0])
    ne = [fmt.block_elems * draw(st.integers(1, 3))] + [draw(st.integers(1, 3)) for _ in range(draw(st.integers(0, 3)))]
    ne = [draw(u64(d, pct=5)) for d in ne]
    n_dims = draw(u32(len(ne), pct=5))
    offset = draw(u64(32 * draw(st.integers(0, 16)), pct=10))
    n = 1
    for d in ne:
        n *= d
    need = offset + (n // fmt.block_elems * fmt.block_bytes if n < 1 << 20 else 0)
    entry = (p_u64(draw(u64(len(name), pct=4))) + name + p_u32(n_dims) + b"".join(p_u64(d) for d in ne)
             + p_u32(tid) + p_u64(offset))
    return entry, need


@st.composite
def hostile_file(draw) -> tuple[bytes, bool]:
    kvs = [draw(metadata_entry(i)) for i in range(draw(st.integers(0, 6)))]
    tensors = [draw(tensor_entry(i)) for i in range(draw(st.integers(0, 4)))]
    need = max([n for _, n in tensors] + [0])
    data_len = draw(st.one_of(st.just(min(need, 4096)), st.integers(0, 1024)))
    data = draw(st.one_of(st.just(bytes(data_len)), st.binary(min_size=data_len, max_size=data_len)))
    raw = build(kvs, [e for e, _ in tensors], data,
                n_kv=draw(u64(len(kvs), pct=4)), n_tensors=draw(u64(len(tensors), pct=4)),
                version=draw(u32(draw(st.sampled_from([2, 3])), pct=3)),
                magic=draw(st.sampled_from([b"GGUF"] * 40 + [b"GGML", b"FUGG"])),
                alignment=draw(st.sampled_from([32, 32, 1, 8])))
    return raw, draw(st.booleans())


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


class Samples(list):
    """Valid sample files and their field spans (with a short repr for Hypothesis's failure report)."""

    def __repr__(self) -> str:
        return f"<{len(self)} sample files>"

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(repr(self))


@pytest.fixture(scope="module")
def samples(workdir) -> Samples:
    files = [write_sample(workdir / f"s{i}.gguf", alignment=a, seed=i).path.read_bytes()
             for i, a in enumerate([None, 64, 1])]
    return Samples((data, layout(data).spans) for data in files)


@settings(max_examples=1200, **SETTINGS)
@given(case=hostile_file())
def test_fuzz_structured_headers(workdir, case):
    data, check_data = case
    p = workdir / "structured.gguf"
    p.write_bytes(data)
    event(outcome(probe(p, check_data, max_memory=MAX_MEMORY)))


def outcome(msg: str | None) -> str:
    """A coarse label for ``--hypothesis-show-statistics``: which check ended the case."""
    if msg is None:
        return "opened"
    for word in ("UTF-8", "twice", "magic", "version", "tensor count", "metadata count", "key of metadata",
                 "unknown value type", "value type", "unknown item type", "nests", "item", "array", "string value",
                 "value of",
                 "general.alignment", "name of tensor", "dimensions", "dimension", "type of tensor",
                 "unknown tensor type", "row length", "data offset", "aligned", "past the end", "overlap"):
        if word in msg:
            return word
    return "other"


def mutation(n_samples: int) -> st.SearchStrategy:
    pos = st.integers(0, 1 << 16)  # a position, spread over the current length by hashing
    op = st.one_of(
        st.tuples(st.just("truncate"), pos),
        st.tuples(st.just("overwrite"), pos, st.binary(min_size=1, max_size=9)),
        st.tuples(st.just("insert"), pos, st.binary(min_size=1, max_size=9)),
        st.tuples(st.just("delete"), pos, st.integers(1, 16)),
        st.tuples(st.just("field64"), st.integers(0, 10_000), st.sampled_from(EDGE_U64)),
        st.tuples(st.just("field32"), st.integers(0, 10_000), st.sampled_from(EDGE_U32 + [13, 99])),
    )
    return st.tuples(st.integers(0, n_samples - 1), st.lists(op, min_size=1, max_size=4), st.booleans())


def mutate(data: bytes, ops: list[tuple], spans: list) -> bytes:
    for kind, *args in ops:
        at = args[0] * 2654435761 % (len(data) + 1)
        if kind == "truncate":
            data = data[:at]
        elif kind == "overwrite":
            data = data[:at] + args[1] + data[at + len(args[1]):]
        elif kind == "insert":
            data = data[:at] + args[1] + data[at:]
        elif kind == "delete":
            data = data[:at] + data[at + args[1]:]
        else:  # aim at a real field of the original layout: a count, a length, a type, a dim, an offset
            width = 8 if kind == "field64" else 4
            fields = [s for s in spans if s.end - s.start == width and s.region != "data"]
            s = fields[args[0] % len(fields)]
            new = p_u64(args[1]) if width == 8 else p_u32(args[1])
            data = data[:s.start] + new + data[s.end:]
    return data


@settings(max_examples=1200, **SETTINGS)
@given(case=mutation(3))
def test_fuzz_mutated_files(workdir, samples, case):
    which, ops, check_data = case
    data, spans = samples[which]
    p = workdir / "mutated.gguf"
    p.write_bytes(mutate(data, ops, spans))
    event(outcome(probe(p, check_data, max_memory=MAX_MEMORY)))
