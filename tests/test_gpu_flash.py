"""flash_attn.cu (prompt chunks' attention on the tensor cores) against float64 numpy: every head
dim, GQA ratio, sliding window, soft-cap, a chunk at an offset (keys cached before it), pages in
shuffled order, padding rows in front as prefill.py pads, row counts that leave a partial block,
float32, f16, q8_0 and q4_0 caches (kv_layout.py's pages; the reference takes the values they
hold), each block shape; outputs poisoned first. The operands are f16 on the
tensor cores (q scaled, K, V, and P), accumulation f32: the bar is f16's, a few 1e-4 relative."""

import math

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from gguf_runtime.quant_kernels import kv_layout as KL  # noqa: E402
from gguf_runtime.quant_kernels import launch_attention as LA  # noqa: E402
from gguf_runtime.quant_kernels import launchers as L  # noqa: E402
from gguf_runtime.backends.cuda.tuning import Tuning  # noqa: E402

from test_gpu_kernels import POISON, attention_ref, rel  # noqa: E402

BAR = 2e-3  # relative L2 over the whole output (measured: see bench/RESULTS.md)


@pytest.fixture(scope="module")
def k():
    return L.Kernels(Tuning().knobs())


def as_cache(vals, kv, page=16):
    """Float pages [n_pages, hkv, page, d] packed as a cache of type kv, and the values it holds."""
    raw = KL.pack(vals, kv)
    return raw, KL.unpack(raw, kv, page, vals.shape[-1])


