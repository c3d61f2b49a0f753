"""attention_tiles.cu (batch decode steps' attention) against float64 numpy: rows of several
sequences with their own page tables, sliding windows, soft-capping, a padding row, both launch
modes (keys loaded before the wait or after), tile shapes (keys per tile: stages), float32 and
f16 caches (the reference takes the cache's values), outputs poisoned first."""

import math

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from gguf_runtime.backends.numpy.backend import apply_rope  # noqa: E402
from gguf_runtime.quant_kernels import launch_attention as LA  # noqa: E402
from gguf_runtime.quant_kernels import launchers as L  # noqa: E402
from gguf_runtime.backends.cuda.tuning import Tuning  # noqa: E402

from test_gpu_kernels import POISON, attention_ref, rel  # noqa: E402


@pytest.fixture(scope="module")
def k():
    return L.Kernels(Tuning().knobs())  # the launch choices the backend makes


@pytest.mark.parametrize("d,hq,hkv,cap,window", [(64, 9, 3, 0.0, 0), (256, 4, 1, 0.0, 7), (128, 8, 2, 30.0, 0),
                                                 (128, 32, 8, 0.0, 0), (128, 32, 4, 0.0, 100), (64, 3, 3, 0.0, 0)])
@pytest.mark.parametrize("config,kv16", [(None, False), ((16, 4), False), ((8, 3), False), (None, True),
                                         ((8, 3), True)], ids=["default", "16:4", "8:3", "default-f16", "8:3-f16"])
