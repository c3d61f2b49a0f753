"""The KV-cache element types' numpy reference (quant_kernels/reference_kv.py) and the numpy backend
that keeps its cache in them: q8_0 and q4_0 as llama.cpp's reference quantizers (the gguf package's
numpy ones, bit for bit), f16 rounding, bytes per element; the backend's logits with each type on a
micro model; the CUDA cache's page layout of each type (kv_layout.py) against the reference; the
cuda backend's one type for keys and values. No GPU needed."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants

from gguf_runtime.backends.numpy.backend import NumpyBackend
from gguf_runtime.engine.backend_choice import cuda_kv_type
from gguf_runtime.errors import BackendError
from gguf_runtime.format.gguf_file import open_gguf
from gguf_runtime.format.model_config import config_from_gguf
from gguf_runtime.quant_kernels import kv_layout, reference_kv
from micro_models import Micro, prompt_ids, write_micro


@pytest.mark.parametrize("kv_type,qt", [("q8_0", QT.Q8_0), ("q4_0", QT.Q4_0)])
@pytest.mark.parametrize("scale", [1.0, 1e-3, 300.0])
def test_quantized_roundtrip_is_llamacpps(kv_type, qt, scale, rng):
    """Random heads with an all-zero block, an outlier, a ramp and a block whose largest value
    appears twice with opposite signs (q4_0 keeps the first)."""
    x = (rng.standard_normal((40, 128)) * scale).astype(np.float32)
    x[0, :32] = 0
    x[1, 5] = -50 * scale
    x[2, :32] = np.linspace(-1, 1, 32) * scale
    x[3, 32:64] = 0.25 * scale
    x[3, 40], x[3, 50] = -scale, scale
    got = reference_kv.roundtrip(x, kv_type)
    ref = quants.dequantize(quants.quantize(x, qt), qt)
    assert np.array_equal(got, ref)
    assert not np.array_equal(got, x)  # it does round
    assert not got[0, :32].any()


def test_f16_f32_and_bytes():
    x = np.array([[1 / 3] * 32], np.float32)
    assert np.array_equal(reference_kv.roundtrip(x, "f32"), x)
    assert np.array_equal(reference_kv.roundtrip(x, "f16"), x.astype(np.float16).astype(np.float32))
    assert [reference_kv.bytes_per_element(t) for t in reference_kv.KV_TYPES] == [4, 2, 34 / 32, 18 / 32]
    with pytest.raises(ValueError, match="multiple of 32"):
        reference_kv.roundtrip(np.zeros((2, 48), np.float32), "q8_0")
    with pytest.raises(ValueError, match="not a KV cache type"):
        reference_kv.check("q5_1")


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    path = write_micro(Micro(n_embd=128, n_head=4, n_head_kv=2, n_layer=2),
                       tmp_path_factory.mktemp("kv") / "micro.gguf")
    f = open_gguf(path)
    return f, config_from_gguf(f)


def logits(f, cfg, kv_types, ids):
    be = NumpyBackend(f, cfg, 64, kv_types=kv_types)
    return np.concatenate([be.eval(ids[:20], all_logits=True), be.eval(ids[20:], all_logits=True)])


def test_numpy_backend_keeps_each_type(micro):
    """Every row's logits against the float32 cache: f16 within its rounding, q8_0 a little
    further, q4_0 further still, keys and values typed apart; none equal to f32's (the cache's
    values are rounded). Measured worst rows, 1 - cos: f16 1.8e-7, q8_0 1.3e-4 (keys alone
    5.9e-5), q4_0 2.3e-2 (random weights: real models' logits move less); bars 5x above."""
    f, cfg = micro
    assert cfg.head_dim == 32
    ids = prompt_ids(cfg.n_vocab, 24)
    ref = logits(f, cfg, ("f32", "f32"), ids).astype(np.float64)

    def gap(kv):
        got = logits(f, cfg, kv, ids).astype(np.float64)
        cos = (got * ref).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(ref, axis=-1)
        return float((1 - cos).max())
    gaps = {kv: gap(kv) for kv in [("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f32")]}
    assert all(g > 0 for g in gaps.values()), gaps
    assert gaps[("f16", "f16")] < 1e-6 and gaps[("q8_0", "q8_0")] < 7e-4 and gaps[("q4_0", "q4_0")] < 0.12, gaps
    assert gaps[("f16", "f16")] < gaps[("q8_0", "q8_0")] < gaps[("q4_0", "q4_0")], gaps
    assert gaps[("q8_0", "f32")] < gaps[("q8_0", "q8_0")] * 1.5, gaps


def test_numpy_backend_refuses_a_head_the_blocks_do_not_divide(tmp_path):
    path = write_micro(Micro(n_embd=64, n_head=4, n_head_kv=2), tmp_path / "h16.gguf")  # heads of 16
    f = open_gguf(path)
    with pytest.raises(BackendError, match="multiple of 32"):
        NumpyBackend(f, config_from_gguf(f), 32, kv_types=("q4_0", "f32"))


def test_cuda_takes_one_type():
    assert cuda_kv_type("auto", "auto") == "auto"
    assert cuda_kv_type("f16", "auto") == "f16" and cuda_kv_type("auto", "f32") == "f32"
    assert cuda_kv_type("q8_0", "q8_0") == "q8_0" and cuda_kv_type("auto", "q4_0") == "q4_0"
    with pytest.raises(BackendError, match="one type"):
        cuda_kv_type("f16", "f32")
    with pytest.raises(BackendError, match="-ctk q8_0 -ctv f16 differ"):
        cuda_kv_type("q8_0", "f16")


@pytest.mark.parametrize("kv_type", kv_layout.KV_TYPES)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_page_layout_holds_the_references_values(kv_type, d, rng):
    """Blocks of (pages, heads, 16 rows, d) packed as the CUDA cache keeps them unpack to the
    reference's roundtrip bit for bit; their size is block_bytes (16-byte rows, scales after)."""
    x = (rng.standard_normal((3, 2, 16, d)) * np.array([1e-3, 1.0, 40.0])[:, None, None, None]).astype(np.float32)
    x[0, 0, 3, :32] = 0  # an all-zero block
    raw = kv_layout.pack(x, kv_type)
    assert raw.shape == (3, 2, kv_layout.block_bytes(kv_type, 16, d)) and raw.dtype == np.uint8
    back = kv_layout.unpack(raw, kv_type, 16, d)
    assert np.array_equal(back, reference_kv.roundtrip(x, kv_type))
    vb, sb = kv_layout.row_bytes(kv_type, d)
    assert vb % 16 == 0 and (vb + sb) * 32 == d * reference_kv.BYTES_PER_BLOCK[kv_type]


def test_q4_0_nibble_order(rng):
    """Value 2i in the low nibble of byte i, stored as q + 8 (kv_cache.cuh's kv_store writes them so)."""
    x = np.zeros((16, 32), np.float32)
    x[0, :4] = [8.0, -8.0, 1.0, 3.0]  # d = 8 / -8 = -1: q = -8, 8 -> clamped 7, -1, -3
    raw = kv_layout.pack(x, "q4_0")
    assert list(raw[:2]) == [0 | (15 << 4), 7 | (5 << 4)]
