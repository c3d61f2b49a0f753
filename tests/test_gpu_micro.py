"""The CUDA backend against the path model (path_model.py) on micro models of each architecture.

Micro models (micro_models.py: real tokenizers, random weights at real checkpoints' scales) at the
smallest shapes the CUDA kernels take: Llama with the 8B's Q4_K/Q6_K mix and untied head, Qwen2
with Q/K/V biases, Qwen3 with QK-norm and head size 128, Gemma-3 with post norms, QK-norm, GELU,
head size 256, a sliding window of 4 and final soft-capping, Qwen3-MoE with 16 experts (4 a token),
Llama with a 1- to 3-bit i-quant in every matrix.
Two or three layers keep the rounding
paths out of their chaotic regime (path_model.py), so each is held to its numpy model:

* f32 activations (q8=0, up to 8 rows): every row to float32 order;
* int8 activations (the default): a quarter of the rows or more to float32 order (a real bug moves
  every row), and the rest, downstream of a value that rounded the other way, within the int8
  noise;
* f16 prefill operands: every row within a few f16 steps. At f16's finer grid nearly every row
  carries some flips, so no row is at float32 order, but the model is 2-5x closer than float32 numpy.

The bars are measured figures (H100, 2026-11-25) times a margin; see each constant.
"""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from gguf_runtime.backends.cuda.backend import CudaBackend  # noqa: E402
from gguf_runtime.format.gguf_file import open_gguf  # noqa: E402
from gguf_runtime.format.model_config import config_from_gguf  # noqa: E402
from micro_models import Micro, write_micro  # noqa: E402
from path_model import PathModel, assert_all_rows, assert_most_rows  # noqa: E402

Q4_K_M = {"token_embd.weight": QT.Q4_K, "output.weight": QT.Q6_K, "attn_q.weight": QT.Q4_K,
          "attn_k.weight": QT.Q4_K, "attn_v.weight": QT.Q6_K, "attn_output.weight": QT.Q4_K,
          "ffn_gate.weight": QT.Q4_K, "ffn_up.weight": QT.Q4_K, "ffn_down.weight": QT.Q6_K}