def test_attention_tiles(k, d, hq, hkv, cap, window, config, kv16, rng):
    kv_dtype = np.float16 if kv16 else np.float32
    page, n_ctx, n_seq = 16, 400, 3
    max_pages = n_ctx // page
    n_pages = max_pages * n_seq + 5
    perm = rng.permutation(n_pages).astype(np.int32)
    table = perm[:max_pages * n_seq].reshape(n_seq, max_pages)
    K = rng.standard_normal((n_seq, n_ctx, hkv, d)).astype(kv_dtype).astype(np.float32)
    V = rng.standard_normal((n_seq, n_ctx, hkv, d)).astype(kv_dtype).astype(np.float32)
    kc = rng.standard_normal((n_pages, hkv, page, d)).astype(kv_dtype)  # unowned pages: noise, never read
    vc = rng.standard_normal((n_pages, hkv, page, d)).astype(kv_dtype)
    for s in range(n_seq):
        for p in range(n_ctx):
            kc[table[s, p // page], :, p % page] = K[s, p]
            vc[table[s, p // page], :, p % page] = V[s, p]
    # (sequence, position): tile edges (a tile is 4096 / d keys), the first key, the last one, a pad row
    rows = [(0, 0), (1, 5), (2, 63), (0, 64), (1, 127), (2, 128), (0, 200), (1, 399), (-1, 0), (2, 31), (0, 32)]
    seq = np.array([s for s, _ in rows], np.int32)
    pos = np.array([p for _, p in rows], np.int32)
    t = len(rows)
    q = rng.standard_normal((t, hq, d)).astype(np.float32)
    scale = 1 / math.sqrt(d)
    ref = np.zeros((t, hq, d))
    for i, (s, p) in enumerate(rows):
        if s >= 0:
            ref[i] = attention_ref(q[i:i + 1], K[s], V[s], pos[i:i + 1], scale, cap, window)[0]
    out = cp.full((t, hq * d), POISON, cp.float32)
    out16 = cp.full((t, hq * d), 0x7E00, cp.uint16)  # f16 NaN
    qd, kd, vd, posd, seqd, tabd = (cp.asarray(a) for a in (q.reshape(t, -1), kc, vc, pos, seq, table))
    outs = []
    for early in (False, True):
        out.fill(POISON)
        LA.attention_tiles(k, qd.data.ptr, hq * d, t, kd.data.ptr, vd.data.ptr, posd.data.ptr, seqd.data.ptr,
                           tabd.data.ptr, max_pages, page, hq, hkv, d, scale, cap, window, out.data.ptr, hq * d,
                           out16.data.ptr, hq * d, early=early, config=config, kv="f16" if kv16 else "f32")
        o = out.get()
        outs.append(o)
        assert rel(o.reshape(t, hq, d), ref) < 1e-5
        assert not o[seq < 0].any(), "a padding row's output is zeros"
        o16 = out16.get().view(np.float16).astype(np.float32)
        assert rel(o16, o) < 1e-3
    assert (outs[0] == outs[1]).all()


@pytest.mark.parametrize("d,hq,hkv,n_rot,neox,window", [(128, 32, 8, 128, False, 0), (64, 9, 3, 64, True, 0),
                                                        (128, 8, 2, 64, False, 50), (256, 4, 1, 256, True, 0)])
@pytest.mark.parametrize("kv16", [False, True], ids=["f32", "f16"])
def test_attention_tiles_with_rope(k, d, hq, hkv, n_rot, neox, window, kv16, rng):
    """With n_rot > 0 the kernel takes raw QKV rows (one row per sequence, as a decode step): RoPE on
    q and on the row's own key, that key and value written into the cache (whose slot holds NaN
    before: the kernel must not read it), against rope_kv's numpy reference and float64 attention.
    With an f16 cache the new key and value are rounded as the cache holds them, for this step too."""
    kv_dtype = np.float16 if kv16 else np.float32
    as_cache = lambda a: a.astype(kv_dtype).astype(np.float32)  # noqa: E731
    page, n_ctx = 16, 320
    max_pages = n_ctx // page
    pos = np.array([0, 15, 16, 100, 250, 319, 0], np.int32)
    seq = np.array([0, 1, 2, 3, 4, 5, -1], np.int32)  # the last row: padding
    t = len(pos)
    table = rng.permutation(max_pages * t).astype(np.int32).reshape(t, max_pages)
    K = as_cache(rng.standard_normal((t, n_ctx, hkv, d)))  # earlier keys (already rotated)
    V = as_cache(rng.standard_normal((t, n_ctx, hkv, d)))
    kc = np.zeros((max_pages * t, hkv, page, d), kv_dtype)
    vc = np.zeros_like(kc)
    for s in range(t):
        for p in range(n_ctx):
            kc[table[s, p // page], :, p % page] = K[s, p]
            vc[table[s, p // page], :, p % page] = V[s, p]
    for s, p in zip(seq, pos):
        if s >= 0:
            kc[table[s, p // page], :, p % page] = np.nan
            vc[table[s, p // page], :, p % page] = np.nan
    width = (hq + 2 * hkv) * d
    qkv = rng.standard_normal((t, width)).astype(np.float32)
    inv = 10000.0 ** (-np.arange(0, n_rot, 2) / n_rot)
    style = "neox" if neox else "norm"
    q = apply_rope(qkv[:, :hq * d].reshape(t, hq, d), pos, inv, style)
    kr = apply_rope(qkv[:, hq * d:(hq + hkv) * d].reshape(t, hkv, d), pos, inv, style)
    vr = qkv[:, (hq + hkv) * d:].reshape(t, hkv, d)
    scale = 1 / math.sqrt(d)
    ref = np.zeros((t, hq, d))
    for i, (s, p) in enumerate(zip(seq, pos)):
        if s >= 0:
            K[s, p], V[s, p] = as_cache(kr[i]), as_cache(vr[i])
            ref[i] = attention_ref(q[i:i + 1], K[s], V[s], pos[i:i + 1], scale, 0.0, window)[0]
    out = cp.full((t, hq * d), POISON, cp.float32)
    dev = [cp.asarray(a) for a in (qkv, kc, vc, pos, seq, table, inv)]
    qd, kd, vd, posd, seqd, tabd, invd = dev
    LA.attention_tiles(k, qd.data.ptr, width, t, kd.data.ptr, vd.data.ptr, posd.data.ptr, seqd.data.ptr,
                       tabd.data.ptr, max_pages, page, hq, hkv, d, scale, 0.0, window, out.data.ptr, hq * d,
                       early=True, inv_freq=invd.data.ptr, n_rot=n_rot, neox=neox, kv="f16" if kv16 else "f32")
    assert rel(out.get().reshape(t, hq, d), ref) < (1e-4 if kv16 else 1e-5)
    kcache, vcache = kd.get(), vd.get()
    for i, (s, p) in enumerate(zip(seq, pos)):
        if s >= 0:
            assert rel(kcache[table[s, p // page], :, p % page], kr[i]) < (1e-3 if kv16 else 1e-6)
            assert np.array_equal(vcache[table[s, p // page], :, p % page], vr[i].astype(kv_dtype))
    assert np.isfinite(kcache).all() and np.isfinite(vcache).all()  # every row's own slot written
