"""The CUDA backend's tuning table (backends/cuda/tuning.py): choices by model size, the one
environment override and its errors. No GPU needed: the table imports no CuPy."""

from __future__ import annotations

import dataclasses

import pytest

from gguf_runtime.backends.cuda import tuning
from gguf_runtime.backends.cuda.tuning import Tuning
from gguf_runtime.errors import BackendError

BIG = tuning.BIG_MODEL_BYTES


def test_choices_by_model_size(monkeypatch):
    monkeypatch.delenv(tuning.ENV, raising=False)
    small, big = tuning.choose(BIG), tuning.choose(BIG + 1)
    assert (small.kv_type, small.decode_mmv_rows, small.pdl_any_rows) == ("f32", 8, True)
    assert (big.kv_type, big.decode_mmv_rows, big.pdl_any_rows) == ("f16", 2, False)
    moe = tuning.choose(BIG * 17, moe=True)  # a mixture of experts: small batches on the matvecs, PDL everywhere
    assert (moe.kv_type, moe.decode_mmv_rows, moe.pdl_any_rows) == ("f16", 8, True)
    # token grids (launchers.token_grid) for the small models' latency-bound steps of several rows
    assert (small.mmv_token_grid, big.mmv_token_grid, moe.mmv_token_grid) == (8, 0, 0)
    # and the output head on the tensor cores from 4 rows (not the big models' 1-2 matvec rows)
    assert (small.head_mma_rows, big.head_mma_rows, moe.head_mma_rows) == (4, 0, 0)
    assert tuning.choose(BIG, sm_count=132).knobs().gpu_sms == 132
    assert tuning.choose(BIG + 1, kv_type="f32").kv_type == "f32"
    assert tuning.choose(BIG + 1, kv_type="auto").kv_type == "f16"
    # small models: f16 up to 128-dim heads (SmolLM2's 64), f32 for Gemma-3's 256
    assert tuning.choose(BIG, head_dim=64).kv_type == "f16"
    assert tuning.choose(BIG, head_dim=256).kv_type == "f32"
    assert tuning.choose(BIG + 1, head_dim=256).kv_type == "f16"
    # no call of more than 8 rows: no tensor-core inputs, so decode stays on the matvecs
    assert tuning.choose(BIG + 1, max_rows=8, max_batch=8).decode_mmv_rows == 8
    assert tuning.choose(BIG + 1, max_rows=8, max_batch=16).decode_mmv_rows == 2


def test_decode_splits_fill_one_wave():
    """(KV head, split) blocks of decode attention in one wave: 132 SMs, 8 KV heads: 16 splits;
    3 or 1 KV heads: the kernel's most, 32; unknown device: 32; an override wins."""
    assert tuning.choose(BIG + 1, n_head_kv=8, sm_count=132).decode_splits == 16
    # q8_0 caches (up to 128-dim heads): two blocks an SM
    assert tuning.choose(BIG + 1, "q8_0", n_head_kv=8, sm_count=132, head_dim=128).decode_splits == 32
    assert tuning.choose(BIG + 1, "q8_0", n_head_kv=8, sm_count=132, head_dim=256).decode_splits == 16
    assert tuning.choose(BIG + 1, "q4_0", n_head_kv=8, sm_count=132, head_dim=128).decode_splits == 16
    assert tuning.choose(BIG + 1, n_head_kv=8, sm_count=132, head_dim=128, overrides="kv_type=q8_0").decode_splits == 32
    assert tuning.choose(BIG, n_head_kv=3, sm_count=132).decode_splits == 32
    assert tuning.choose(BIG, n_head_kv=1, sm_count=132).decode_splits == 32
    assert tuning.choose(BIG, n_head_kv=8).decode_splits == 32
    assert tuning.choose(BIG, n_head_kv=8, sm_count=132, overrides="decode_splits=32").decode_splits == 32
    # flash_decode's batch splits follow the step's keys for the SMs (off: the split counts alone)
    assert tuning.choose(BIG, n_head_kv=8, sm_count=132).knobs().sm_count == 132
    assert tuning.choose(BIG, n_head_kv=8, sm_count=132, overrides="decode_work_split=0").knobs().sm_count == 0


