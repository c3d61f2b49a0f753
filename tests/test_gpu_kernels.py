"""Every CUDA kernel against the numpy reference, on fresh random inputs, outputs poisoned first.

Run on the GPU machine: pytest -m gpu. Error measure: ||out - ref|| / ||ref|| with the reference
in float64 (f32 kernels land far under 1e-4; f16 outputs under 1e-3).
"""

import math

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from gguf_runtime.backends.numpy.backend import apply_rope, gelu_tanh, silu  # noqa: E402
from gguf_runtime.quant_kernels import kv_layout as KL  # noqa: E402
from gguf_runtime.quant_kernels import launch_attention as LA  # noqa: E402
from gguf_runtime.quant_kernels import reference_kv as RK  # noqa: E402
from gguf_runtime.quant_kernels import launch_mma as LM  # noqa: E402
from gguf_runtime.quant_kernels import launchers as L  # noqa: E402
from gguf_runtime.backends.cuda.tuning import Tuning  # noqa: E402
from gguf_runtime.quant_kernels import launch_layers as LL  # noqa: E402
from gguf_runtime.quant_kernels import launch_sampling as LS  # noqa: E402
from gguf_runtime.quant_kernels.formats import BY_NAME, FORMATS, SUPPORTED  # noqa: E402
from gguf_runtime.quant_kernels.reference import dequantize, random_blocks  # noqa: E402
from gguf_runtime.quant_kernels.repack import repack  # noqa: E402
from gguf_runtime.sampling import Sampler, SamplingParams, apply_repeat_penalty  # noqa: E402

POISON = np.float32(np.nan)


@pytest.fixture(scope="module")
def k():
    return L.Kernels(Tuning().knobs())  # the launch choices the backend makes