SHAPE = dict(n_embd=256, n_ff=512, n_head=4, n_head_kv=2)  # head size 64 unless stated
CASES = {
    "llama": Micro(**SHAPE, n_layer=2, rope_base=500000.0, eps=1e-5, tied=False, quant=Q4_K_M),
    "qwen2": Micro(arch="qwen2", vocab="qwen2", **SHAPE, n_layer=2, bias=True, rope_base=1e6,
                   quant={".weight": QT.Q8_0}),
    "qwen3": Micro(arch="qwen3", vocab="qwen2", **SHAPE, n_layer=2, qk_norm=True, head_dim=128, rope_base=1e6,
                   tied=False, quant={".weight": QT.Q4_1}),
    "gemma3": Micro(arch="gemma3", vocab="llama-spm", n_embd=256, n_ff=512, n_head=2, n_head_kv=1, head_dim=256,
                    n_layer=3, qk_norm=True, post_norms=True, sliding_window=4, rope_base=1e6, final_softcap=1.0,
                    quant={"token_embd.weight": QT.Q8_0, "attn_q.weight": QT.Q5_0, "attn_k.weight": QT.Q5_0,
                           "attn_v.weight": QT.Q8_0, "attn_output.weight": QT.Q4_K, "ffn_gate.weight": QT.Q4_K,
                           "ffn_up.weight": QT.Q4_K, "ffn_down.weight": QT.Q6_K}),
    # Qwen3-30B-A3B's layout at micro size: 16 experts, 4 a token, Q4_K gate/up and Q6_K down experts,
    # an f32 router (moe.cu)
    "qwen3moe": Micro(arch="qwen3moe", vocab="qwen2", **SHAPE, n_layer=2, qk_norm=True, head_dim=128, rope_base=1e6,
                      tied=False, n_expert=16, n_expert_used=4, n_ff_exp=256,
                      quant={**Q4_K_M, "ffn_gate_exps.weight": QT.Q4_K, "ffn_up_exps.weight": QT.Q4_K,
                             "ffn_down_exps.weight": QT.Q6_K}),
    # Qwen1.5-MoE's layout: softmax weights not renormalized, a sigmoid-gated shared expert (dense
    # products after the experts', the gate an f32 dot product), QKV biases
    "qwen2moe": Micro(arch="qwen2moe", vocab="qwen2", **SHAPE, n_layer=2, bias=True, rope_base=1e6, tied=False,
                      n_expert=8, n_expert_used=2, n_ff_exp=256, n_ff_shexp=512,
                      quant={**Q4_K_M, "ffn_gate_exps.weight": QT.Q4_K, "ffn_up_exps.weight": QT.Q4_K,
                             "ffn_down_exps.weight": QT.Q6_K, "ffn_gate_shexp.weight": QT.Q5_K,
                             "ffn_up_shexp.weight": QT.Q5_K, "ffn_down_shexp.weight": QT.Q8_0}),
    # gpt-oss's layout: attention sinks, q/k/v/o biases, the even layers sliding (4 keys), YaRN
    # (its attention factor), a biased router and biased MXFP4 experts, the clamped SwiGLU
    "gpt-oss": Micro(arch="gpt-oss", vocab="qwen2", n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_layer=2,
                     bias=True, tied=False, n_expert=8, n_expert_used=2, n_ff_exp=256, sliding_window=4,
                     yarn=(32.0, 4096), quant={"_exps.weight": QT.MXFP4, "attn_q.weight": QT.Q8_0,
                                               "attn_k.weight": QT.Q8_0, "attn_v.weight": QT.Q8_0,
                                               "attn_output.weight": QT.Q8_0, "output.weight": QT.Q6_K}),
    # Phi-3.5's layout: fused QKV and gate-up matrices (row slices on the GPU), LongRoPE (the long
    # factors: the context exceeds orig_ctx) with its attention factor; the table types
    # (IQ4_NL, IQ4_XS, MXFP4) in the products
    "phi3": Micro(arch="phi3", vocab="phi-3", **SHAPE, n_layer=2, tied=False, eps=1e-5,
                  longrope=(tuple(1.0 + 0.25 * i for i in range(32)), tuple(1.0 + 0.05 * i for i in range(32)), 32,
                            1.19),
                  quant={"token_embd.weight": QT.Q8_0, "attn_qkv.weight": QT.IQ4_NL, "attn_output.weight": QT.IQ4_XS,
                         "ffn_up.weight": QT.Q4_K, "ffn_down.weight": QT.MXFP4, "output.weight": QT.Q6_K}),
    # the 1- to 3-bit i-quants, one a matrix (quant_iq.cuh), in the embedding and the head too
    "llama-iq": Micro(**SHAPE, n_layer=2, rope_base=500000.0, eps=1e-5, tied=False,
                      quant={"token_embd.weight": QT.IQ3_XXS, "output.weight": QT.IQ2_XS,
                             "attn_q.weight": QT.IQ2_XXS, "attn_k.weight": QT.IQ2_XS, "attn_v.weight": QT.IQ3_XXS,
                             "attn_output.weight": QT.IQ3_S, "ffn_gate.weight": QT.IQ2_S,
                             "ffn_up.weight": QT.IQ1_S, "ffn_down.weight": QT.IQ1_M}),
}
N_CTX = 64
# f32 activations, every row (measured: 1 - cos <= 1.4e-12, max rel <= 4.7e-6)
F32 = dict(cos_gap=1e-10, max_rel=3e-5)
# int8: >= SHARE of the rows within TIGHT (measured 55-80% of rows, median max rel <= 1.2e-6), every
# row within LOOSE_Q8 (measured <= 2.8%; int8 against float32 numpy alone: <= 5.4%)
TIGHT, SHARE, LOOSE_Q8 = 3e-5, 0.25, 0.1
# int8 with rests (q8_res), every row, against the path model with rests and the float32 one
# (measured on the CPU, path model with rests vs float32: max rel <= 2.2e-4, 1 - cos <= 1e-8)
REST = dict(cos_gap=1e-6, max_rel=1.5e-3)
ALL_ROLES = "qkv+o+glu+down+head"
# f16 prefill, every row (measured: 1 - cos <= 1.9e-7, max rel <= 1.6e-3; f16 against float32 numpy
# alone: max rel <= 3.8e-3)
F16 = dict(cos_gap=5e-7, max_rel=2.5e-3)


@pytest.fixture(scope="module", params=sorted(CASES))
def micro(request, tmp_path_factory):
    path = write_micro(CASES[request.param], tmp_path_factory.mktemp("micro") / f"{request.param}.gguf")
    f = open_gguf(path)
    return request.param, f, config_from_gguf(f)


