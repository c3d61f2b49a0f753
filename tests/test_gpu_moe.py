"""moe.cu and moe_mma.cu against numpy on fresh random inputs, outputs poisoned first: the router's
top-k (ids exactly, ties to the lower id, as model.ComposedBlocks.moe's stable argsort), the sort by
expert, and the chosen experts' products of every quant type: the matvecs on f32 and int8 inputs,
the tensor-core tiles on f16 ones. The whole model is test_gpu_micro.py's qwen3moe case."""

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from gguf_runtime.backends.numpy.backend import silu  # noqa: E402
from gguf_runtime.backends.cuda.tuning import Tuning  # noqa: E402
from gguf_runtime.model import softmax  # noqa: E402
from gguf_runtime.quant_kernels import launch_layers as LL  # noqa: E402
from gguf_runtime.quant_kernels import launch_moe as LE  # noqa: E402
from gguf_runtime.quant_kernels import launchers as L  # noqa: E402
from gguf_runtime.quant_kernels.formats import BY_NAME, SUPPORTED  # noqa: E402
from gguf_runtime.quant_kernels.reference_q8 import dequantize_q8, quantize_q8  # noqa: E402
from test_gpu_kernels import POISON, cols_for, rel, upload  # noqa: E402


@pytest.fixture(scope="module")
def k():
    return L.Kernels(Tuning().knobs())


def ref_topk(logits, used, renorm):
    probs = softmax(logits.astype(np.float32))
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :used]
    w = np.take_along_axis(probs, ids, -1)
    return ids, (w / w.sum(-1, keepdims=True) if renorm else w)


@pytest.mark.parametrize("n_expert,used", [(8, 2), (60, 4), (128, 8), (256, 8), (32, 32)])
@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("biased", [False, True])
def test_topk(k, rng, n_expert, used, renorm, biased):
    """biased: gpt-oss's router bias, added to every row's logits inside the kernel."""
    rows = 37
    logits = (3 * rng.standard_normal((rows, n_expert))).astype(np.float32)
    logits[1] = 0.5  # every expert tied: the lowest ids, in order
    logits[2, ::3] = logits[2].max() + 1  # ties at the top
    logits[3, -1] = 50.0  # the last expert far ahead
    ld = n_expert + 3
    dev = cp.full((rows, ld), POISON, cp.float32)
    dev[:, :n_expert] = cp.asarray(logits)
    ids = cp.full((rows + 1, used), -7, cp.int32)
    w = cp.full((rows + 1, used), POISON, cp.float32)
    bias = (2 * rng.standard_normal(n_expert)).astype(np.float32) if biased else None
    bias_dev = cp.asarray(bias) if biased else None
    LE.topk(k, dev.data.ptr, ld, n_expert, used, renorm, rows, ids.data.ptr, w.data.ptr,
            bias=bias_dev.data.ptr if biased else 0)
    want_ids, want_w = ref_topk(logits + bias if biased else logits, used, renorm)
    np.testing.assert_array_equal(ids.get()[:rows], want_ids)
    assert rel(w.get()[:rows], want_w) < 1e-6
    assert (ids.get()[rows] == -7).all() and np.isnan(w.get()[rows]).all(), "wrote past the rows"


def test_topk_never_names_a_missing_expert(k):
    """NaN logits (a damaged file's router) still give ids within range: no read past the experts."""
    logits = cp.full((3, 16), np.nan, cp.float32)
    ids, w = cp.zeros((3, 4), cp.int32), cp.zeros((3, 4), cp.float32)
    LE.topk(k, logits.data.ptr, 16, 16, 4, True, 3, ids.data.ptr, w.data.ptr)
    assert ((ids.get() >= 0) & (ids.get() < 16)).all()


def stacked(name, n_expert, rows, cols, rng, keep):
    m, w = upload(name, n_expert * rows, cols, rng, keep)
    return m, w.reshape(n_expert, rows, cols)


