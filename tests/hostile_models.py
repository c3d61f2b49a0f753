"""The hostile corpus: well-formed GGUF files with nonsense in them, and giant inputs.

``rewrite`` copies a file with some metadata values replaced (or removed), keeping its tensor table
and data byte for byte; ``METADATA_CASES`` are the rewrites a model check must refuse, each with
the words its one-line error must hold (the field's name, at least); ``BOMBS`` are chat templates
that would hang or take gigabytes without limits; ``write_corpus`` writes all of them as files,
with the giant prompts beside them (tests/test_hostile_corpus.py runs each through the CLI and
the server).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as V

from gguf_runtime.format.gguf_file import open_gguf
from gguf_runtime.tools.synth_presets import pack_header
from micro_models import Micro, write_micro

BASE = Micro(quant={".weight": QT.Q8_0})  # llama, 2 layers, 4,096 tokens of the Llama-3 vocabulary


def base_file(folder: Path) -> Path:
    """The micro model with the keys real files carry besides (special ids, flags, a template)."""
    path = folder / "base.gguf"
    if not path.is_file():
        micro = write_micro(BASE, folder / "micro.gguf")
        rewrite(micro, path, {
            "llama.vocab_size": (V.UINT32, 4096), "tokenizer.ggml.bos_token_id": (V.UINT32, 1),
            "tokenizer.ggml.eos_token_id": (V.UINT32, 2), "tokenizer.ggml.padding_token_id": (V.UINT32, 2),
            "tokenizer.ggml.add_bos_token": (V.BOOL, True), "tokenizer.ggml.add_eos_token": (V.BOOL, False),
            "tokenizer.chat_template": (V.STRING, "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                                                  "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"),
            "llama.rope.scaling.type": (V.STRING, "linear"), "llama.rope.scaling.factor": (V.FLOAT32, 1.0),
            "general.file_type": (V.UINT32, 7)})
    return path


def rewrite(src: Path, dst: Path, changes: dict[str, tuple[int, Any] | None]) -> Path:
    """``src`` with metadata ``key -> (GGUF value type, value)`` set (None: removed)."""
    with open_gguf(src) as f:
        kvs = [(k, *changes[k]) if k in changes else (k, f.metadata_types[k], v)
               for k, v in f.metadata.items() if changes.get(k, ()) is not None]
        kvs += [(k, *c) for k, c in changes.items() if k not in f.metadata and c is not None]
        header = pack_header(kvs, [(t.name, t.ne, t.type_id) for t in f.tensors.values()], f.alignment)
        offset = f.data_offset
    dst.write_bytes(header + Path(src).read_bytes()[offset:])
    return dst


L, T = "llama.", "tokenizer.ggml."
NAN, INF = float("nan"), float("inf")
# (case id, changes, words the error names)
METADATA_CASES = [
    ("block_count 1e8", {L + "block_count": (V.UINT32, 10 ** 8)}, ["block_count", "100000000", "2 layers"]),
    ("block_count 2^63", {L + "block_count": (V.UINT64, 2 ** 63)}, ["block_count", "9223372036854775808"]),
    ("block_count 0", {L + "block_count": (V.UINT32, 0)}, ["layers 0"]),
    ("head_count nan", {L + "attention.head_count": (V.FLOAT32, NAN)}, ["attention.head_count", "nan"]),
    ("head_count inf", {L + "attention.head_count": (V.FLOAT32, INF)}, ["attention.head_count", "inf"]),
    ("head_count 2.5", {L + "attention.head_count": (V.FLOAT32, 2.5)}, ["attention.head_count", "2.5"]),
    ("head_count string", {L + "attention.head_count": (V.STRING, "4")}, ["attention.head_count", "'4'"]),
    ("head_count strings", {L + "attention.head_count": (V.ARRAY, ["4", "4"])}, ["attention.head_count"]),
    ("head_count empty", {L + "attention.head_count": (V.ARRAY, np.zeros(0, np.int32))}, ["attention.head_count"]),
    ("embedding 2^40", {L + "embedding_length": (V.UINT64, 2 ** 40)}, ["token_embd.weight", "embedding_length"]),
    ("feed_forward 2^40", {L + "feed_forward_length": (V.UINT64, 2 ** 40)}, ["ffn_gate.weight"]),
    ("vocab_size above tokens", {L + "vocab_size": (V.UINT32, 5000)}, ["vocab_size", "5000", "4096 tokens"]),
    ("vocab_size below tokens", {L + "vocab_size": (V.UINT32, 100)}, ["vocab_size", "100"]),
    ("freq_base 0", {L + "rope.freq_base": (V.FLOAT32, 0.0)}, ["rope.freq_base", "0.0"]),
    ("freq_base -1", {L + "rope.freq_base": (V.FLOAT32, -1.0)}, ["rope.freq_base", "-1.0"]),
    ("freq_base nan", {L + "rope.freq_base": (V.FLOAT32, NAN)}, ["rope.freq_base", "nan"]),
    ("eps -1", {L + "attention.layer_norm_rms_epsilon": (V.FLOAT32, -1.0)}, ["layer_norm_rms_epsilon"]),
    ("eps inf", {L + "attention.layer_norm_rms_epsilon": (V.FLOAT32, INF)}, ["layer_norm_rms_epsilon"]),
    ("context 0", {L + "context_length": (V.UINT32, 0)}, ["context_length", "0"]),
    ("rope dims odd", {L + "rope.dimension_count": (V.UINT32, 15)}, ["RoPE dimension count 15"]),
    ("tokens of ints", {T + "tokens": (V.ARRAY, np.arange(4096, dtype=np.int32))}, ["tokenizer.ggml.tokens"]),
    ("bos 'abc'", {T + "bos_token_id": (V.STRING, "abc")}, ["bos_token_id", "'abc'"]),
    ("bos nan", {T + "bos_token_id": (V.FLOAT32, NAN)}, ["bos_token_id", "nan"]),
    ("bos [1, 2]", {T + "bos_token_id": (V.ARRAY, np.array([1, 2], np.int32))}, ["bos_token_id", "[1, 2]"]),
    ("token_type strings", {T + "token_type": (V.ARRAY, ["a"] * 4096)}, ["token_type"]),
    ("scores strings", {T + "scores": (V.ARRAY, ["x"] * 4096)}, ["scores"]),
    ("scores nan", {T + "scores": (V.ARRAY, np.full(4096, NAN, np.float32))}, ["scores", "finite"]),
    ("merges of arrays", {T + "merges": (V.ARRAY, [np.array([1, 2], np.int32)] * 10)}, ["merges"]),
    ("model as array", {T + "model": (V.ARRAY, ["gpt2"])}, ["tokenizer.ggml.model", "['gpt2']"]),
    ("pre as array", {T + "pre": (V.ARRAY, ["llama-bpe"])}, ["tokenizer.ggml.pre"]),
    ("add_bos as string", {T + "add_bos_token": (V.STRING, "yes")}, ["add_bos_token"]),
    ("escape in name", {"general.architecture": (V.STRING, "lla\x1b[31mma")}, ["\\x1b"]),
    ("yarn factor 0.5", {L + "rope.scaling.type": (V.STRING, "yarn"), L + "rope.scaling.factor": (V.FLOAT32, 0.5)},
     ["rope.scaling.factor", "0.5", "YaRN"]),
]

BOMBS = [
    ("nested ranges", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"),
    ("nested loops over a list", "{% set xs = range(100000)|list %}{% for a in xs %}{% for b in xs %}"
                                 "{% endfor %}{% endfor %}"),
    ("lipsum", "{{ lipsum(10**7) }}"),
    ("format width", "{{ '%0999999999d'|format(1) }}"),
    ("percent width", "{{ '%0999999999d' % 1 }}"),
    ("str.format width", "{{ '{:>999999999}'.format(1) }}"),
    ("string repeat", "{{ 'a' * 10**8 }}"),
    ("list repeat", "{% set x = [0] * 10**8 %}"),
    ("power", "{{ 10 ** (10 ** 8) }}"),
    ("doubling with ~", "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                        "{% endfor %}{{ ns.s|length }}"),
    ("doubling with +", "{% set ns = namespace(s=[1]) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                        "{% endfor %}"),
    ("center", "{{ 'x'.center(10**9) }}"),
    ("center filter", "{{ 'x'|center(10**9) }}"),
    ("replace growth", "{% set ns = namespace(s='aa') %}{% for i in range(40) %}"
                       "{% set ns.s = ns.s|replace('a', 'aaaa') %}{% endfor %}"),
    ("join growth", "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = [ns.s, ns.s]|join %}"
                    "{% endfor %}"),
    ("output", "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}"),
    ("recursive macro", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"),
    ("indent", "{{ ('a\n' * 100000)|indent(1000) }}"),
    ("sum of lists", "{% set b = [range(100000)|list] * 100000 %}{{ b|sum(start=[])|length }}"),
    ("percent widths", "{{ ('%99999s' * 500000) % (('a',) * 500000) }}"),
    ("format filter widths", "{{ ('%99999s' * 500000)|format(*(('a',) * 500000)) }}"),
    ("join delimiter", "{% set xs = [''] * 1500 %}{{ xs|join('x' * 4000000) }}"),
    ("wordwrap string", "{{ ('a ' * 1500)|wordwrap(1, wrapstring='x' * 4000000) }}"),
    ("a big list printed", "{% set b = [range(100000)|list] * 100000 %}{{ b }}"),
    ("a big list as a string", "{% set b = [range(100000)|list] * 100000 %}{{ b|string|length }}"),
    ("a big list as JSON", "{% set b = [range(100000)|list] * 100000 %}{{ b|tojson|length }}"),
    ("a big list joined with ~", "{% set b = [range(100000)|list] * 100000 %}{{ (b ~ '')|length }}"),
    ("deep tuple hashed", "{% set ns = namespace(x=()) %}{% for i in range(300000) %}{% set ns.x = (ns.x,) %}"
                          "{% endfor %}{{ {ns.x: 1}|length }}"),
]

# prompts: one giant "word" (a run of one letter: one BPE word of a million symbols), and a megabyte
# of distinct words (no cache helps)
GIANT_WORD = "a" * 1_000_000
GIANT_WORDS = " ".join(f"w{i:x}q" for i in range(150_000))[:1_000_000]


def write_corpus(folder: Path) -> list[tuple[str, Path, str]]:
    """Every hostile file: (name, path, kind), kind "metadata" (the model check must refuse it) or
    "template" (it loads; its chat template must end in one line when rendered)."""
    folder.mkdir(parents=True, exist_ok=True)
    base = base_file(folder)
    out = []
    for i, (name, changes, _) in enumerate(METADATA_CASES):
        out.append((name, rewrite(base, folder / f"meta{i:02d}.gguf", changes), "metadata"))
    for i, (name, source) in enumerate(BOMBS):
        out.append((f"template: {name}", rewrite(base, folder / f"bomb{i:02d}.gguf",
                                                 {"tokenizer.chat_template": (V.STRING, source)}), "template"))
    return out