def run(be, ids, more=()):
    be.truncate(0)
    out = [be.eval(ids, all_logits=True)] + [be.eval([t]).reshape(1, -1) for t in more]
    return np.concatenate(out)


def prompts(rng, n_vocab, n, count, more=3):
    return [(rng.integers(0, n_vocab, n).tolist(), rng.integers(0, n_vocab, more).tolist()) for _ in range(count)]


def test_f32_path_every_row(micro, monkeypatch, rng):
    name, f, cfg = micro
    monkeypatch.setenv("GGUF_RUN_TUNE", "q8=0;kv_type=f32")  # the float32 path end to end
    be = CudaBackend(f, cfg, N_CTX)
    model = PathModel(f, cfg, N_CTX, q8=False, kv16=be.kv.kv_type == "f16")
    for ids, more in prompts(rng, cfg.n_vocab, 7, 2):
        assert_all_rows(run(be, ids, more), run(model, ids, more), what=f"micro {name} f32", **F32)


def test_int8_path_most_rows(micro, monkeypatch, rng):
    name, f, cfg = micro
    monkeypatch.setenv("GGUF_RUN_TUNE", "q8_res=none")
    be = CudaBackend(f, cfg, N_CTX)
    assert be.ws.q8_norm is not None
    model = PathModel(f, cfg, N_CTX, kv16=be.kv.kv_type == "f16")
    got, ref = zip(*[(run(be, ids, more), run(model, ids, more)) for ids, more in prompts(rng, cfg.n_vocab, 7, 4)])
    assert_most_rows(np.concatenate(got), np.concatenate(ref), TIGHT, SHARE, LOOSE_Q8, what=f"micro {name} int8")


def test_int8_path_moe_fusions(tmp_path, monkeypatch, rng):
    """qwen3moe with the fused MoE decode paths (tuning moe_norm_epilogue, moe_router_topk,
    moe_down_epilogue: O's epilogue writes the experts' int8 input, the router normalizes x itself
    and picks the experts in its own launch, the experts' down writes the next layer's int8 input;
    the epilogues are the defaults at one row): the int8 path's bars against the path model, as
    test_int8_path_most_rows, with a down launch seen taking its epilogue."""
    path = write_micro(CASES["qwen3moe"], tmp_path / "qwen3moe.gguf")
    f = open_gguf(path)
    cfg = config_from_gguf(f)
    monkeypatch.setenv("GGUF_RUN_TUNE", "q8_res=none;moe_norm_epilogue=1;moe_router_topk=1;moe_down_epilogue=1")
    from gguf_runtime.quant_kernels import launch_moe as LE
    epilogues, down = [], LE.down
    monkeypatch.setattr(LE, "down", lambda *a, **kw: (epilogues.append(kw.get("q8_out") is not None), down(*a, **kw)))
    be = CudaBackend(f, cfg, N_CTX)
    assert be.tune.moe_norm_epilogue and be.tune.moe_router_topk and be.tune.moe_down_epilogue
    model = PathModel(f, cfg, N_CTX, kv16=be.kv.kv_type == "f16")
    got, ref = zip(*[(run(be, ids, more), run(model, ids, more)) for ids, more in prompts(rng, cfg.n_vocab, 7, 4)])
    assert any(epilogues), "no down launch took the q8 epilogue"
    assert_most_rows(np.concatenate(got), np.concatenate(ref), TIGHT, SHARE, LOOSE_Q8, what="micro qwen3moe fused")


def test_int8_rest_path_every_row(micro, monkeypatch, rng):
    """With rests (q8_res) a value's grid is 254 times finer, so f32-order noise flips some value
    of every row (the path model is no tight reference: measured 7e-5 to 2.3e-4 max rel on every
    row, against 6e-7 median for int8 alone), each flip 254 times smaller: every row stays within
    REST of the float32 path (the path model's own rests vs float32: 5e-5 to 2.2e-4), where int8
    alone is 1-5% off."""
    name, f, cfg = micro
    monkeypatch.setenv("GGUF_RUN_TUNE", f"q8_res={ALL_ROLES}")
    be = CudaBackend(f, cfg, N_CTX)
    assert be.ws.q8_norm is not None and be.tune.q8_res
    kv16 = be.kv.kv_type == "f16"
    rest = PathModel(f, cfg, N_CTX, kv16=kv16, q8_res=be.tune.q8_res)
    f32 = PathModel(f, cfg, N_CTX, kv16=kv16, q8=False)
    for ids, more in prompts(rng, cfg.n_vocab, 7, 2):
        got = run(be, ids, more)
        assert_all_rows(got, run(rest, ids, more), what=f"micro {name} int8 + rests vs path", **REST)
        assert_all_rows(got, run(f32, ids, more), what=f"micro {name} int8 + rests vs f32", **REST)