def q8_of(x):
    """x's int8 activations on the device (quantize_q8) and what they stand for."""
    rows, cols = x.shape
    q = cp.zeros((rows, cols), cp.int8)
    s = cp.zeros((rows, cols // 16, 4), cp.float32)
    vec = L.Q8Vec(q.data.ptr, cols, s.data.ptr, cols // 16)
    xd = cp.asarray(x)
    return vec, (q, s, xd), dequantize_q8(*quantize_q8(x)[:2]).astype(np.float64)


# (type, int8 inputs): float weights take f32 inputs only
PRODUCT_CASES = [(n, False) for n in SUPPORTED] + [
    (n, True) for n in SUPPORTED if L.q8_capable([L.Mat(BY_NAME[n], 1, 256, 0)])]


@pytest.mark.parametrize("name,int8", PRODUCT_CASES)
def test_expert_products(k, rng, name, int8):
    """glu, mv and down over random ids, t tokens x used ranks, against the dequantized experts."""
    keep = []
    n_expert, used, t, n = 6, 3, 5, 40
    d, fcols = cols_for(name, 2), cols_for(name, 1)
    gate, wg = stacked(name, n_expert, n, d, rng, keep)
    up, wu = stacked(name, n_expert, n, d, rng, keep)
    n_out = 48
    down, wd = stacked(name, n_expert, n_out, fcols, rng, keep)
    ids = np.stack([rng.permutation(n_expert)[:used] for _ in range(t)]).astype(np.int32)
    wts = rng.random((t, used)).astype(np.float32)
    x = rng.standard_normal((t, d)).astype(np.float32)
    xd = cp.asarray(x)
    q8 = None
    xr = x.astype(np.float64)
    if int8:
        q8, keep_q8, xr = q8_of(x)
        keep.append(keep_q8)
        LL.quantize_q8(k, xd.data.ptr, d, d, t, q8)
    idd, wdv = cp.asarray(ids), cp.asarray(wts)
    slots = t * used
    g = cp.full((slots, n + 3), POISON, cp.float32)
    LE.glu(k, gate, up, n, idd.data.ptr, used, xd.data.ptr, d, slots, "silu", g.data.ptr, n + 3, q8=q8)
    flat = ids.reshape(-1)
    xs = xr[np.repeat(np.arange(t), used)]
    ref_g = np.stack([silu(wg[e] @ xs[s]) * (wu[e] @ xs[s]) for s, e in enumerate(flat)])
    assert rel(g.get()[:, :n], ref_g) < (3e-5 if int8 else 1e-5)
    assert np.isnan(g.get()[:, n:]).all(), "wrote past an expert's rows"
    if int8:  # 16 rows a block (r = 8): the q8 epilogue writes the int8 copy of g (down's input)
        n16 = 48
        gate16, wg16 = stacked(name, n_expert, n16, d, rng, keep)
        up16, wu16 = stacked(name, n_expert, n16, d, rng, keep)
        g8 = cp.full((slots, n16 + 3), POISON, cp.float32)
        gq, keep_g, _ = q8_of(np.zeros((slots, n16), np.float32))
        keep.append(keep_g)
        LE.glu(k, gate16, up16, n16, idd.data.ptr, used, xd.data.ptr, d, slots, "silu", g8.data.ptr, n16 + 3, q8=q8,
               r=8, q8_out=gq)
        ref16 = np.stack([silu(wg16[e] @ xs[s]) * (wu16[e] @ xs[s]) for s, e in enumerate(flat)])
        assert rel(g8.get()[:, :n16], ref16) < 3e-5
        want_q, want_d = quantize_q8(g8.get()[:, :n16])[:2]
        assert (keep_g[0].get() == want_q).all() and (keep_g[1].get()[:, :, 0] == want_d).all()
    y = cp.full((slots, n + 3), POISON, cp.float32)
    LE.mv(k, gate, n, idd.data.ptr, used, xd.data.ptr, d, slots, y.data.ptr, n + 3, q8=q8)
    assert rel(y.get()[:, :n], np.stack([wg[e] @ xs[s] for s, e in enumerate(flat)])) < (3e-5 if int8 else 1e-5)
    # down: inputs [slots, fcols] (f32, or their int8 copy as the backend's quantize_q8 writes it),
    # weighted sum into a residual
    a = rng.standard_normal((slots, fcols)).astype(np.float32)
    ad, a_q8, ar = cp.asarray(a), None, a.astype(np.float64)
    if int8:
        a_q8, keep_a, ar = q8_of(a)
        keep.append(keep_a)
        LL.quantize_q8(k, ad.data.ptr, fcols, fcols, slots, a_q8)
    res = rng.standard_normal((t, n_out + 2)).astype(np.float32)
    resd = cp.asarray(res)
    LE.down(k, down, n_out, idd.data.ptr, wdv.data.ptr, used, ad.data.ptr, fcols, t, resd.data.ptr, n_out + 2,
            q8=a_q8)
    want = res.astype(np.float64)
    for s, e in enumerate(flat):
        want[s // used, :n_out] += wts.reshape(-1)[s] * (wd[e] @ ar[s])
    assert rel(resd.get(), want) < (3e-5 if int8 else 1e-5)
    assert (resd.get()[:, n_out:] == res[:, n_out:]).all(), "wrote past the rows"


@pytest.mark.parametrize("name,act,used", [("MXFP4", "swiglu_oai", 4), ("Q4_K", "silu", 8), ("Q6_K", "silu", 8),
                                           ("Q5_K", "silu", 8), ("Q3_K", "silu", 8), ("IQ4_XS", "silu", 8),
                                           ("IQ2_XXS", "silu", 8)])
@pytest.mark.parametrize("mb", [(3, 2), (4, 4)])
def test_min_blocks_keep_the_bits(k, rng, name, act, used, mb):
    """Launch bounds that cap the registers (the tuning table's moe_min_blocks) leave every bit of the
    decode path's GLU (r = 8, biases, the q8 epilogue) and down (r = 4, int8 input, biases) as it was."""
    keep = []
    n_expert, t, n, n_out = 2 * used, 3, 48, 40
    d = cols_for(name, 2)
    gate, _ = stacked(name, n_expert, n, d, rng, keep)
    up, _ = stacked(name, n_expert, n, d, rng, keep)
    fcols = cols_for(name, 1)
    down, _ = stacked(name, n_expert, n_out, fcols, rng, keep)
    ids = cp.asarray(np.stack([rng.permutation(n_expert)[:used] for _ in range(t)]).astype(np.int32))
    wts = cp.asarray(rng.random((t, used)).astype(np.float32))
    x = rng.standard_normal((t, d)).astype(np.float32)
    xd = cp.asarray(x)
    q8, keep_q8, _ = q8_of(x)
    keep.append(keep_q8)
    LL.quantize_q8(k, xd.data.ptr, d, d, t, q8)
    bg, bu = (cp.asarray(rng.standard_normal((n_expert, n)).astype(np.float32)) for _ in range(2))
    bd = cp.asarray(rng.standard_normal((n_expert, n_out)).astype(np.float32))
    a = rng.standard_normal((t * used, fcols)).astype(np.float32)
    ad = cp.asarray(a)
    a_q8, keep_a, _ = q8_of(a)
    keep.append(keep_a)
    LL.quantize_q8(k, ad.data.ptr, fcols, fcols, t * used, a_q8)
    res = rng.standard_normal((t, n_out)).astype(np.float32)
    got = []
    for m in ((1, 1), mb):
        g = cp.full((t * used, n), POISON, cp.float32)
        gq, keep_g, _ = q8_of(np.zeros((t * used, n), np.float32))
        LE.glu(k, gate, up, n, ids.data.ptr, used, xd.data.ptr, d, t * used, act, g.data.ptr, n, q8=q8, r=8,
               q8_out=gq, biases=(bg.data.ptr, bu.data.ptr), mb=m[0])
        y = cp.asarray(res)
        LE.down(k, down, n_out, ids.data.ptr, wts.data.ptr, used, ad.data.ptr, fcols, t, y.data.ptr, n_out,
                q8=a_q8, r=4, bias=bd.data.ptr, mb=m[1])
        got.append((g.get(), keep_g[0].get(), keep_g[1].get(), y.get()))
    assert np.isfinite(got[0][0]).all() and np.isfinite(got[0][3]).all() and np.abs(got[0][0]).max() > 0
    for before, after in zip(*got):
        assert (before.view(np.uint32) == after.view(np.uint32)).all()


@pytest.mark.parametrize("name,fcols", [("Q6_K", 768), ("Q4_K", 512), ("MXFP4", 512), ("Q6_K", 256)])
@pytest.mark.parametrize("n_out", [40, 56])
@pytest.mark.parametrize("biased", [False, True])
def test_down_sub_sets(k, rng, name, fcols, n_out, biased):
    """down's sub-warp row sets (sub: rows of at most 16 units, two sets of 16 lanes a warp, each on
    its own rows; Qwen3-30B-A3B's Q6_K down of 768 columns has 12 units a row) against the float64
    reference and the one-set launch, with the rows past n_out (a block's second set past the end)
    left alone; int8 inputs, biases or none."""
    keep = []
    n_expert, used, t = 16, 8, 3
    down, wd = stacked(name, n_expert, n_out, fcols, rng, keep)
    ids = np.stack([rng.permutation(n_expert)[:used] for _ in range(t)]).astype(np.int32)
    wts = rng.random((t, used)).astype(np.float32)
    idd, wdv = cp.asarray(ids), cp.asarray(wts)
    a = rng.standard_normal((t * used, fcols)).astype(np.float32)
    ad = cp.asarray(a)
    a_q8, keep_a, ar = q8_of(a)
    keep.append(keep_a)
    LL.quantize_q8(k, ad.data.ptr, fcols, fcols, t * used, a_q8)
    bd = rng.standard_normal((n_expert, n_out)).astype(np.float32) if biased else None
    bdd = cp.asarray(bd) if biased else None
    res = rng.standard_normal((t, n_out + 2)).astype(np.float32)
    want = res.astype(np.float64)
    for s, e in enumerate(ids.reshape(-1)):
        want[s // used, :n_out] += wts.reshape(-1)[s] * (wd[e] @ ar[s] + (bd[e] if biased else 0.0))
    got = []
    for sub in (True, False):
        y = cp.asarray(res)
        LE.down(k, down, n_out, idd.data.ptr, wdv.data.ptr, used, ad.data.ptr, fcols, t, y.data.ptr, n_out + 2,
                q8=a_q8, r=4, bias=bdd.data.ptr if biased else 0, mb=2, sub=sub)
        got.append(y.get())
        assert rel(got[-1], want) < 3e-5, sub
        assert (got[-1][:, n_out:] == res[:, n_out:]).all(), "wrote past the rows"
    assert LE.down_sub(down, a_q8), "the launch took the sub-warp sets"
    assert rel(got[0], got[1]) < 1e-6


@pytest.mark.parametrize("name,fcols", [("Q6_K", 768), ("Q4_K", 512)])
@pytest.mark.parametrize("t", [1, 3])
def test_down_q8_epilogue(k, rng, name, fcols, t):
    """down with a q8 epilogue (16 rows a block: two row groups of sub-warp sets) adds into the
    residual exactly what the plain sub-set launch adds, and writes the int8 copy of the new rows
    times the next norm's weight (quantize_q8's bits) with the rows' squares, over poisoned buffers."""
    keep = []
    n_expert, used, n_out = 16, 8, 64
    down, _ = stacked(name, n_expert, n_out, fcols, rng, keep)
    ids = cp.asarray(np.stack([rng.permutation(n_expert)[:used] for _ in range(t)]).astype(np.int32))
    wts = cp.asarray(rng.random((t, used)).astype(np.float32))
    a = rng.standard_normal((t * used, fcols)).astype(np.float32)
    ad = cp.asarray(a)
    a_q8, keep_a, _ = q8_of(a)
    keep.append(keep_a)
    LL.quantize_q8(k, ad.data.ptr, fcols, fcols, t * used, a_q8)
    res = rng.standard_normal((t, n_out)).astype(np.float32)
    nw = (1 + 0.5 * rng.standard_normal(n_out)).astype(np.float32)
    nwd = cp.asarray(nw)
    plain = cp.asarray(res)
    LE.down(k, down, n_out, ids.data.ptr, wts.data.ptr, used, ad.data.ptr, fcols, t, plain.data.ptr, n_out,
            q8=a_q8, r=4, mb=2, sub=True)
    y = cp.asarray(res)
    oq, (q, sq, _), _ = q8_of(np.zeros((t, n_out), np.float32))
    q.fill(-7)
    sq.fill(np.nan)
    LE.down(k, down, n_out, ids.data.ptr, wts.data.ptr, used, ad.data.ptr, fcols, t, y.data.ptr, n_out,
            q8=a_q8, r=4, mb=2, sub=True, q8_out=(oq, nwd.data.ptr))
    got = y.get()
    assert (got.view(np.uint32) == plain.get().view(np.uint32)).all() and not (got == res).all()
    want_q, want_d, want_s = quantize_q8(got * nw)
    assert (q.get() == want_q).all()
    assert (sq.get()[:, :, 0] == want_d).all() and (sq.get()[:, :, 1] == want_s).all()
    ssq = (got.astype(np.float64).reshape(t, -1, 16) ** 2).sum(-1)
    assert rel(sq.get()[:, :, 2], ssq) < 1e-6


@pytest.mark.parametrize("name,act,n_expert,used,biased", [("Q4_K", "silu", 128, 8, False),
                                                          ("MXFP4", "swiglu_oai", 32, 4, True),
                                                          ("Q5_K", "silu", 60, 4, False)])
@pytest.mark.parametrize("t", [1, 3, 8])
def test_topk_in_the_glu(k, rng, name, act, n_expert, used, biased, t):
    """The GLU that picks its experts (glu's topk: no moe_topk launch) writes the ids and weights
    moe_topk writes and every bit of the GLU's outputs (and its q8 epilogue) as after moe_topk, on
    logits with ties; nothing past the rows."""
    keep = []
    n, d = 48, cols_for(name, 2)
    gate, _ = stacked(name, n_expert, n, d, rng, keep)
    up, _ = stacked(name, n_expert, n, d, rng, keep)
    logits = (3 * rng.standard_normal((t, n_expert))).astype(np.float32)
    logits[0, ::5] = logits[0].max() + 1  # ties at the top of the first token
    ld = n_expert + 3
    dev = cp.full((t, ld), POISON, cp.float32)
    dev[:, :n_expert] = cp.asarray(logits)
    bias = cp.asarray((2 * rng.standard_normal(n_expert)).astype(np.float32)) if biased else None
    bptr = bias.data.ptr if biased else 0
    x = rng.standard_normal((t, d)).astype(np.float32)
    xd = cp.asarray(x)
    q8, keep_q8, _ = q8_of(x)
    keep.append(keep_q8)
    LL.quantize_q8(k, xd.data.ptr, d, d, t, q8)
    bg, bu = (cp.asarray(rng.standard_normal((n_expert, n)).astype(np.float32)) for _ in range(2))
    got = []
    for fused in (False, True):
        ids = cp.full((t + 1, used), -7, cp.int32)
        w = cp.full((t + 1, used), POISON, cp.float32)
        if not fused:
            LE.topk(k, dev.data.ptr, ld, n_expert, used, True, t, ids.data.ptr, w.data.ptr, bias=bptr)
        g = cp.full((t * used, n), POISON, cp.float32)
        gq, keep_g, _ = q8_of(np.zeros((t * used, n), np.float32))
        LE.glu(k, gate, up, n, ids.data.ptr, used, xd.data.ptr, d, t * used, act, g.data.ptr, n, q8=q8, r=8,
               q8_out=gq, biases=(bg.data.ptr, bu.data.ptr),
               topk=LE.TopK(dev.data.ptr, ld, n_expert, True, w.data.ptr, bptr) if fused else None)
        got.append((ids.get(), w.get(), g.get(), keep_g[0].get(), keep_g[1].get()))
    want_ids, _ = ref_topk(logits + (bias.get() if biased else 0), used, True)
    np.testing.assert_array_equal(got[1][0][:t], want_ids)
    assert (got[1][0][t] == -7).all() and np.isnan(got[1][1][t]).all(), "wrote past the rows"
    assert np.isfinite(got[0][2]).all() and np.abs(got[0][2]).max() > 0
    for before, after in zip(*got):
        assert (before.view(np.uint32) == after.view(np.uint32)).all()


@pytest.mark.parametrize("shape", [(2, 1), LE.ROUTER])
def test_router_without_ids_is_a_plain_product(k, rng, shape):
    """mv with ids None (the router): W x for each token, the F32 matrix itself."""
    keep = []
    m, w = upload("F32", 24, 2048, rng, keep)
    x = rng.standard_normal((9, 2048)).astype(np.float32)
    y = cp.full((9, 25), POISON, cp.float32)
    LE.mv(k, m, 24, None, 1, cp.asarray(x).data.ptr, 2048, 9, y.data.ptr, 25, r=shape[0], wg=shape[1])
    assert rel(y.get()[:, :24], x.astype(np.float64) @ w.T) < 1e-6
    assert np.isnan(y.get()[:, 24]).all(), "wrote past the rows"


@pytest.mark.parametrize("rows", [5, 8, 23, 64])
def test_router_over_many_tokens(k, rng, rows):
    """router: W x' over any row count (tiles of ROUTER_TILE tokens past it, the last one overlapping),
    RMSNorm fused, against float64; nothing written past the rows asked for."""
    keep = []
    n, cols, eps = 128, 2048, 1e-6
    m, w = upload("F32", n, cols, rng, keep)
    x = rng.standard_normal((rows + 3, cols)).astype(np.float32)
    nw = rng.standard_normal(cols).astype(np.float32)
    xd, nwd = cp.asarray(x), cp.asarray(nw)
    y = cp.full((rows + 3, n + 1), POISON, cp.float32)
    LE.router(k, m, xd.data.ptr, cols, rows, y.data.ptr, n + 1, norm=(nwd.data.ptr, eps))
    x64 = x[:rows].astype(np.float64)
    xn = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + eps) * nw
    assert rel(y.get()[:rows, :n], xn @ w.T) < 1e-5
    assert np.isnan(y.get()[rows:]).all() and np.isnan(y.get()[:, n]).all(), "wrote past the rows"


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("n_expert,used", [(128, 8), (60, 4), (256, 8)])
def test_router_topk_in_one_launch(k, rng, rows, n_expert, used):
    """router_topk: the logits and experts of router then topk, bit for bit, three calls in a row (each
    token's counter back to zero after each), with the norm fused or not; nothing past the rows."""
    keep = []
    cols = 2048
    m, _ = upload("F32", n_expert, cols, rng, keep)
    counters = cp.zeros(LE.ROUTER_TILE, cp.uint32)
    for call, norm in enumerate((False, True, True)):
        xd = cp.asarray(rng.standard_normal((rows, cols)).astype(np.float32))
        nwd = cp.asarray(rng.standard_normal(cols).astype(np.float32))
        nrm, renorm = ((nwd.data.ptr, 1e-6) if norm else None), call != 1
        outs = []
        for fused in (False, True):
            y = cp.full((rows + 1, n_expert + 1), POISON, cp.float32)
            ids = cp.full((rows + 1, used), -7, cp.int32)
            wt = cp.full((rows + 1, used), POISON, cp.float32)
            if fused:
                LE.router_topk(k, m, xd.data.ptr, cols, rows, y.data.ptr, n_expert + 1, used, renorm, ids.data.ptr,
                               wt.data.ptr, counters.data.ptr, norm=nrm)
            else:
                LE.router(k, m, xd.data.ptr, cols, rows, y.data.ptr, n_expert + 1, norm=nrm)
                LE.topk(k, y.data.ptr, n_expert + 1, n_expert, used, renorm, rows, ids.data.ptr, wt.data.ptr)
            outs.append((y.get(), ids.get(), wt.get()))
        (y0, i0, w0), (y1, i1, w1) = outs
        what = f"call {call}"
        assert np.array_equal(y1[:rows, :n_expert].view(np.uint32), y0[:rows, :n_expert].view(np.uint32)), what
        np.testing.assert_array_equal(i1[:rows], i0[:rows], err_msg=what)
        assert np.array_equal(w1[:rows].view(np.uint32), w0[:rows].view(np.uint32)), what
        assert (i1[rows] == -7).all() and np.isnan(w1[rows]).all(), f"{what}: wrote past the rows"
        assert np.isnan(y1[rows]).all() and np.isnan(y1[:, n_expert]).all(), f"{what}: wrote past the logits"
        assert (counters.get() == 0).all(), f"{what}: a token's counter left set"


def sorted_tiles(k, ids, n_expert, mt):
    """moe_sort on the device: (device ids, order, tiles, entries) in tiles of up to mt slots."""
    slots = ids.size
    idd = cp.asarray(ids.reshape(-1).astype(np.int32))
    pos, order = cp.zeros(slots, cp.int32), cp.full(slots, -1, cp.int32)
    n_tiles = LE.max_tiles(slots, n_expert, mt)
    tiles = cp.full((n_tiles, 4), -9, cp.int32)
    LE.sort(k, idd.data.ptr, slots, n_expert, pos.data.ptr, order.data.ptr, tiles.data.ptr, mt)
    return idd, order, tiles, n_tiles


@pytest.mark.parametrize("slots,n_expert,mt", [(1, 8, 8), (148, 16, 8), (512, 128, 8), (16384, 128, 64),
                                               (300, 256, 16), (4096, 128, 32)])
def test_sort_lists_every_slot_once_grouped_by_expert(k, rng, slots, n_expert, mt):
    ids = rng.integers(0, n_expert, slots)
    ids[: min(slots, 150)] = 3  # one expert with several tiles
    _, order, tiles, n_tiles = sorted_tiles(k, ids, n_expert, mt)
    order, tiles = order.get(), tiles.get()
    assert sorted(order.tolist()) == list(range(slots))
    assert (np.diff(ids[order]) >= 0).all(), "not grouped by expert in ascending order"
    used = tiles[tiles[:, 2] > 0]
    assert (tiles[len(used):, :3] == 0).all(), "the unused tiles are not marked empty"
    assert used[:, 2].max() <= mt and used[:, 2].sum() == slots
    for e, start, count, _ in used:
        assert (ids[order[start:start + count]] == e).all()
    counts = np.bincount(ids, minlength=n_expert)
    assert len(used) == sum(-(-c // mt) for c in counts) <= n_tiles


@pytest.mark.parametrize("name", SUPPORTED)
@pytest.mark.parametrize("tb", [8, 16, 32, 64])
def test_mma_tiles_against_numpy(k, rng, name, tb):
    """sort, gather_f16, glu_mma, down_mma: the grouped tensor-core path of prompts and large batches
    (f16 inputs, f32 sums), against float64 sums over the dequantized experts. An expert with
    several tiles, experts with none, expert rows not a multiple of the 64-row tile (rows past an
    expert's must not be read from the next one nor written), K not a multiple of 128 where the type
    allows."""
    keep = []
    n_expert, used, t, n, n_out = 12, 4, 23, 40, 72
    d, fcols = cols_for(name, 2), cols_for(name, 1)
    gate, wg = stacked(name, n_expert, n, d, rng, keep)
    up, wu = stacked(name, n_expert, n, d, rng, keep)
    down, wd = stacked(name, n_expert, n_out, fcols, rng, keep)
    ids = np.stack([rng.permutation(n_expert - 2)[:used] for _ in range(t)]).astype(np.int32)  # 2 experts unused
    ids[:20, 0] = 5
    ids[:20, 1:] = np.where(ids[:20, 1:] == 5, 6, ids[:20, 1:])
    slots = t * used
    _, order, tiles, n_tiles = sorted_tiles(k, ids, n_expert, tb)
    assert min(tb, 20) <= tiles.get()[:, 2].max() <= tb
    h = rng.standard_normal((t, d + 8)).astype(np.float32)  # a row stride past the width
    xs = cp.full((slots, d + 16), np.nan, cp.float16)
    LE.gather_f16(k, cp.asarray(h).data.ptr, d + 8, order.data.ptr, used, d, xs.data.ptr, d + 16, slots)
    o, flat = order.get(), ids.reshape(-1)
    h16 = h[:, :d].astype(np.float16)
    assert (xs.get()[:, :d] == h16[o // used]).all()
    g = cp.full((slots, fcols + 8), np.nan, cp.float16)
    LE.glu_mma(k, gate, up, n, tiles.data.ptr, n_tiles, xs.data.ptr, d + 16, "silu", g.data.ptr, fcols + 8, tb)
    x64 = h16.astype(np.float64)
    ref_g = np.stack([silu(wg[flat[s]] @ x64[s // used]) * (wu[flat[s]] @ x64[s // used]) for s in o])
    assert rel(g.get()[:, :n], ref_g) < 2e-3
    assert np.isnan(g.get()[:, n:]).all(), "wrote past an expert's rows"
    g[:, n:] = 0.0  # the down product's columns past the GLU's rows
    ys = cp.full((slots, n_out + 3), POISON, cp.float32)
    LE.down_mma(k, down, n_out, tiles.data.ptr, n_tiles, order.data.ptr, g.data.ptr, fcols + 8, ys.data.ptr,
                n_out + 3, tb)
    gs = np.zeros((slots, fcols))
    gs[o] = g.get()[:, :fcols].astype(np.float64)
    assert rel(ys.get()[:, :n_out], np.stack([wd[flat[s]] @ gs[s] for s in range(slots)])) < 2e-3
    assert np.isnan(ys.get()[:, n_out:]).all(), "wrote past the rows"