def paged(rng, n_ctx, hkv, d, kv, page=16, extra=3):
    """K, V [n_ctx, hkv, d] as the cache of type kv holds them, and the cache pages (packed) in a
    shuffled table (unowned pages hold noise that must never be read)."""
    max_pages = -(-n_ctx // page)
    n_pages = max_pages + extra
    table = rng.permutation(n_pages).astype(np.int32)[:max_pages]
    kc = (rng.standard_normal((n_pages, hkv, page, d)) * 100).astype(np.float32)
    vc = (rng.standard_normal((n_pages, hkv, page, d)) * 100).astype(np.float32)
    for p in range(n_ctx):
        kc[table[p // page], :, p % page] = rng.standard_normal((hkv, d))
        vc[table[p // page], :, p % page] = rng.standard_normal((hkv, d))
    (kc, kvals), (vc, vvals) = as_cache(kc, kv, page), as_cache(vc, kv, page)
    rows = [(table[p // page], p % page) for p in range(n_ctx)]
    K = np.stack([kvals[pg, :, sl] for pg, sl in rows])
    V = np.stack([vvals[pg, :, sl] for pg, sl in rows])
    return K, V, kc, vc, table[None], max_pages


def run_flash(k, q, kc, vc, pos, seq, table, max_pages, hq, hkv, d, scale, cap, window, kv, config=None, sinks=None):
    t = q.shape[0]
    out = cp.full((t, hq * d), POISON, cp.float32)
    out16 = cp.full((t, hq * d), 0x7E00, cp.uint16)  # f16 NaN
    qd, kd, vd, posd, seqd, tabd = (cp.asarray(a) for a in (q.reshape(t, -1), kc, vc, pos, seq, table))
    LA.flash_prefill(k, qd.data.ptr, hq * d, t, kd.data.ptr, vd.data.ptr, posd.data.ptr, seqd.data.ptr,
                     tabd.data.ptr, max_pages, 16, hq, hkv, d, scale, cap, window, out.data.ptr, hq * d,
                     out16.data.ptr, hq * d, kv=kv, config=config, sinks=sinks.data.ptr if sinks is not None else 0)
    return out.get(), out16.get().view(np.float16).astype(np.float32)


SHAPES = [(64, 9, 3, 0.0, 0), (256, 4, 1, 0.0, 7), (128, 8, 2, 30.0, 0), (128, 32, 8, 0.0, 0),
          (128, 32, 4, 0.0, 100), (64, 3, 3, 0.0, 0), (256, 8, 1, 50.0, 512), (128, 16, 8, 0.0, 0)]


@pytest.mark.parametrize("d,hq,hkv,cap,window", SHAPES)
@pytest.mark.parametrize("kv", KL.KV_TYPES)
@pytest.mark.parametrize("past,t,pad", [(0, 200, 56), (333, 150, 42), (0, 17, 0), (1000, 64, 0)])
def test_flash_prefill(k, d, hq, hkv, cap, window, kv, past, t, pad, rng):
    """A chunk of t rows at positions past .. past + t - 1 behind pad padding rows (seq -1)."""
    n_ctx = past + t + 40  # pages past the chunk exist, hold other keys, and must be masked
    K, V, kc, vc, table, max_pages = paged(rng, n_ctx, hkv, d, kv)
    rows = pad + t
    pos = np.concatenate([np.full(pad, past + t), np.arange(past, past + t)]).astype(np.int32)
    seq = np.concatenate([np.full(pad, -1), np.zeros(t)]).astype(np.int32)
    q = rng.standard_normal((rows, hq, d)).astype(np.float32)
    scale = 1 / math.sqrt(d)
    ref = np.zeros((rows, hq, d))
    ref[pad:] = attention_ref(q[pad:], K, V, pos[pad:], scale, cap, window)
    o, o16 = run_flash(k, q, kc, vc, pos, seq, table, max_pages, hq, hkv, d, scale, cap, window, kv)
    err = rel(o.reshape(rows, hq, d), ref)
    assert err < BAR, err
    assert not o[:pad].any(), "padding rows' outputs are zeros"
    assert rel(o16, o) < 1e-3
    # every row on its own against the reference: a mask off by one key fails the short rows
    per_row = [rel(o[i].reshape(hq, d), ref[i]) for i in range(pad, rows)]
    assert max(per_row) < 10 * BAR, max(per_row)


@pytest.mark.parametrize("kv", ["f16", "q8_0"])
@pytest.mark.parametrize("past,t", [(0, 200), (333, 150)])
def test_flash_prefill_sinks(k, kv, past, t, rng):
    """gpt-oss's attention sinks (a logit a head in each row's softmax denominator; its layout: 64-dim
    heads, 8 a KV head, full and 128-key sliding layers)."""
    d, hq, hkv = 64, 16, 2
    K, V, kc, vc, table, max_pages = paged(rng, past + t + 40, hkv, d, kv)
    pos, seq = np.arange(past, past + t, dtype=np.int32), np.zeros(t, np.int32)
    q = rng.standard_normal((t, hq, d)).astype(np.float32)
    sinks = (rng.standard_normal(hq) * 3).astype(np.float32)
    sinks[0] = 12.0  # a sink that dominates: the outputs shrink toward zero
    for window in (0, 128):
        ref = attention_ref(q, K, V, pos, 1 / math.sqrt(d), 0.0, window, sinks)
        o, _ = run_flash(k, q, kc, vc, pos, seq, table, max_pages, hq, hkv, d, 1 / math.sqrt(d), 0.0, window, kv,
                         sinks=cp.asarray(sinks))
        assert rel(o.reshape(t, hq, d), ref) < BAR


SMEM_MAX = 227 * 1024 - 64  # a block's dynamic shared memory on the H100: 227 KiB less the kernel's static ints
SHAPE_CASES = [(d, hq, hkv, config, kv) for d, hq, hkv in [(64, 9, 3), (128, 32, 8), (256, 4, 1)]
               for config in [(1, 32, 2), (2, 64, 2), (4, 32, 3), (1, 64, 3)] for kv in KL.KV_TYPES
               if LA.flash_smem(d, hq // hkv, config, kv) <= SMEM_MAX]


@pytest.mark.parametrize("d,hq,hkv,config,kv", SHAPE_CASES, ids=str)
def test_flash_shapes(k, d, hq, hkv, config, kv, rng):
    """Every block shape (16 WT rows, KT keys, ST stages) that fits computes the same attention."""
    past, t = 77, 190
    K, V, kc, vc, table, max_pages = paged(rng, past + t, hkv, d, kv)
    pos = np.arange(past, past + t).astype(np.int32)
    seq = np.zeros(t, np.int32)
    q = rng.standard_normal((t, hq, d)).astype(np.float32)
    scale = 1 / math.sqrt(d)
    ref = attention_ref(q, K, V, pos, scale, 0.0, 0)
    o, _ = run_flash(k, q, kc, vc, pos, seq, table, max_pages, hq, hkv, d, scale, 0.0, 0, kv, config)
    assert rel(o.reshape(t, hq, d), ref) < BAR


def test_flash_smem_fits():
    """Every default shape fits a block's shared memory."""
    for d in LA.FLASH_HEAD_DIMS:
        for g in range(1, 9):
            for kv in KL.KV_TYPES:
                cfg = LA.flash_config(d, g, kv)
                assert LA.flash_smem(d, g, cfg, kv) <= SMEM_MAX, (d, g, kv, cfg)