@pytest.mark.parametrize("rows", [4, 16])
def test_rope_in_flash_decode_same_bits(micro, rows, monkeypatch, rng):
    """decode_rope (f16 caches): flash_decode does rope_kv's work where the QKV matvec's epilogue
    cannot (QK norms, NEOX pairs) and on the tensor-core path (16 rows): the same logits and the
    same cache bytes as with rope_kv's launch, over eager batch steps of uneven sequences."""
    from gguf_runtime.format.model_config import ROPE_NEOX
    from gguf_runtime.quant_kernels import launch_attention as LA
    from gguf_runtime.sampling import SamplingParams

    name, f, cfg = micro
    ps = [rng.integers(0, cfg.n_vocab, n).tolist() for n in (1, 3, 9, 17, 40, 5, 2, 33, 12, 7, 25, 4, 6, 8, 19, 11)]
    folded, real = [], LA.flash_decode

    def spy(*a, **kw):
        folded.append(kw.get("rope") is not None)
        return real(*a, **kw)

    monkeypatch.setattr(LA, "flash_decode", spy)
    outs, caches = [], []
    for on in ("1", "0"):
        monkeypatch.setenv("GGUF_RUN_TUNE", f"decode_rope={on};kv_type=f16")
        be = CudaBackend(f, cfg, N_CTX, max_batch=rows, use_graph=False)
        for s, p in enumerate(ps[:rows - 1]):
            be.seq_add(s, p, SamplingParams(temperature=0.0), 8)
        be.stream.synchronize()
        folded.clear()
        steps = []
        with be.stream:
            for _ in range(3):
                be._step(rows, (False, True))
                steps.append(be.ws.logits[:rows - 1].get())
        # (up to 8 rows the matvec epilogue rotates pairs (2i, 2i+1) without QK norms itself)
        matvec_rope = rows <= be.blocks.decode_mmv_rows and not cfg.qk_norm and cfg.rope.style != ROPE_NEOX
        assert any(folded) == (on == "1" and not matvec_rope), (name, folded)
        outs.append(np.stack(steps))
        caches.append((be.kv.k.get(), be.kv.v.get()))
        del be
    assert np.isfinite(outs[0]).all()
    assert all((a == b).all() for a, b in zip(*caches)), name
    assert (outs[0] == outs[1]).all(), (name, np.abs(outs[0] - outs[1]).max())


def test_f16_prefill_most_rows(micro, rng):
    """Every row within F16 of the path model; a mixture of experts' prompt runs its experts in tiles
    on int8 inputs (moe.cu), so there a SHARE of the rows within F16 and every row within the int8
    noise (measured: median max rel 2.3e-3, max 7.5e-3)."""
    name, f, cfg = micro
    be = CudaBackend(f, cfg, N_CTX)
    model = PathModel(f, cfg, N_CTX, kv16=be.kv.kv_type == "f16", q8_res=be.tune.q8_res)
    got, ref = zip(*[(run(be, ids), run(model, ids)) for ids, _ in prompts(rng, cfg.n_vocab, 24, 2)])
    got, ref = np.concatenate(got), np.concatenate(ref)
    if cfg.n_expert:
        assert_most_rows(got, ref, F16["max_rel"], SHARE, LOOSE_Q8, what=f"micro {name} f16 prefill, int8 tiles")
    else:
        assert_all_rows(got, ref, what=f"micro {name} f16 prefill", **F16)