def test_override_spellings():
    t = tuning.choose(BIG, overrides="q8=0; kstage=qkv+o ;mmv.DOWN_Q6_K=4:2;mmv.GLU=2:1;attn_big=8:2;"
                                     "tiles=on;pdl_big_graph_kernels=;mma_split_min_steps=0")
    assert t.q8 is False and t.kstage == {"qkv", "o"} and t.attn_big == (8, 2) and t.tiles == "on"
    assert t.mmv_override("DOWN", "Q6_K") == (4, 2) and t.mmv_override("DOWN", "Q4_K") is None
    assert t.mmv_override("GLU") == (2, 1) and t.mmv_override("QKV") is None
    assert t.pdl_big_graph_kernels == () and t.mma_split_min_steps == 0
    assert tuning.choose(BIG, overrides="kstage=none").kstage == frozenset()
    assert tuning.choose(BIG, overrides={"tiles_shape": "16:4"}).knobs().tiles == (16, 4)


def test_environment_is_the_default_override(monkeypatch):
    monkeypatch.setenv(tuning.ENV, "decode_mmv_rows=4;post_q8=off")
    t = tuning.choose(BIG + 1)
    assert t.decode_mmv_rows == 4 and t.post_q8 is False
    assert tuning.choose(BIG + 1, overrides="").decode_mmv_rows == 2  # an explicit override wins


@pytest.mark.parametrize("text, match", [
    ("bogus=1", "no field 'bogus'"), ("q8", "not field=value"), ("q8=maybe", "q8='maybe'"),
    ("decode_mmv_rows=9", "decode_mmv_rows=9"), ("decode_mmv_rows=two", "decode_mmv_rows='two'"),
    ("kv_type=q8", "kv_type='q8'"), ("decode_splits=64", "decode_splits=64"), ("decode_splits=0", "1 to 32"), ("tiles=sometimes", "tiles='sometimes'"), ("pdl=2", "pdl='2'"),
    ("moe_topk_glu_blocks=33", "0 .never. to 32 blocks"), ("mmv.ATTN=1:1", "the roles are"), ("mmv.QKV=2", "two numbers"), ("attn_big=4", "two numbers"),
])
def test_bad_overrides_name_the_field(text, match):
    with pytest.raises(BackendError, match=match) as e:
        tuning.choose(BIG, overrides=text)
    assert tuning.ENV in str(e.value)


def test_frozen_and_every_field_has_a_reason():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Tuning().q8 = False  # type: ignore[misc]
    src = open(tuning.__file__).read()
    for f in dataclasses.fields(Tuning):
        line = next(ln for ln in src.splitlines() if ln.strip().startswith(f"{f.name}:"))
        assert "#" in line, f"{f.name} has no reason"


def test_q8_rests_by_architecture_and_override():
    """Gemma-3's QKV and GLU inputs carry their rests (its decode perplexity), other models none;
    the override names roles, and a wrong role is one line naming the roles."""
    assert tuning.choose(BIG, arch="gemma3").q8_res == {"qkv", "glu"}
    assert not tuning.choose(BIG, arch="llama").q8_res and not tuning.choose(BIG).q8_res
    assert tuning.choose(BIG, arch="gemma3", overrides="q8_res=none").q8_res == frozenset()
    assert tuning.choose(BIG, overrides="q8_res=o+head").q8_res == {"o", "head"}
    with pytest.raises(BackendError, match="not among the roles qkv, o, glu, down, head"):
        tuning.choose(BIG, overrides="q8_res=qkv+mlp")


def test_moe_bounds_by_quant_type():
    """The experts' launch bounds: MXFP4's pair, the wide GLUs' pair, the others' (Q6_K's GLU spills
    at three blocks, so it is not wide); the wide set is overridable and a wrong type name is one line."""
    t = Tuning()
    assert t.moe_bounds("MXFP4") == t.moe_min_blocks_mxfp4
    assert t.moe_bounds("Q5_K") == t.moe_bounds("IQ4_XS") == t.moe_min_blocks_wide
    assert t.moe_bounds("Q6_K") == t.moe_bounds("Q4_K") == t.moe_min_blocks
    assert t.moe_min_blocks_wide != t.moe_min_blocks
    over = tuning.choose(BIG, overrides="moe_wide_glu=Q6_K;moe_min_blocks_wide=2:1")
    assert over.moe_bounds("Q6_K") == (2, 1) and over.moe_bounds("Q5_K") == over.moe_min_blocks
    with pytest.raises(BackendError, match="Q9_K not quant types"):
        tuning.choose(BIG, overrides="moe_wide_glu=Q9_K")