def rel(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all(), "non-finite output (unwritten or NaN)"
    return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


def upload(name, rows, cols, rng, keep):
    t = BY_NAME[name]
    raw = random_blocks(t, rows * cols, rng, scale=0.05)
    w = dequantize(raw, t, (rows, cols)).astype(np.float64)
    p = repack(raw, t, rows, cols)
    dev = cp.asarray(p.buffer)
    keep.append(dev)
    b = dev.data.ptr
    o = p.offsets
    return L.Mat(t, rows, cols, b + o["qs"], b + o.get("qh", -b), b + o.get("sc", -b), b + o.get("d", -b)), w


def cols_for(name, mult=3):
    be = FORMATS[BY_NAME[name]].block_elems
    return 256 * mult if be == 256 else (32 * (2 * mult + 1) if be == 32 else 16 * (4 * mult + 1))


@pytest.mark.parametrize("name", SUPPORTED)
@pytest.mark.parametrize("b", [1, 3, 8])
def test_mmv_every_type(k, name, b, rng):
    keep = []
    rows, cols = 70, cols_for(name)
    m, w = upload(name, rows, cols, rng, keep)
    x = rng.standard_normal((b, cols)).astype(np.float32)
    bias = rng.standard_normal(rows).astype(np.float32)
    xd, bd = cp.asarray(x), cp.asarray(bias)
    y = cp.full((b, rows + 5), POISON, cp.float32)
    L.mmv(k, [m], [(y.data.ptr, y.shape[1])], [bd.data.ptr], xd.data.ptr, cols, b, 0)
    ref = x.astype(np.float64) @ w.T + bias
    assert rel(y.get()[:, :rows], ref) < 1e-5
    assert np.isnan(y.get()[:, rows:]).all(), "wrote past the rows"
    # residual mode accumulates into y (with a bias: gpt-oss's O projection)
    y0 = rng.standard_normal((b, rows)).astype(np.float32)
    yd = cp.asarray(y0)
    L.mmv(k, [m], [(yd.data.ptr, rows)], [bd.data.ptr], xd.data.ptr, cols, b, 1)
    assert rel(yd.get(), y0 + x.astype(np.float64) @ w.T + bias) < 1e-5


def test_rmsnorm_f16_copy_and_attention_f16_copy(k, rng):
    """The f16 copies the cuBLAS prefill multiplies: RMSNorm's and attention's, each against the
    float64 reference (f16 rounding: 2^-11 relative at most), beside their f32 outputs (1e-5)."""
    x = (rng.standard_normal((3, 640)) * np.array([[2.0], [0.05], [1e-3]])).astype(np.float32)
    w = rng.standard_normal(640).astype(np.float32)
    xd, wd = cp.asarray(x), cp.asarray(w)
    y = cp.full((3, 640), POISON, cp.float32)
    y16 = cp.full((3, 648), np.nan, cp.float16)
    LL.rmsnorm(k, xd.data.ptr, 640, wd.data.ptr, y.data.ptr, 640, 3, 640, 1e-6, y16=y16.data.ptr, ld16=648)
    ref = rmsnorm_ref(x, w, 1e-6)
    assert rel(y.get(), ref) < 1e-5
    assert rel(y16.get()[:, :640].astype(np.float32), ref) < 1e-3
    assert np.isnan(y16.get()[:, 640:]).all(), "wrote past the columns"
    # attention with an f16 copy of its output (a prefill call's), three rows over a paged cache
    d, hq, hkv, page, n_ctx = 64, 4, 2, 16, 64
    K, V = (rng.standard_normal((n_ctx, hkv, d)).astype(np.float32) for _ in range(2))
    table = rng.permutation(n_ctx // page).astype(np.int32)[None]
    kc, vc = (np.zeros((n_ctx // page, hkv, page, d), np.float32) for _ in range(2))
    for p_ in range(n_ctx):
        kc[table[0, p_ // page], :, p_ % page], vc[table[0, p_ // page], :, p_ % page] = K[p_], V[p_]
    pos = np.array([3, 20, 63], np.int32)
    q = rng.standard_normal((3, hq, d)).astype(np.float32)
    out = cp.full((3, hq * d), POISON, cp.float32)
    out16 = cp.full((3, hq * d + 8), np.nan, cp.float16)
    n_split = 4
    part_o = cp.full(3 * hq * n_split * d, POISON, cp.float32)
    part_ml = cp.full(3 * hq * n_split * 2, POISON, cp.float32)
    counter = cp.zeros(3 * hkv, cp.uint32)
    qd, kd, vd, posd, seqd, tabd = (cp.asarray(a) for a in (q.reshape(3, -1), kc, vc, pos, np.zeros(3, np.int32),
                                                             table))
    LA.attention(k, qd.data.ptr, hq * d, 3, kd.data.ptr, vd.data.ptr, posd.data.ptr, seqd.data.ptr, tabd.data.ptr,
                 n_ctx // page, page, hq, hkv, d, 1 / math.sqrt(d), 0.0, 0, n_split, part_o.data.ptr,
                 part_ml.data.ptr, counter.data.ptr, out.data.ptr, hq * d, out16.data.ptr, hq * d + 8)
    aref = attention_ref(q, K, V, pos, 1 / math.sqrt(d), 0.0, 0).reshape(3, -1)
    assert rel(out.get(), aref) < 1e-5
    assert rel(out16.get()[:, :hq * d].astype(np.float32), aref) < 1e-3
    assert np.isnan(out16.get()[:, hq * d:]).all(), "wrote past the columns"


def test_mmv_group_mixed_types_odd_rows(k, rng):
    keep = []
    cols = 512
    specs = [("Q5_0", 96), ("Q4_K", 33), ("Q8_0", 17)]  # odd rows: one row per block
    mats = [upload(n, r, cols, rng, keep) for n, r in specs]
    x = rng.standard_normal((2, cols)).astype(np.float32)
    xd = cp.asarray(x)
    ys = [cp.full((2, r), POISON, cp.float32) for _, r in specs]
    L.mmv(k, [m for m, _ in mats], [(y.data.ptr, y.shape[1]) for y in ys], [None] * 3, xd.data.ptr, cols, 2, 0)
    for (m, w), y in zip(mats, ys):
        assert rel(y.get(), x.astype(np.float64) @ w.T) < 1e-5


@pytest.mark.parametrize("name,act", [("Q4_1", "silu"), ("Q5_0", "gelu_tanh"), ("Q4_K", "silu"), ("Q6_K", "gelu_tanh")])
@pytest.mark.parametrize("b", [1, 4])
def test_mmv_glu(k, name, act, b, rng):
    keep = []
    rows, cols = 90, cols_for(name, 2)
    (g, wg), (u, wu) = upload(name, rows, cols, rng, keep), upload(name, rows, cols, rng, keep)
    x = rng.standard_normal((b, cols)).astype(np.float32) * 4
    y = cp.full((b, rows), POISON, cp.float32)
    xd = cp.asarray(x)  # keep a reference: a freed temporary's memory can be reused before launch
    L.mmv_glu(k, g, u, xd.data.ptr, cols, b, act, y.data.ptr, rows)
    gv, uv = x.astype(np.float64) @ wg.T, x.astype(np.float64) @ wu.T
    ref = (gelu_tanh(gv) if act == "gelu_tanh" else silu(gv)) * uv
    assert rel(y.get(), ref) < 1e-5


def rmsnorm_ref(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_0", "F32"])
@pytest.mark.parametrize("b", [1, 3, 8])
@pytest.mark.parametrize("config", [None, (1, 4), (2, 2)])
def test_mmv_fused_rmsnorm(k, name, b, config, rng):
    """W rmsnorm(x) with the norm inside the matvec, one warp or several per row group; the glu
    kernel too (gate and up share the scale)."""
    keep = []
    rows, cols = 64, cols_for(name)
    m, w = upload(name, rows, cols, rng, keep)
    x = (rng.standard_normal((b, cols)) * rng.uniform(0.1, 20, (b, 1))).astype(np.float32)  # rows of unequal scale
    nw = (1 + rng.standard_normal(cols) * 0.3).astype(np.float32)
    xd, nd = cp.asarray(x), cp.asarray(nw)
    y = cp.full((b, rows), POISON, cp.float32)
    L.mmv(k, [m], [(y.data.ptr, rows)], [None], xd.data.ptr, cols, b, 0, config=config, norm=(nd.data.ptr, 1e-5))
    h = rmsnorm_ref(x, nw, 1e-5)
    assert rel(y.get(), h @ w.T) < 1e-5
    assert rel(xd.get(), x) == 0  # x itself is left alone
    if config is None and name != "F32":
        u, wu = upload(name, rows, cols, rng, keep)
        y.fill(POISON)
        L.mmv_glu(k, m, u, xd.data.ptr, cols, b, "silu", y.data.ptr, rows, norm=(nd.data.ptr, 1e-5))
        assert rel(y.get(), silu(h @ w.T) * (h @ wu.T)) < 1e-5


@pytest.mark.parametrize("name", SUPPORTED)
def test_embed_and_dequant_f16(k, name, rng):
    keep = []
    rows, cols = 50, cols_for(name, 2)
    m, w = upload(name, rows, cols, rng, keep)
    toks = rng.integers(0, rows, 7).astype(np.int32)
    x = cp.full((7, cols), POISON, cp.float32)
    td = cp.asarray(toks)
    LL.embed(k, m, td.data.ptr, 7, x.data.ptr, cols, 1.5)
    assert rel(x.get(), 1.5 * w[toks]) < 1e-6
    out = cp.full(rows * cols, POISON, cp.float16)
    LL.dequant_f16(k, m, out.data.ptr)
    assert rel(out.get().reshape(rows, cols), w) < 1e-3


@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_rmsnorm_with_residual(k, eps, rng):
    """Rows from 3 down to 3e-4 RMS: where mean(x^2) nears eps, where eps goes (inside the sqrt)
    moves the output by percents, so a kernel with eps elsewhere fails here."""
    scale = np.array([[3.0], [1.0], [0.03], [1e-3], [3e-4]])
    x = (rng.standard_normal((5, 576)) * scale).astype(np.float32)
    w = rng.standard_normal(576).astype(np.float32)
    res = rng.standard_normal((5, 576)).astype(np.float32)
    xd, wd, rd = cp.asarray(x), cp.asarray(w), cp.asarray(res)
    y = cp.full((5, 576), POISON, cp.float32)
    LL.rmsnorm(k, xd.data.ptr, 576, wd.data.ptr, y.data.ptr, 576, 5, 576, eps)
    ref = rmsnorm_ref(x, w, eps)
    for r in range(5):  # row by row: the small rows must not hide under the big ones
        assert rel(y.get()[r], ref[r]) < 1e-5, r
    LL.rmsnorm(k, xd.data.ptr, 576, wd.data.ptr, rd.data.ptr, 576, 5, 576, eps, rd.data.ptr, 576)
    for r in range(5):
        assert rel(rd.get()[r], res[r] + ref[r]) < 1e-5, r


@pytest.mark.parametrize("t", [1, 3, 4, 8])
@pytest.mark.parametrize("d,n_rot,hq,hkv,name", [(64, 64, 9, 3, "Q4_1"), (128, 64, 8, 2, "Q4_K")])
def test_qkv_matvec_with_fused_rope_kv(k, t, d, n_rot, hq, hkv, name, rng):
    """mmv with rope= (RoPE and the KV write in the epilogue where row groups are rope pairs, a
    rope_kv launch for the other token chunks) equals mmv followed by rope_kv: Q in place, K and V
    in the paged cache; a padding row (seq < 0) writes nothing; with a bias and the fused norm."""
    keep = []
    cols, page, max_pages = cols_for(name, 2), 16, 4
    mats = [upload(name, n * d, cols, rng, keep) for n in (hq, hkv, hkv)]
    x = rng.standard_normal((t, cols)).astype(np.float32)
    nw = (1 + 0.2 * rng.standard_normal(cols)).astype(np.float32)
    bias = [rng.standard_normal(n * d).astype(np.float32) for n in (hq, hkv, hkv)]
    pos = np.array([0, 17, 40, 5, 33, 2, 63, 16][:t], np.int32)
    seq = np.zeros(t, np.int32)
    if t > 1:
        seq[1] = -1  # padding
    inv = 10000.0 ** (-np.arange(0, n_rot, 2) / n_rot)
    table = np.array([[3, 0, 2, 1]], np.int32)
    dev = {n: cp.asarray(a) for n, a in dict(x=x, nw=nw, pos=pos, seq=seq, inv=inv, table=table).items()}
    bd = [cp.asarray(b) for b in bias]
    width = (hq + 2 * hkv) * d
    outs = []
    for fused in (False, True):
        qkv = cp.full((t, width), POISON, cp.float32)
        kc = cp.full((4, hkv, page, d), POISON, cp.float32)
        vc = cp.full((4, hkv, page, d), POISON, cp.float32)
        rope = L.RopeKV(qkv.data.ptr, width, hq, hkv, d, d, n_rot, False, None, None, 1e-6, dev["inv"].data.ptr,
                        dev["pos"].data.ptr, dev["seq"].data.ptr, dev["table"].data.ptr, max_pages, page,
                        kc.data.ptr, vc.data.ptr)
        assert rope.fusable
        L.mmv(k, [m for m, _ in mats], [(qkv.data.ptr + 4 * c, width) for c in (0, hq * d, (hq + hkv) * d)],
              [b.data.ptr for b in bd], dev["x"].data.ptr, cols, t, 0, norm=(dev["nw"].data.ptr, 1e-5),
              rope=rope if fused else None)
        if not fused:
            rope.launch(k, 0, t)
        cp.cuda.runtime.deviceSynchronize()
        outs.append((qkv.get()[:, :hq * d], kc.get(), vc.get()))
    (q0, k0, v0), (q1, k1, v1) = outs
    live = seq >= 0
    assert rel(q1[live], q0[live]) < 1e-6
    np.testing.assert_array_equal(np.isnan(k1), np.isnan(k0))  # the same cache slots written
    assert rel(np.nan_to_num(k1), np.nan_to_num(k0)) < 1e-6
    assert rel(np.nan_to_num(v1), np.nan_to_num(v0)) < 1e-6
    assert np.isfinite(k1).sum() == live.sum() * hkv * d  # the padding row wrote nothing


def rms(v, w, eps):
    return v / np.sqrt((v.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps) * w


@pytest.mark.parametrize("neox,qk_norm,d,n_rot,hq,hkv", [(False, False, 64, 64, 9, 3), (True, True, 256, 256, 4, 1),
                                                         (True, False, 128, 64, 8, 2)])
@pytest.mark.parametrize("kv", KL.KV_TYPES)
def test_rope_kv(k, neox, qk_norm, d, n_rot, hq, hkv, kv, rng):
    """Q rotated in place; K rotated and V copied into the cache slot of each position, as the
    cache's type holds them: f16 rounded, q8_0 / q4_0 blocks as reference_kv.py quantizes (V bit
    for bit; K, computed apart, within one step of the reference's rounding); untouched slots
    keep their poison (all-ones bytes: NaN in every type's scales or values)."""
    t, page, max_pages = 6, 16, 4
    width = (hq + 2 * hkv) * d
    qkv = rng.standard_normal((t, width)).astype(np.float32)
    qkv[:, (hq + hkv) * d:][1, :32] *= 1000  # an outlier block among the values
    pos = np.array([0, 1, 15, 16, 17, 40], np.int32)  # crosses page boundaries
    inv = 10000.0 ** (-np.arange(0, n_rot, 2) / n_rot)
    qn = rng.standard_normal(d).astype(np.float32) if qk_norm else None
    kn = rng.standard_normal(d).astype(np.float32) if qk_norm else None
    table = np.array([[3, 0, 2, 1]], np.int32)  # pages out of order
    kc = cp.full((4, hkv, KL.block_bytes(kv, page, d)), 0xFF, cp.uint8)
    vc = cp.full((4, hkv, KL.block_bytes(kv, page, d)), 0xFF, cp.uint8)
    dq = cp.asarray(qkv)
    keep = [cp.asarray(a) if a is not None else None for a in (qn, kn)]
    invd, posd, seqd, tabd = cp.asarray(inv), cp.asarray(pos), cp.zeros(t, cp.int32), cp.asarray(table)
    LL.rope_kv(k, dq.data.ptr, width, t, hq, hkv, d, d, n_rot, neox, keep[0].data.ptr if qk_norm else None,
               keep[1].data.ptr if qk_norm else None, 1e-6, invd.data.ptr, posd.data.ptr,
               seqd.data.ptr, tabd.data.ptr, max_pages, page, kc.data.ptr, vc.data.ptr, kv)
    q = qkv[:, :hq * d].reshape(t, hq, d)
    kk = qkv[:, hq * d:(hq + hkv) * d].reshape(t, hkv, d)
    vv = qkv[:, (hq + hkv) * d:].reshape(t, hkv, d)
    if qk_norm:
        q, kk = rms(q, qn, 1e-6).astype(np.float32), rms(kk, kn, 1e-6).astype(np.float32)
    style = "neox" if neox else "norm"
    qr, kr = apply_rope(q, pos, inv, style), apply_rope(kk, pos, inv, style).astype(np.float32)
    assert rel(dq.get()[:, :hq * d].reshape(t, hq, d), qr) < 1e-5
    kcache, vcache = KL.unpack(kc.get(), kv, page, d), KL.unpack(vc.get(), kv, page, d)
    written = np.zeros(kcache.shape[:3], bool)
    for i, p in enumerate(pos):
        pg, sl = table[0, p // page], p % page
        written[pg, :, sl] = True
        assert np.array_equal(vcache[pg, :, sl], RK.roundtrip(vv[i], kv))
        want = RK.roundtrip(kr[i], kv)
        if kv in KL.QUANT:  # a key within one quantization step of the reference's, nearly all equal
            step = np.abs(kr[i]).reshape(hkv, -1, 32).max(-1, keepdims=True) / (127 if kv == "q8_0" else 8)
            diff = np.abs(kcache[pg, :, sl] - want).reshape(hkv, -1, 32)
            assert (diff <= step * 1.01).all() and (diff == 0).mean() > 0.95
        else:
            assert rel(kcache[pg, :, sl], kr[i]) < (1e-3 if kv == "f16" else 1e-5)  # f16: 2^-11 relative
    assert np.isnan(kcache[~written]).all() and np.isnan(vcache[~written]).all()


def attention_ref(q, K, V, pos, scale, cap, window, sinks=None):
    """float64 attention of rows q at positions pos; sinks (one logit a head, gpt-oss) join each
    head's softmax denominator."""
    out = np.zeros((q.shape[0], q.shape[1], V.shape[-1]))
    g = q.shape[1] // K.shape[1]
    for t, p in enumerate(pos):
        lo = max(0, p - window + 1) if window else 0
        for h in range(q.shape[1]):
            s = K[lo:p + 1, h // g] @ q[t, h].astype(np.float64) * scale
            if cap:
                s = cap * np.tanh(s / cap)
            m = s.max() if sinks is None else max(s.max(), float(sinks[h]))
            e = np.exp(s - m)
            out[t, h] = e @ V[lo:p + 1, h // g] / (e.sum() + (0.0 if sinks is None else np.exp(sinks[h] - m)))
    return out


ATTN_SHAPES = [(64, 9, 3, 0.0, 0), (256, 4, 1, 0.0, 7), (128, 8, 2, 30.0, 0), (128, 32, 4, 0.0, 0)]


@pytest.mark.parametrize("d,hq,hkv,cap,window", ATTN_SHAPES)
@pytest.mark.parametrize("n_split", [1, 4, 32])
@pytest.mark.parametrize("warps,rounds", [(4, 1), (0, 2), (0, 1)])
def test_attention(k, d, hq, hkv, cap, window, n_split, warps, rounds, rng, kv16=False, sinks=None):
    """Against float64 numpy for every row (one split to 32, each block shape: the old 4-warp one
    and the default), and bit for bit the same with the decode flag (keys loaded before the wait)."""
    page, n_ctx = 16, 640  # up to 640 keys: rows using 1 split and up to 32
    max_pages = n_ctx // page
    kv_dtype = np.float16 if kv16 else np.float32  # the reference takes the cache's values
    K = rng.standard_normal((n_ctx, hkv, d)).astype(kv_dtype).astype(np.float32)
    V = rng.standard_normal((n_ctx, hkv, d)).astype(kv_dtype).astype(np.float32)
    table = rng.permutation(max_pages).astype(np.int32)[None]
    kc = np.zeros((max_pages, hkv, page, d), kv_dtype)
    vc = np.zeros_like(kc)
    for p in range(n_ctx):
        kc[table[0, p // page], :, p % page] = K[p]
        vc[table[0, p // page], :, p % page] = V[p]
    pos = np.array([0, 5, 16, 33, 79, 300, 639], np.int32)
    t = pos.shape[0]
    q = rng.standard_normal((t, hq, d)).astype(np.float32)
    scale = 1 / math.sqrt(d)
    shape = LA.attn_shape(d, hq // hkv, warps, rounds)
    out = cp.full((t, hq * d), POISON, cp.float32)
    part_o = cp.full(t * hq * n_split * d, POISON, cp.float32)
    part_ml = cp.full(t * hq * n_split * 2, POISON, cp.float32)
    counter = cp.zeros(t * hkv, cp.uint32)
    dev = [cp.asarray(a) for a in (q.reshape(t, -1), kc, vc, pos, np.zeros(t, np.int32), table)]
    qd, kd, vd, posd, seqd, tabd = dev
    ref = attention_ref(q, K, V, pos, scale, cap, window, sinks)
    sinks_d = cp.asarray(sinks) if sinks is not None else None
    outs = []
    for early in (False, True):  # twice: the counters must be back at zero for the next launch
        out.fill(POISON)
        LA.attention(k, qd.data.ptr, hq * d, t, kd.data.ptr, vd.data.ptr, posd.data.ptr, seqd.data.ptr,
                     tabd.data.ptr, max_pages, page, hq, hkv, d, scale, cap, window, n_split, part_o.data.ptr,
                     part_ml.data.ptr, counter.data.ptr, out.data.ptr, hq * d, shape=shape, early=early,
                     kv="f16" if kv16 else "f32", sinks=sinks_d.data.ptr if sinks_d is not None else 0)
        outs.append(out.get())
        assert rel(outs[-1].reshape(t, hq, d), ref) < 1e-5
        assert not counter.get().any()
    assert (outs[0] == outs[1]).all()


@pytest.mark.parametrize("d,hq,hkv,cap,window", ATTN_SHAPES)
@pytest.mark.parametrize("n_split", [1, 32])
def test_attention_f16_cache(k, d, hq, hkv, cap, window, n_split, rng):
    """The same with f16 keys and values (the default block shape): f32 arithmetic on the cache's
    values, so the float64 reference of those values holds to the same 1e-5."""
    test_attention(k, d, hq, hkv, cap, window, n_split, 0, 2, rng, kv16=True)


@pytest.mark.parametrize("n_split", [1, 4, 32])
def test_attention_sinks(k, n_split, rng):
    """gpt-oss's attention sinks (a logit a head in the softmax's denominator) in the row's only
    block and in the merge of its splits; sinks around the scores' scale and above them."""
    hq = 8
    sinks = (rng.standard_normal(hq) * 3).astype(np.float32)
    sinks[0] = 12.0  # a sink that dominates: the outputs shrink toward zero
    test_attention(k, 64, hq, 2, 0.0, 0, n_split, 0, 2, rng, kv16=True, sinks=sinks)


def sampler_state(n_vocab, rows=1, top_k=40, top_p=1.0, min_p=0.0, temp=0.0, seed=0, penalty=1.0, last_n=64):
    z = lambda n, t=cp.int32: cp.zeros(n, t)  # noqa: E731
    full = lambda v, t: cp.full(rows, v, t)  # noqa: E731
    keep = dict(tokens=z(rows), pos=z(rows), hist=z(64 * rows), hist_n=z(rows), step=z(rows),
                pval=z(LS.ARGMAX_BLOCKS * rows, cp.float32), pidx=z(LS.ARGMAX_BLOCKS * rows),
                counter=z(rows, cp.uint32), cand_v=z(rows * LS.topk_blocks(n_vocab) * LS.TOPK_MAX, cp.float32),
                cand_i=z(rows * LS.topk_blocks(n_vocab) * LS.TOPK_MAX), cand_n=z(rows * LS.topk_blocks(n_vocab)),
                top_k=full(top_k, cp.int32), top_p=full(top_p, cp.float32),
                min_p=full(min_p, cp.float32), temp=full(temp, cp.float32), seed=full(seed, cp.uint64),
                penalty=full(penalty, cp.float32), last_n=full(last_n, cp.int32), seq=cp.arange(rows, dtype=cp.int32),
                lp_k=z(rows), lp_win=z(rows * 64 * 2))
    ring_mem = cp.cuda.alloc_pinned_memory(16 * rows * 4)
    ring = np.frombuffer(ring_mem, np.int32, 16 * rows)
    lp_mem = cp.cuda.alloc_pinned_memory(16 * rows * LS.LP_COLS * 4)
    st = LS.SamplerState(ring=ring_mem.ptr, ring_len=16, n_seq=rows, lp_ring=lp_mem.ptr,
                        **{name: a.data.ptr for name, a in keep.items()})
    # (the pinned memory, kept alive by the caller; the logprobs ring's view, [16, rows, LP_COLS])
    lp_ring = np.frombuffer(lp_mem, np.float32, 16 * rows * LS.LP_COLS).reshape(16, rows, LS.LP_COLS)
    return st, keep, ring, (ring_mem, lp_mem, lp_ring)


def test_argmax_sample_commits_state(k, rng):
    n = 262144
    st, keep, ring, _mem = sampler_state(n, rows=2)
    for step in range(3):
        logits = rng.standard_normal((2, n)).astype(np.float32)
        ld = cp.asarray(logits)
        LS.argmax_sample(k, ld.data.ptr, n, n, st, 2)
        cp.cuda.runtime.deviceSynchronize()
        want = logits.argmax(-1)
        assert keep["tokens"].get().tolist() == want.tolist()
        assert ring[step * 2:step * 2 + 2].tolist() == want.tolist()
        assert keep["pos"].get().tolist() == [step + 1] * 2
        assert keep["counter"].get().tolist() == [0, 0]


def test_repeat_penalty_matches_numpy(k, rng):
    n = 5000
    st, keep, _ring, _mem = sampler_state(n, penalty=1.3, last_n=32)
    hist = rng.integers(0, 100, 40).astype(np.int32)  # with repeats
    h = np.zeros(64, np.int32)
    h[:40] = hist
    keep["hist"].set(h)
    keep["hist_n"].set(np.array([40], np.int32))
    logits = rng.standard_normal(n).astype(np.float32)
    d = cp.asarray(logits)
    LS.repeat_penalty(k, d.data.ptr, n, n, st, 1)
    ref = apply_repeat_penalty(logits, hist.tolist(), 1.3, 32)
    np.testing.assert_array_equal(d.get(), ref)


def test_rows_argmax(k, rng):
    """Each row's argmax with ties to the lowest id (a tie of three planted), a row of -inf: 0."""
    n, rows = 50000, 6
    x = rng.standard_normal((rows, n)).astype(np.float32)
    x[2, [7, 300, 49999]] = 9.0
    x[5] = -np.inf
    d, out = cp.asarray(x), cp.full(rows, -5, cp.int32)
    LS.rows_argmax(k, d.data.ptr, n, n, rows, out.data.ptr)
    want = x.argmax(-1)
    want[5] = 0
    assert out.get().tolist() == want.tolist() and want[2] == 7


@pytest.mark.parametrize("n", [32000, 1000, 128256])
def test_logprobs_around_the_sampler(k, n, rng):
    """logprobs.cu beside the sampler, as a batch step runs them (row_logprobs, repeat_penalty,
    topk_sample, chosen_logprob), six steps: each reporting row's ring entry equals
    sampling.token_logprobs of its raw logits and the token the sampler committed, with the k asked
    for (20, 5, 0); a penalised row reports a penalised token's raw logit (its history's ids lead
    the logits, so it draws them often: counted); a row that asked for none and a padding slot are
    left alone; a tie of four at the top keeps ids ascending."""
    from gguf_runtime.sampling import token_logprobs
    rows, steps = 5, 6
    st, keep, ring, mem = sampler_state(n, rows=rows, top_k=8, temp=1.0, seed=7, penalty=1.5, last_n=64)
    keep["penalty"].set(np.array([1.5, 1.0, 1.5, 1.5, 1.5], np.float32))
    keep["lp_k"].set(np.array([21, 6, 1, 0, 21], np.int32))  # k + 1; row 3 reports none
    keep["seq"].set(np.array([0, 1, 2, 3, -1], np.int32))  # row 4: a padding slot
    keep["hist"].set(rng.integers(0, 6, rows * 64).astype(np.int32))
    keep["hist_n"].set(np.array([40, 3, 64, 10, 5], np.int32))
    lp = mem[2]
    lp[:] = -7.0  # poison: rows left alone keep it
    penalised = 0
    for step in range(steps):
        logits = (rng.standard_normal((rows, n)) * 2).astype(np.float32)
        logits[:, :6] += 14.0  # the history's ids lead, penalised or not
        logits[0, 100:104] = logits[0, :6].max() + 1.0  # a tie of four at the top
        raw = logits.copy()
        hist, hist_n = keep["hist"].get().reshape(rows, 64).copy(), keep["hist_n"].get().copy()
        d = cp.asarray(logits)
        LS.row_logprobs(k, d.data.ptr, n, n, st, rows)
        LS.repeat_penalty(k, d.data.ptr, n, n, st, rows)
        LS.topk_sample(k, d.data.ptr, n, n, st, rows)
        LS.chosen_logprob(k, d.data.ptr, n, st, rows)
        cp.cuda.runtime.deviceSynchronize()
        toks = keep["tokens"].get()
        for r, kk in ((0, 20), (1, 5), (2, 0)):
            tok = int(toks[r])
            got, want = LS.lp_entry(lp[step, r], tok), token_logprobs(raw[r], tok, kk)
            assert got[0] == want[0] and abs(got[1] - want[1]) < 2e-5 * max(1.0, abs(want[1])), (step, r, got, want)
            assert [i for i, _ in got[2]] == [i for i, _ in want[2]], (step, r)
            np.testing.assert_allclose([v for _, v in got[2]], [v for _, v in want[2]], rtol=2e-5, atol=2e-5)
            window = [hist[r][(hist_n[r] - 1 - j) % 64] for j in range(min(hist_n[r], 64))]
            penalised += r != 1 and tok in window
        assert (lp[:, 3] == -7.0).all() and (lp[:, 4] == -7.0).all()
        assert [i for i, _ in LS.lp_entry(lp[step, 0], 0)[2][:4]] == [100, 101, 102, 103]
    assert penalised >= 2  # the raw logit of a penalised choice was checked


@pytest.mark.parametrize("top_k,top_p,min_p,temp", [(40, 0.95, 0.05, 0.8), (5, 1.0, 0.0, 1.5), (1000, 0.9, 0.0, 1.0)])
def test_topk_sample_distribution(k, top_k, top_p, min_p, temp, rng):
    """Every draw lies in the numpy sampler's candidate set, with matching frequencies."""
    n = 32000
    logits = (rng.standard_normal(n) * 3).astype(np.float32)
    params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=1)
    ids, probs = Sampler(params).distribution(logits)
    st, keep, ring, _mem = sampler_state(n, top_k=top_k, top_p=top_p, min_p=min_p, temp=temp, seed=12345)
    d = cp.asarray(logits)
    draws = []
    for i in range(1500):
        LS.topk_sample(k, d.data.ptr, n, n, st, 1)
        if i % 16 == 15:
            cp.cuda.runtime.deviceSynchronize()
            draws += ring.tolist()
    cp.cuda.runtime.deviceSynchronize()
    draws = draws[:1488]
    assert set(draws) <= set(ids.tolist())
    counts = np.array([draws.count(int(i)) for i in ids[:10]])
    expect = probs[:10] * len(draws)
    assert np.all(np.abs(counts - expect) <= 5 * np.sqrt(expect) + 5)
    # same seed and step: same token; the greedy setting of the same kernel takes the argmax
    for _ in range(2):
        keep["step"].fill(0)
        keep["seed"].fill(777)
        LS.topk_sample(k, d.data.ptr, n, n, st, 1)
        cp.cuda.runtime.deviceSynchronize()
        draws.append(int(ring[0]))
    assert draws[-1] == draws[-2]
    keep["temp"].fill(0.0)
    LS.topk_sample(k, d.data.ptr, n, n, st, 1)
    cp.cuda.runtime.deviceSynchronize()
    assert int(keep["tokens"].get()[0]) == int(np.argmax(logits))


def test_topk_sample_rows_vocab_and_ties(k, rng):
    """Several rows with their own settings over a 262,144-token vocabulary (32 blocks a row):
    greedy rows and top_k=1 take the argmax, a sampled row draws from numpy's candidate set; with
    every logit equal the top-k keeps the lowest ids (ties inside one block and across blocks)."""
    n, rows = 262144, 4
    st, keep, ring, _mem = sampler_state(n, rows=rows, top_k=40, top_p=0.95, min_p=0.05, temp=0.8, seed=5)
    keep["temp"].set(np.array([0.0, 0.8, 0.7, 1.0], np.float32))  # row 0 greedy
    keep["top_k"].set(np.array([40, 1, 40, 7], np.int32))          # row 1: top-1
    logits = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
    logits[3] = 1.0                                                 # row 3: all tied
    d = cp.asarray(logits)
    ids2, probs2 = Sampler(SamplingParams(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05)).distribution(logits[2])
    seen2, seen3 = set(), set()
    for step in range(64):
        LS.topk_sample(k, d.data.ptr, n, n, st, rows)
        cp.cuda.runtime.deviceSynchronize()
        got = ring[(step % 16) * rows:(step % 16 + 1) * rows].tolist()
        assert got[0] == int(np.argmax(logits[0]))
        assert got[1] == int(np.argmax(logits[1]))
        seen2.add(got[2])
        seen3.add(got[3])
        assert not keep["counter"].get().any()
    assert seen2 <= set(ids2.tolist())
    if probs2.shape[0] > 1 and probs2[1] > 0.1:  # a second candidate that 64 draws should reach
        assert len(seen2) > 1
    assert seen3 <= set(range(7)) and len(seen3) >= 5
    assert keep["pos"].get().tolist() == [64] * rows


def test_finite_rows_flags_each_bad_row(k, rng):
    """finite_rows over 6 rows of a strided buffer: a NaN first, an inf last, a -inf in the middle
    of a row, two clean rows and a clean row whose padding past n_vocab is NaN; flags start poisoned."""
    n, ld = 5003, 5120
    x = rng.standard_normal((6, ld)).astype(np.float32) * 50
    x[0, 0], x[1, n - 1], x[3, 2500] = np.nan, np.inf, -np.inf
    x[5, n:] = np.nan  # past the vocabulary: not read
    bad = cp.full(6, 7, cp.int32)
    d = cp.asarray(x)
    LS.finite_rows(k, d.data.ptr, ld, n, 6, bad.data.ptr)
    assert bad.get().tolist() == [1, 1, 0, 1, 0, 0]


def test_prime_slots_writes_each_slot_and_nothing_else(k, rng):
    """prime_slots (a sequence's start) against the values prime_table was given: slots 5, 0, 2 of
    8 with their histories (one past HIST: its tail kept), positions, parameters and 64-bit seeds;
    the other slots keep their poison, step and counter restart at 0, seq turns to the slot."""
    n, poison = 8, 77
    st, keep, _ring, _mem = sampler_state(1000, rows=n)
    for name, a in keep.items():
        if name not in ("pval", "pidx", "cand_v", "cand_i", "cand_n"):
            a.fill(poison)
    seqs = [(5, rng.integers(0, 1000, 70).tolist(), 31, 40, 64, 0.95, 0.05, 0.8, 1.1, (1 << 63) + 12345),
            (0, [7], 0, 1024, 0, 1.0, 0.0, 0.0, 1.0, 3),
            (2, rng.integers(0, 1000, 9).tolist(), 4096, 5, 32, 0.5, 0.2, 1.7, 1.3, 0xDEADBEEFCAFEF00D)]
    table = cp.asarray(LS.prime_table(seqs))
    LS.prime_slots(k, table.data.ptr, len(seqs), st)
    cp.cuda.runtime.deviceSynchronize()
    got = {name: a.get() for name, a in keep.items()}
    for slot, hist, pos, top_k, last_n, top_p, min_p, temp, pen, seed in seqs:
        tail = hist[-64:]
        assert got["hist"][slot * 64:slot * 64 + len(tail)].tolist() == tail
        assert (got["hist"][slot * 64 + len(tail):(slot + 1) * 64] == 0).all()
        ints = ("hist_n", "pos", "top_k", "last_n", "step", "counter", "seq")
        assert [int(got[x][slot]) for x in ints] == [len(tail), pos, top_k, last_n, 0, 0, slot]
        assert [float(got[x][slot]) for x in ("top_p", "min_p", "temp", "penalty")] == \
            [float(np.float32(v)) for v in (top_p, min_p, temp, pen)]
        assert int(got["seed"][slot]) == seed
    for slot in set(range(n)) - {s[0] for s in seqs}:
        assert (got["hist"][slot * 64:(slot + 1) * 64] == poison).all()
        for x in ("hist_n", "pos", "top_k", "step", "seq", "top_p", "temp"):
            assert got[x][slot] == got[x].dtype.type(poison), x


@pytest.mark.parametrize("greedy", [True, False])
def test_slot_map_sends_each_row_to_its_slot(k, greedy, rng):
    """A packed forward's first tokens: logits row r is sampled into slot slots[r] (rows 0..3 ->
    slots 6, -1 (skipped), 1, 4), with its penalty; the same as sampling each row alone into its slot."""
    n, rows, slots = 5000, 4, [6, -1, 1, 4]
    logits = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
    runs = []
    for mapped in (True, False):
        st, keep, ring, _mem = sampler_state(n, rows=8, temp=0.0 if greedy else 0.9, seed=99, penalty=1.3, last_n=16)
        keep["hist"].set(np.tile(rng.integers(0, 50, 64).astype(np.int32), 8) if not runs else runs[0][2])
        hist = keep["hist"].get()
        keep["hist_n"].fill(20)
        d = cp.asarray(logits)
        if mapped:
            sm = cp.asarray(np.array(slots, np.int32))
            LS.repeat_penalty(k, d.data.ptr, n, n, st, rows, slots=sm.data.ptr)
            (LS.argmax_sample if greedy else LS.topk_sample)(k, d.data.ptr, n, n, st, rows, slots=sm.data.ptr)
        else:
            for r, s in enumerate(slots):
                if s >= 0:
                    LS.repeat_penalty(k, d[r:].data.ptr, n, n, st, 1, slot0=s)
                    (LS.argmax_sample if greedy else LS.topk_sample)(k, d[r:].data.ptr, n, n, st, 1, slot0=s)
        cp.cuda.runtime.deviceSynchronize()
        runs.append((keep["tokens"].get(), keep["step"].get(), hist, d.get()))
    (tok_m, step_m, _, d_m), (tok_a, step_a, _, d_a) = runs
    assert step_m.tolist() == [0, 1, 0, 0, 1, 0, 1, 0] == step_a.tolist()
    assert tok_m.tolist() == tok_a.tolist()
    np.testing.assert_array_equal(d_m, d_a)  # penalized rows alike; the skipped row untouched
    np.testing.assert_array_equal(d_m[1], logits[1])
    if greedy:
        assert tok_m[6] == int(np.argmax(d_m[0]))


def test_topk_sample_top1_ties_and_edges(k, rng):
    """The top-1 path (greedy rows and top_k = 1: a max reduction, not the radix select): ties go
    to the lowest id inside a thread, across threads and across blocks; an odd vocabulary's last
    id; -inf everywhere but one id; the candidates written are the block maxima."""
    n, rows = 262145, 5  # 33 blocks of 7,944 logits (the last 7,937)
    per = -(-n // LS.topk_blocks(n))
    st, keep, ring, _mem = sampler_state(n, rows=rows, top_k=1, temp=0.0)
    keep["temp"].set(np.array([0.0, 0.8, 0.0, 0.5, 0.0], np.float32))  # rows 1, 3: sampled, top_k 1
    logits = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
    logits[0] = 2.5                                                   # all tied: id 0
    logits[1, [150000, 70000 + 1024, 70000, 9000 + 7]] = 50.0        # across blocks and threads: 9007
    logits[2] = -np.inf
    logits[2, 123456] = -3.0
    logits[3, n - 1] = 40.0                                           # the last id
    logits[4, [per, per - 1]] = 60.0                                  # the first of block 1, last of 0
    want = [0, 9007, 123456, n - 1, per - 1]
    for step in range(3):
        keep["cand_v"].fill(POISON)
        LS.topk_sample(k, cp.asarray(logits).data.ptr, n, n, st, rows)
        cp.cuda.runtime.deviceSynchronize()
        assert ring[step * rows:(step + 1) * rows].tolist() == want
        assert not keep["counter"].get().any()
    nb = LS.topk_blocks(n)
    cand_v = keep["cand_v"].get().reshape(rows, nb, LS.TOPK_MAX)[:, :, 0]
    cand_i = keep["cand_i"].get().reshape(rows, nb, LS.TOPK_MAX)[:, :, 0]
    for r in range(rows):
        for b in range(nb):
            sl = logits[r, b * per:min(n, (b + 1) * per)]
            assert cand_v[r, b] == sl.max() and cand_i[r, b] == b * per + int(np.argmax(sl))
    assert keep["cand_n"].get().tolist() == [1] * (rows * nb)


def split_scratch(rows, n_tok, keep):
    """Workspace of K-split products (as cuda_workspace.Workspace sizes it), partials poisoned."""
    part = cp.full(LM.split_part_floats(rows, n_tok), POISON, cp.float32)
    counter = cp.zeros(-(-rows // 16) * -(-n_tok // 16), cp.uint32)
    keep += [part, counter]
    return LM.SplitScratch(part.data.ptr, part.size, counter.data.ptr, counter.size), counter


@pytest.mark.parametrize("name", SUPPORTED)
@pytest.mark.parametrize("n_tok", [9, 20, 50, 70])
def test_mma_every_type(k, name, n_tok, rng):
    """Tensor-core product (f16 operands, f32 accumulate): rows not a multiple of 32, K not a
    multiple of 128 where the type allows, tokens across 1..2 token tiles of 16/32/64."""
    keep = []
    rows, cols = 45, cols_for(name)
    m, w = upload(name, rows, cols, rng, keep)
    x = rng.standard_normal((n_tok, cols)).astype(np.float16).astype(np.float32)  # the kernel takes f16 x
    bias = rng.standard_normal(rows).astype(np.float32)
    xd, bd = cp.asarray(x.astype(np.float16)), cp.asarray(bias)
    y = cp.full((n_tok, rows + 3), POISON, cp.float32)
    LM.mma(k, [m], [(y.data.ptr, rows + 3)], [bd.data.ptr], xd.data.ptr, cols, n_tok, 0)
    ref = x.astype(np.float64) @ w.T + bias
    assert rel(y.get()[:, :rows], ref) < 2e-3
    assert np.isnan(y.get()[:, rows:]).all(), "wrote past the rows"
    y0 = rng.standard_normal((n_tok, rows)).astype(np.float32)
    yd = cp.asarray(y0)
    sc, counter = split_scratch(rows, n_tok, keep)  # K split 2..4 ways (2..6 k steps)
    assert LM.mma_config([rows], n_tok, cols, floor=k.knobs.mma_split_min_steps)[2] > 1
    LM.mma(k, [m], [(yd.data.ptr, rows)], [None], xd.data.ptr, cols, n_tok, 1, sc)
    assert rel(yd.get(), y0 + x.astype(np.float64) @ w.T) < 2e-3
    assert not counter.any(), "split counters not reset"


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q4_1"])
@pytest.mark.parametrize("n_tok", [64, 50])
def test_mma_split_k_and_wide_tiles(k, name, n_tok, rng):
    """The 8B's shapes in small: 64-row tiles with K split over 4 blocks (18 k steps: uneven runs),
    merged in a fixed order (bit-identical reruns), in both modes; an output head in tall blocks
    (two 64-row tiles); the 64-row GLU tiles. The last two need the 48 KiB shared-memory opt-in."""
    keep = []
    rows, cols = 2200, 2304
    c = LM.mma_config([rows], n_tok, cols)
    assert (c.wr, c.h, c.split) == (4, 1, 4)
    # the 8B's o-proj at 64 tokens: 2 splits of 16 k steps over 32-token tiles, not 4 splits of 8
    # over one 64-token tile (the split floor); its down (112 k steps) keeps 4; 32 tokens: as before
    fl = Tuning().mma_split_min_steps
    assert LM.mma_config([4096], 64, 4096, floor=fl) == (4, 4, 2, 1)
    assert LM.mma_config([4096], 64, 14336, floor=fl) == (4, 8, 4, 1)
    assert LM.mma_config([4096], 32, 4096, floor=fl) == (4, 4, 4, 1)
    m, w = upload(name, rows, cols, rng, keep)
    x = rng.standard_normal((n_tok, cols)).astype(np.float16).astype(np.float32)
    xd = cp.asarray(x.astype(np.float16))
    y0 = rng.standard_normal((n_tok, rows)).astype(np.float32)
    yd = cp.asarray(y0)
    sc, counter = split_scratch(rows, n_tok, keep)
    LM.mma(k, [m], [(yd.data.ptr, rows)], [None], xd.data.ptr, cols, n_tok, 1, sc)
    got = yd.get()
    assert rel(got, y0 + x.astype(np.float64) @ w.T) < 2e-3
    assert not counter.any(), "split counters not reset"
    yd.set(y0)  # the same sum in the same order on every run
    LM.mma(k, [m], [(yd.data.ptr, rows)], [None], xd.data.ptr, cols, n_tok, 1, sc)
    assert (yd.get() == got).all()
    bias = rng.standard_normal(rows).astype(np.float32)
    y = cp.full((n_tok, rows), POISON, cp.float32)
    LM.mma(k, [m], [(y.data.ptr, rows)], [cp.asarray(bias).data.ptr], xd.data.ptr, cols, n_tok, 0, sc)
    assert rel(y.get(), x.astype(np.float64) @ w.T + bias) < 2e-3
    head, hc = 33800, 1024  # an output head: tall blocks, no split
    assert LM.mma_config([head], n_tok, hc)[2:] == (1, 2)
    mh, wh = upload(name, head, hc, rng, keep)
    xh = rng.standard_normal((n_tok, hc)).astype(np.float16).astype(np.float32)
    yh = cp.full((n_tok, head), POISON, cp.float32)
    LM.mma(k, [mh], [(yh.data.ptr, head)], [None], cp.asarray(xh.astype(np.float16)).data.ptr, hc, n_tok, 0, sc)
    assert rel(yh.get(), xh.astype(np.float64) @ wh.T) < 2e-3
    n, c = 8448, 512
    assert LM.mma_config([n], n_tok, 0, tall=False).wr == 4
    (g, wg), (u, wu) = upload(name, n, c, rng, keep), upload(name, n, c, rng, keep)
    x2 = rng.standard_normal((n_tok, c)).astype(np.float16).astype(np.float32)
    out = cp.full((n_tok, n), np.nan, cp.float16)
    LM.mma_glu(k, g, u, cp.asarray(x2.astype(np.float16)).data.ptr, c, n_tok, "silu", out.data.ptr, n)
    gv, uv = x2.astype(np.float64) @ wg.T, x2.astype(np.float64) @ wu.T
    assert rel(out.get().astype(np.float32), silu(gv) * uv) < 2e-3


@pytest.mark.parametrize("n_tok", [64, 50])
def test_mma_split_floor_half_token_tiles(k, n_tok, rng):
    """The 8B's o-proj (Q4_K 4096 x 4096, y +=) and QKV (Q4_K, Q4_K, Q6_K over 4096 columns) at
    more than 32 tokens: 2 K splits over 32-token tiles (the split floor), against numpy; the
    counters are reset and a rerun gives the same bits."""
    keep = []
    cols = 4096
    o = upload("Q4_K", 4096, cols, rng, keep)
    qkv = [upload(n, r, cols, rng, keep) for n, r in (("Q4_K", 4096), ("Q4_K", 1024), ("Q6_K", 1024))]
    x = rng.standard_normal((n_tok, cols)).astype(np.float16).astype(np.float32)
    xd = cp.asarray(x.astype(np.float16))
    sc, counter = split_scratch(6144, n_tok, keep)
    fl = k.knobs.mma_split_min_steps
    assert LM.mma_config([4096], n_tok, cols, floor=fl) == (4, 4, 2, 1)
    assert LM.mma_config([4096, 1024, 1024], n_tok, cols, floor=fl) == (4, 4, 2, 1)
    y0 = rng.standard_normal((n_tok, 4096)).astype(np.float32)
    yd = cp.asarray(y0)
    LM.mma(k, [o[0]], [(yd.data.ptr, 4096)], [None], xd.data.ptr, cols, n_tok, 1, sc)
    got = yd.get()
    assert rel(got, y0 + x.astype(np.float64) @ o[1].T) < 2e-3
    assert not counter.any(), "split counters not reset"
    yd.set(y0)
    LM.mma(k, [o[0]], [(yd.data.ptr, 4096)], [None], xd.data.ptr, cols, n_tok, 1, sc)
    assert (yd.get() == got).all()
    y = cp.full((n_tok, 6144 + 8), POISON, cp.float32)
    outs = [(y.data.ptr, 6152), (y.data.ptr + 4 * 4096, 6152), (y.data.ptr + 4 * 5120, 6152)]
    LM.mma(k, [m for m, _ in qkv], outs, [None] * 3, xd.data.ptr, cols, n_tok, 0, sc)
    ref = np.concatenate([x.astype(np.float64) @ w.T for _, w in qkv], axis=1)
    assert rel(y.get()[:, :6144], ref) < 2e-3
    assert np.isnan(y.get()[:, 6144:]).all(), "wrote past the rows"
    assert not counter.any(), "split counters not reset"


@pytest.mark.parametrize("specs", [(("Q5_0", 96), ("Q5_0", 33), ("Q8_0", 50)),
                                   (("Q4_K", 96), ("Q4_K", 33), ("Q6_K", 50))])  # the 8B's QKV: register fragments
def test_mma_group_and_glu(k, specs, rng):
    keep = []
    cols = 640 if specs[0][0] == "Q5_0" else 768
    mats = [upload(n, r, cols, rng, keep) for n, r in specs]
    x = rng.standard_normal((24, cols)).astype(np.float16).astype(np.float32)
    xd = cp.asarray(x.astype(np.float16))
    ys = [cp.full((24, r), POISON, cp.float32) for _, r in specs]
    LM.mma(k, [m for m, _ in mats], [(y.data.ptr, y.shape[1]) for y in ys], [None] * 3, xd.data.ptr, cols, 24, 0)
    for (m, w), y in zip(mats, ys):
        assert rel(y.get(), x.astype(np.float64) @ w.T) < 2e-3
    (g, wg), (u, wu) = upload("Q4_K", 70, 512, rng, keep), upload("Q4_K", 70, 512, rng, keep)
    x2 = rng.standard_normal((40, 512)).astype(np.float16).astype(np.float32)
    x2d = cp.asarray(x2.astype(np.float16))
    out = cp.full((40, 70), np.nan, cp.float16)
    LM.mma_glu(k, g, u, x2d.data.ptr, 512, 40, "silu", out.data.ptr, 70)
    gv, uv = x2.astype(np.float64) @ wg.T, x2.astype(np.float64) @ wu.T
    assert rel(out.get().astype(np.float32), silu(gv) * uv) < 2e-3


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("split, shape, mb", [(2, None, 0), (3, None, 0), (0, (4, 4), 4), (2, (4, 4), 0),
                                             (4, (2, 4), 3)])
def test_mma_glu_split_and_shape(name, split, shape, mb, rng):
    """The GLU split over K (knobs' glu_split: each block's gate and up partials, merged by the
    tile's last block before the activation), other tile shapes (glu_shape) and a register cap
    for mb blocks an SM (glu_min_blocks) match numpy and the rule's GLU; the counters are back
    at zero for the next launch."""
    keep = []
    rows, cols, n_tok = 300, 2304, 64
    (g, wg), (u, wu) = upload(name, rows, cols, rng, keep), upload(name, rows, cols, rng, keep)
    x = rng.standard_normal((n_tok, cols)).astype(np.float16).astype(np.float32)
    xd = cp.asarray(x.astype(np.float16))
    ref = silu(x.astype(np.float64) @ wg.T) * (x.astype(np.float64) @ wu.T)
    part = cp.full(LM.split_part_floats(2 * rows, n_tok, 4), POISON, cp.float32)
    counter = cp.zeros(-(-rows // 16) * -(-n_tok // 16), cp.uint32)
    sc = LM.SplitScratch(part.data.ptr, part.size, counter.data.ptr, counter.size)
    got = []
    for knobs in ({}, {"glu_split": split, "glu_shape": shape, "glu_min_blocks": mb}):
        kk = L.Kernels(Tuning(**knobs).knobs())
        out = cp.full((n_tok, rows), np.nan, cp.float16)
        LM.mma_glu(kk, g, u, xd.data.ptr, cols, n_tok, "silu", out.data.ptr, rows, sc)
        got.append(out.get().astype(np.float32))
        assert rel(got[-1], ref) < 2e-3, knobs
    assert rel(got[1], got[0]) < 2e-3
    assert not counter.get().any()
    if split > 1:
        assert not np.isnan(part.get()).all()  # the split ran (its partials were written)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("mb", [3, 4])
def test_mma_min_blocks(k, name, mb, rng):
    """Products compiled for mb blocks an SM (mma_min_blocks: registers capped, maybe spilled)
    match numpy, split and unsplit."""
    keep = []
    rows, cols, n_tok = 2200, 2304, 64
    m, w = upload(name, rows, cols, rng, keep)
    x = rng.standard_normal((n_tok, cols)).astype(np.float16).astype(np.float32)
    xd = cp.asarray(x.astype(np.float16))
    kk = L.Kernels(Tuning(mma_min_blocks=mb).knobs())
    for sc in (None, split_scratch(rows, n_tok, keep)[0]):
        y = cp.full((n_tok, rows), POISON, cp.float32)
        LM.mma(kk, [m], [(y.data.ptr, rows)], [None], xd.data.ptr, cols, n_tok, 0, sc)
        assert rel(y.get(), x.astype(np.float64) @ w.T) < 2e-3
    assert any(n.endswith(f", {mb}>") for _, n in kk._fns)


@pytest.mark.parametrize("n_tok, act, stages", [(64, "silu", 2), (40, "gelu_tanh", 2), (100, "silu", 3)])
def test_mma_glu_wgmma(n_tok, act, stages, rng):
    """Q4_K GLUs of 64-token tiles on Hopper's wgmma (glu_wgmma.cu: A fragments from registers in
    natural k order, x as core matrices behind a descriptor) match numpy, and mma.sync's GLU
    (matmul_mma.cu) within rounding: a last row tile of 40 rows, 10 k steps, a partial token tile
    (40), two token tiles (100), both activations, two and three stages."""
    if not LM.hopper():
        pytest.skip("wgmma needs compute capability 9.0")
    keep = []
    rows, cols = 64 * LM.MMA_MIN_BLOCKS + 40, 1280  # 64-row tiles fill a wave (mma_config's wr = 4)
    (g, wg), (u, wu) = upload("Q4_K", rows, cols, rng, keep), upload("Q4_K", rows, cols, rng, keep)
    x = rng.standard_normal((n_tok, cols)).astype(np.float16).astype(np.float32)
    xd = cp.asarray(x.astype(np.float16))
    gv, uv = x.astype(np.float64) @ wg.T, x.astype(np.float64) @ wu.T
    ref = (gelu_tanh(gv) if act == "gelu_tanh" else silu(gv)) * uv
    got = {}
    for wgmma in (True, False):
        kk = L.Kernels(Tuning(mma_wgmma=wgmma, mma_stages=(2, stages)).knobs())
        out = cp.full((n_tok, rows), np.nan, cp.float16)
        LM.mma_glu(kk, g, u, xd.data.ptr, cols, n_tok, act, out.data.ptr, rows)
        assert any(f == "glu_wgmma.cu" for f, _ in kk._fns) == wgmma  # the wgmma kernel ran where asked
        got[wgmma] = out.get().astype(np.float32)
        assert rel(got[wgmma], ref) < 2e-3, wgmma
    assert rel(got[True], got[False]) < 2e-3


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_mma_register_fragments_and_dequantizing_tiles_agree(k, name, rng):
    """Q4_K / Q6_K build their A fragments in registers (mma_regs.cuh); mma_reg_a off takes
    the dequantizing tiles. Both match numpy, and each other, on the same inputs."""
    keep = []
    rows, cols, n_tok = 200, 1024, 64
    m, w = upload(name, rows, cols, rng, keep)
    x = rng.standard_normal((n_tok, cols)).astype(np.float16).astype(np.float32)
    xd = cp.asarray(x.astype(np.float16))
    ref = x.astype(np.float64) @ w.T
    got = {}
    for ra in ("1", "0"):
        k.knobs = k.knobs._replace(mma_reg_a=ra == "1")
        y = cp.full((n_tok, rows), POISON, cp.float32)
        LM.mma(k, [m], [(y.data.ptr, rows)], [None], xd.data.ptr, cols, n_tok, 0)
        got[ra] = y.get()
        assert rel(got[ra], ref) < 2e-3
    assert rel(got["1"], got["0"]) < 2e-3
    k.knobs = Tuning().knobs()


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("n_tok", [64, 32])
def test_mma_staged_pipeline_depths(k, name, n_tok, rng):
    """Q4_K's and Q6_K's tensor-core products stage x and the raw weights ST steps deep
    (KernelKnobs.mma_stages (single, GLU)). Every depth matches numpy and gives the two-stage
    pipeline's bits (the same MMAs in the same order), also with fewer k steps per block than
    stages: 2 k steps, and a K split 4 ways over 18 steps (4 or 5 each; 9 superblocks a row, so
    Q6_K's rows start their d plane at both halves of a word). At 32 tokens and 3 stages Q4_K's
    split product asks for exactly 48 KiB of dynamic shared memory, which with its static 16 bytes
    needs the opt-in."""
    keep = []
    cases = []
    for rows, cols, split in ((200, 256, False), (2200, 2304, True)):
        m, w = upload(name, rows, cols, rng, keep)
        x = rng.standard_normal((n_tok, cols)).astype(np.float16).astype(np.float32)
        y0 = rng.standard_normal((n_tok, rows)).astype(np.float32)
        sc = split_scratch(rows, n_tok, keep)[0] if split else None
        assert (LM.mma_config([rows], n_tok, cols if split else 0, floor=k.knobs.mma_split_min_steps).split > 1) == split
        cases.append((m, w, x, cp.asarray(x.astype(np.float16)), y0, sc))
    (g, wg), (u, wu) = upload(name, 140, 512, rng, keep), upload(name, 140, 512, rng, keep)
    x2 = rng.standard_normal((n_tok, 512)).astype(np.float16).astype(np.float32)
    x2d = cp.asarray(x2.astype(np.float16))
    glu_ref = silu(x2.astype(np.float64) @ wg.T) * (x2.astype(np.float64) @ wu.T)
    first = None
    for stages in ("2:2", "3:3", "4:3", "4:4"):
        k.knobs = k.knobs._replace(mma_stages=tuple(int(v) for v in stages.split(":")))
        got = []
        for m, w, x, xd, y0, sc in cases:
            yd = cp.asarray(y0)
            LM.mma(k, [m], [(yd.data.ptr, m.rows)], [None], xd.data.ptr, m.cols, n_tok, 1, sc)
            got.append(yd.get())
            assert rel(got[-1], y0 + x.astype(np.float64) @ w.T) < 2e-3, stages
        out = cp.full((n_tok, 140), np.nan, cp.float16)
        LM.mma_glu(k, g, u, x2d.data.ptr, 512, n_tok, "silu", out.data.ptr, 140)
        got.append(out.get())
        assert rel(got[-1].astype(np.float32), glu_ref) < 2e-3, stages
        if first is None:
            first = got
        for a, b in zip(got, first):
            assert np.array_equal(a, b), stages
    k.knobs = Tuning().knobs()