@pytest.mark.parametrize("where", ["output_norm.weight", "blk.0.ffn_down.weight"])
def test_non_finite_weights_are_refused_at_load(tmp_path, where):
    """A NaN in a vector or in a quantized block's f16 scale: one line naming the tensor at load
    (the int8 path would otherwise turn it into finite garbage: its absmax ignores NaN)."""
    from gguf_runtime.errors import GGUFError
    from gguf_runtime.quant_kernels.reference import F16_FIELDS

    path = write_micro(CASES["llama"], tmp_path / "nan.gguf")
    with open_gguf(path) as f:
        t = f.tensors[where]
        at = t.offset + (F16_FIELDS[t.type_name][0] if t.type_name in F16_FIELDS else 0)
        size = 2 if t.type_name in F16_FIELDS else 4
    data = bytearray(path.read_bytes())
    data[at:at + size] = (np.float16 if size == 2 else np.float32)(np.nan).tobytes()
    path.write_bytes(bytes(data))
    f = open_gguf(path)
    with pytest.raises(GGUFError, match=f"'{where}' holds NaN or infinite values"):
        CudaBackend(f, config_from_gguf(f), N_CTX)


@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_non_finite_prompt_logits_are_one_line(micro, temp):
    """Non-finite logits of a prompt (an overflow of finite weights): the GPU sampler would pick
    token 0 from them for ever; one line instead, for one sequence and for a batch slot."""
    from gguf_runtime.engine.batch import generate_batch
    from gguf_runtime.engine.decode_loop import sample_loop
    from gguf_runtime.errors import GGUFError
    from gguf_runtime.sampling import SamplingParams

    name, f, cfg = micro
    params = SamplingParams(temperature=temp, seed=1)
    one = CudaBackend(f, cfg, N_CTX)
    one.prefill([1, 2, 3])
    with one.stream:  # (the backend's stream does not wait for the default one)
        one.last_logits[-1, 5] = cp.nan
    with pytest.raises(GGUFError, match="damaged"):
        list(sample_loop(one, 4, params, [1, 2, 3], frozenset()))
    two = CudaBackend(f, cfg, N_CTX, max_batch=2)
    real = two._eval

    def poisoned(slot, tokens, all_logits):
        out = real(slot, tokens, all_logits)
        with two.stream:
            out[-1, 3] = cp.inf
        return out
    two._eval = poisoned
    with pytest.raises(GGUFError, match="damaged"):
        generate_batch(two, [[1, 2, 3], [4, 5]], 4, params)
    assert two.kv.free_pages() == two.kv.n_pages  # the slots were released


LONG = 8000  # prompt tokens: four prefill chunks (flash attention over the cached ones), then a decode step
# against float32 numpy at position ~8,000 (measured on the H100: 1 - cos 1.3e-5, max rel 4.4e-3 / 1.6e-2
# for Llama / Gemma-3, whose soft-capped logits stay under 1): f16 noise, as at short prompts
LONG_NUMPY = dict(cos_gap=5e-5, max_rel=4e-2)
# against the path model (measured: 1 - cos 1.3e-6 / 1.8e-6, max rel 1.2e-3 / 4.5e-3): 3-4x the short
# prompts' gap, as the model rounds P against each row's final maximum, the kernel against each tile's
LONG_MODEL = dict(cos_gap=5e-6, max_rel=1e-2)


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_long_prompt_against_numpy(name, tmp_path, rng):
    """The cuda backend's logits after an 8,000-token prompt (prefill chunks with every cached key
    in view; Gemma-3's sliding window of 4 and soft-capping) and one decode step after it: against
    the path model (f16 prefill operands and flash attention's roundings, int8 decode), and against
    float32 numpy within f16's noise."""
    from gguf_runtime.backends.numpy.backend import NumpyBackend

    path = write_micro(CASES[name], tmp_path / f"{name}.gguf")
    f = open_gguf(path)
    cfg = config_from_gguf(f)
    ids = rng.integers(0, cfg.n_vocab, LONG + 1).tolist()

    def logits(be):
        return np.concatenate([be.eval(ids[:LONG]).reshape(1, -1), be.eval(ids[LONG:]).reshape(1, -1)])
    be = CudaBackend(f, cfg, LONG + 8)
    got = logits(be)
    model = logits(PathModel(f, cfg, LONG + 8, kv16=be.kv.kv_type == "f16", q8_res=be.tune.q8_res))
    ref = logits(NumpyBackend(f, cfg, LONG + 8))
    assert_all_rows(got[:1], model[:1], what=f"micro {name} prefill at {LONG} vs path model", **LONG_MODEL)
    assert_all_rows(got[:1], ref[:1], what=f"micro {name} prefill at {LONG} vs numpy", **LONG_NUMPY)
    assert_most_rows(got[1:], model[1:], TIGHT, 0.0, LOOSE_Q8, what=f"micro {name} decode at {LONG}")
