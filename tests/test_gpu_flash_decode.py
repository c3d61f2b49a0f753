"""flash_decode.cu (decode steps' attention on the tensor cores, keys split over the grid) against
float64 numpy: every head dim, GQA ratio, sliding window, soft-cap; rows of their own sequences at
uneven depths (pages in shuffled order among noise pages) and a padding row; one split to 32;
float32, f16, q8_0 and q4_0 caches; each ring shape; the early-load flag bit for bit. Operands are f16 (q
scaled, K, V, P) with f32 accumulation: flash_attn.cu's bar."""

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
from test_gpu_flash import BAR, SHAPES, SMEM_MAX, as_cache  # noqa: E402

PAGE = 16


@pytest.fixture(scope="module")
def k():
    return L.Kernels(Tuning().knobs())


def sequences(rng, depths, hkv, d, kv, extra=5):
    """One sequence per depth (keys 0 .. depth), each with its own K, V (as the cache of type kv
    holds them) and pages scattered through one cache (packed) among pages of noise that must
    never be read."""
    need = [depth // PAGE + 1 for depth in depths]
    max_pages = max(need)
    n_pages = sum(need) + extra
    order = rng.permutation(n_pages).astype(np.int32)
    kc = (rng.standard_normal((n_pages, hkv, PAGE, d)) * 100).astype(np.float32)
    vc = (rng.standard_normal((n_pages, hkv, PAGE, d)) * 100).astype(np.float32)
    table = np.full((len(depths), max_pages), -1, np.int32)
    at = 0
    for s, depth in enumerate(depths):
        table[s, :need[s]] = order[at:at + need[s]]
        at += need[s]
        for p in range(depth + 1):
            kc[table[s, p // PAGE], :, p % PAGE] = rng.standard_normal((hkv, d))
            vc[table[s, p // PAGE], :, p % PAGE] = rng.standard_normal((hkv, d))
    (kc, kvals), (vc, vvals) = as_cache(kc, kv, PAGE), as_cache(vc, kv, PAGE)
    KV = []
    for s, depth in enumerate(depths):
        rows = [(table[s, p // PAGE], p % PAGE) for p in range(depth + 1)]
        KV.append((np.stack([kvals[pg, :, sl] for pg, sl in rows]), np.stack([vvals[pg, :, sl] for pg, sl in rows])))
    return KV, kc, vc, table, max_pages


def run_decode(k, q, kc, vc, pos, seq, table, max_pages, hq, hkv, d, scale, cap, window, n_split, kv,
               early=False, config=None, sinks=None, bulk=None, per_row=False, ml=None):
    """The outputs (t, hq * d); ``ml`` (a list): the (max, sum) partials are appended to it."""
    t = q.shape[0]
    out = cp.full((t, hq * d), POISON, cp.float32)
    part_o = cp.full(t * hq * n_split * d, POISON, cp.float32)
    part_ml = cp.full(t * hq * n_split * 2, POISON, cp.float32)
    counter = cp.zeros(t * hkv, cp.uint32)
    qd, kd, vd, posd, seqd, tabd = (cp.asarray(a) for a in (q.reshape(t, -1), kc, vc, pos, seq, table))
    LA.flash_decode(k, qd.data.ptr, hq * d, t, kd.data.ptr, vd.data.ptr, posd.data.ptr, seqd.data.ptr,
                    tabd.data.ptr, max_pages, PAGE, hq, hkv, d, scale, cap, window, n_split, part_o.data.ptr,
                    part_ml.data.ptr, counter.data.ptr, out.data.ptr, hq * d, early=early, kv=kv, config=config,
                    sinks=sinks.data.ptr if sinks is not None else 0, bulk=bulk, per_row=per_row)
    assert not counter.get().any(), "the merging blocks leave the counters at zero"
    if ml is not None:
        ml.append(part_ml.get().reshape(t, hq, n_split, 2))
    return out.get()


DEPTHS = [0, 5, 16, 33, 79, 300, 1000, 2500]


@pytest.mark.parametrize("d,hq,hkv,cap,window", SHAPES)
@pytest.mark.parametrize("kv", KL.KV_TYPES)
@pytest.mark.parametrize("n_split", [1, 4, 32])
def test_flash_decode(k, d, hq, hkv, cap, window, kv, n_split, rng):
    """Rows at uneven depths, each its own sequence, and a padding row (zeros); early on and off
    give the same bits."""
    KV, kc, vc, table, max_pages = sequences(rng, DEPTHS, hkv, d, kv)
    rows = len(DEPTHS) + 1
    pos = np.array(DEPTHS + [7], np.int32)
    seq = np.array(list(range(len(DEPTHS))) + [-1], np.int32)
    q = rng.standard_normal((rows, hq, d)).astype(np.float32)
    scale = 1 / math.sqrt(d)
    ref = np.zeros((rows, hq, d))
    for i, (K, V) in enumerate(KV):
        ref[i] = attention_ref(q[i:i + 1], K, V, pos[i:i + 1], scale, cap, window)[0]
    outs = [run_decode(k, q, kc, vc, pos, seq, table, max_pages, hq, hkv, d, scale, cap, window, n_split, kv,
                       early=early) for early in (False, True)]
    assert (outs[0] == outs[1]).all()
    o = outs[0].reshape(rows, hq, d)
    assert not o[-1].any(), "the padding row's outputs are zeros"
    per_row = [rel(o[i], ref[i]) for i in range(len(DEPTHS))]
    assert max(per_row) < BAR, per_row


@pytest.mark.parametrize("kv", ["f16", "q8_0"])
@pytest.mark.parametrize("n_split", [1, 4, 32])
def test_flash_decode_sinks(k, kv, n_split, rng):
    """gpt-oss's attention sinks (a logit a head in the softmax's denominator; its layout: 64-dim
    heads, 8 a KV head, a sliding window) in the row's only block and in the merge of its splits."""
    d, hq, hkv, window = 64, 16, 2, 128
    KV, kc, vc, table, max_pages = sequences(rng, DEPTHS, hkv, d, kv)
    rows = len(DEPTHS)
    pos, seq = np.array(DEPTHS, np.int32), np.arange(rows, dtype=np.int32)
    q = rng.standard_normal((rows, hq, d)).astype(np.float32)
    sinks = (rng.standard_normal(hq) * 3).astype(np.float32)
    sinks[0] = 12.0
    scale = 1 / math.sqrt(d)
    ref = np.stack([attention_ref(q[i:i + 1], K, V, pos[i:i + 1], scale, 0.0, window, sinks)[0]
                    for i, (K, V) in enumerate(KV)])
    o = run_decode(k, q, kc, vc, pos, seq, table, max_pages, hq, hkv, d, scale, 0.0, window, n_split, kv,
                   sinks=cp.asarray(sinks)).reshape(rows, hq, d)
    per_row = [rel(o[i], ref[i]) for i in range(rows)]
    assert max(per_row) < BAR, per_row


CONFIGS = [(4, 16, 2), (4, 16, 3), (4, 16, 4), (4, 32, 3), (2, 16, 4), (8, 16, 2)]
SHAPE_CASES = [(d, hq, hkv, config, kv) for d, hq, hkv in [(64, 9, 3), (128, 32, 8), (256, 4, 1)]
               for config in CONFIGS for kv in KL.KV_TYPES
               if LA.decode_smem(d, config, kv) <= SMEM_MAX - 4096]  # the merge's static arrays: up to 2.3 KiB


@pytest.mark.parametrize("d,hq,hkv,config,kv", SHAPE_CASES, ids=str)
def test_flash_decode_shapes(k, d, hq, hkv, config, kv, rng):
    """Every ring shape (NW warps, KT keys, ST stages) that fits computes the same attention."""
    depths = [3, 200, 1234]
    KV, kc, vc, table, max_pages = sequences(rng, depths, hkv, d, kv)
    pos = np.array(depths, np.int32)
    q = rng.standard_normal((len(depths), hq, d)).astype(np.float32)
    scale = 1 / math.sqrt(d)
    o = run_decode(k, q, kc, vc, pos, np.arange(len(depths), dtype=np.int32), table, max_pages, hq, hkv, d, scale,
                   0.0, 0, 8, kv, early=True, config=config).reshape(len(depths), hq, d)
    for i, (K, V) in enumerate(KV):
        assert rel(o[i], attention_ref(q[i:i + 1], K, V, pos[i:i + 1], scale, 0.0, 0)[0]) < BAR


BULK_CASES = [(d, hq, hkv, config) for d, hq, hkv in [(64, 9, 3), (128, 32, 8)]
              for config in [(8, 16, 2), (4, 16, 3), (4, 32, 3)]]


@pytest.mark.parametrize("d,hq,hkv,config", BULK_CASES, ids=str)
@pytest.mark.parametrize("n_split", [1, 4])
def test_flash_decode_bulk_same_bits(k, d, hq, hkv, config, n_split, rng):
    """f16 tiles by cp.async.bulk (a row a request, an mbarrier a stage; KT 32 over pages of 16: a
    page lookup a row) give the cp.async path's bits: uneven depths, tails past the last key (rows
    zeroed), a padding row, early on and off; and the numpy attention."""
    KV, kc, vc, table, max_pages = sequences(rng, DEPTHS, hkv, d, "f16")
    rows = len(DEPTHS) + 1
    pos = np.array(DEPTHS + [7], np.int32)
    seq = np.array(list(range(len(DEPTHS))) + [-1], np.int32)
    q = rng.standard_normal((rows, hq, d)).astype(np.float32)
    scale = 1 / math.sqrt(d)
    for early in (False, True):
        plain, bulk = (run_decode(k, q, kc, vc, pos, seq, table, max_pages, hq, hkv, d, scale, 0.0, 0, n_split,
                                  "f16", early=early, config=config, bulk=b) for b in (False, True))
        assert (plain == bulk).all(), np.abs(plain - bulk).max()
    o = bulk.reshape(rows, hq, d)
    assert not o[-1].any()
    for i, (K, V) in enumerate(KV):
        assert rel(o[i], attention_ref(q[i:i + 1], K, V, pos[i:i + 1], scale, 0.0, 0)[0]) < BAR


@pytest.mark.parametrize("d,hq,hkv", [(64, 9, 3), (128, 32, 8)])
def test_flash_decode_per_row_packed(d, hq, hkv, rng):
    """per_row (speculative verification: each row split as a one-row step splits it) in a packed
    grid (the rows' blocks numbered in grid.y, those with keys first) gives the (kv head, split,
    row) grid's bits: rows at uneven depths and a padding row, and consecutive positions of one
    sequence as a verification has them."""
    import dataclasses

    KV, kc, vc, table, max_pages = sequences(rng, DEPTHS, hkv, d, "f16")
    rows = len(DEPTHS) + 1
    pos = np.array(DEPTHS + [7], np.int32)
    seq = np.array(list(range(len(DEPTHS))) + [-1], np.int32)
    table = np.concatenate([table, np.full((1, max_pages), -1, np.int32)])
    q = rng.standard_normal((rows, hq, d)).astype(np.float32)
    scale = 1 / math.sqrt(d)
    chain = np.arange(2490, 2498, dtype=np.int32)  # 8 rows of the 2,500-key sequence
    chain_seq = np.full(8, len(DEPTHS) - 1, np.int32)
    for p_, s_, q_ in ((pos, seq, q), (chain, chain_seq, q[:8])):
        outs = [run_decode(L.Kernels(dataclasses.replace(Tuning(), sm_count=132, decode_packed=packed).knobs()), q_,
                           kc, vc, p_, s_, table, max_pages, hq, hkv, d, scale, 0.0, 0, 32, "f16", per_row=True)
                for packed in (True, False)]
        assert (outs[0] == outs[1]).all(), np.abs(outs[0] - outs[1]).max()
    o = outs[0].reshape(8, hq, d)
    K, V = KV[-1]
    for i in range(8):
        assert rel(o[i], attention_ref(q[i:i + 1], K, V, chain[i:i + 1], scale, 0.0, 0)[0]) < BAR


def test_flash_decode_smem_fits():
    for d in LA.FLASH_HEAD_DIMS:
        for kv in KL.KV_TYPES:
            assert LA.decode_smem(d, LA.decode_config(d, kv), kv) <= SMEM_MAX


@pytest.mark.parametrize("kv", KL.KV_TYPES)
@pytest.mark.parametrize("window", [0, 300])
def test_flash_decode_work_split(kv, window, rng):
    """Splits from the step's total keys for 132 SMs (the tuning table's choice): one long row
    among short ones takes many blocks, the short ones one each, a padding row none of the keys;
    the same attention. The blocks numbered row by row in grid.y (decode_packed, the rule) give
    the bits of the grid of n_split blocks a row, with and without a window."""
    import dataclasses

    d, hq, hkv = 128, 32, 8
    depths = [9000, 3, 40, 700, 129, 2000]
    KV, kc, vc, table, max_pages = sequences(rng, depths, hkv, d, kv)
    rows = len(depths) + 1
    pos = np.array(depths + [11], np.int32)
    seq = np.array(list(range(len(depths))) + [-1], np.int32)
    table = np.concatenate([table, np.full((1, max_pages), -1, np.int32)])
    q = rng.standard_normal((rows, hq, d)).astype(np.float32)
    scale = 1 / math.sqrt(d)
    outs = []
    for packed in (True, False):
        kw = L.Kernels(dataclasses.replace(Tuning(), sm_count=132, decode_packed=packed).knobs())
        outs.append(run_decode(kw, q, kc, vc, pos, seq, table, max_pages, hq, hkv, d, scale, 0.0, window, 32, kv,
                               early=True))
    assert (outs[0] == outs[1]).all(), np.abs(outs[0] - outs[1]).max()
    o = outs[0].reshape(rows, hq, d)
    assert not o[-1].any()
    for i, (K, V) in enumerate(KV):
        assert rel(o[i], attention_ref(q[i:i + 1], K, V, pos[i:i + 1], scale, 0.0, window)[0]) < BAR


@pytest.mark.parametrize("kv", ["f16", "q8_0"])
@pytest.mark.parametrize("hkv", [4, 8])
def test_flash_decode_fit_rounds(kv, hkv, rng):
    """decode_fit (the table's threshold): a row split alone whose KV head's partials hold at least
    decode_fit floats (its query heads x head dim: Qwen3-30B-A3B's 8 x 128, not the 8B's 4 x 128)
    takes the fewest splits that give its warps as many rounds of tiles as min(n_split, keys /
    min_keys) splits would (depth 4100, 32 splits of 8 warps: 17), the other splits' partials left
    as they were (poison); below the threshold, or with decode_fit 0, about min(n_split, keys /
    min_keys) of them (each count taken again from the tiles a split then takes). All equal the
    reference."""
    import dataclasses

    d, hq, n_split = 128, 32, 32
    depths = [4100, 9000, 700]
    KV, kc, vc, table, max_pages = sequences(rng, depths, hkv, d, kv)
    pos = np.array(depths, np.int32)
    seq = np.arange(len(depths), dtype=np.int32)
    q = rng.standard_normal((len(depths), hq, d)).astype(np.float32)
    scale = 1 / math.sqrt(d)
    refs = [attention_ref(q[i:i + 1], K, V, pos[i:i + 1], scale, 0.0, 0)[0] for i, (K, V) in enumerate(KV)]
    counts = {}
    for threshold in (Tuning().decode_fit, 0):
        kw = L.Kernels(dataclasses.replace(Tuning(), decode_fit=threshold).knobs())
        fit = threshold > 0 and hq // hkv * d >= threshold
        nw, kt, _ = cfg = LA.decode_config(d, kv, kw.knobs.decode)
        min_keys = LA.decode_min_keys(d, cfg, kv)
        ml = []
        o = run_decode(kw, q, kc, vc, pos, seq, table, max_pages, hq, hkv, d, scale, 0.0, 0, n_split, kv,
                       early=True, ml=ml).reshape(len(depths), hq, d)
        counts[threshold] = []
        for i, p in enumerate(depths):
            nt = -(-(p + 1) // kt)
            ns = min(n_split, -(-(p + 1) // min_keys))
            if fit:
                rounds = -(-(-(-nt // ns)) // nw)
                ns = -(-nt // (rounds * nw))
            ns = -(-(p + 1) // (-(-nt // ns) * kt))  # counted again from the tiles a split takes
            sums = ml[0][i, :, :, 1]  # (heads, splits): POISON (NaN) where no split wrote
            written, untouched = int((~np.isnan(sums)).all(axis=0).sum()), int(np.isnan(sums).all(axis=0).sum())
            assert (written, untouched) == (ns, n_split - ns), (threshold, p, written, untouched, ns)
            assert rel(o[i], refs[i]) < BAR, (threshold, p)
            counts[threshold].append(ns)
    assert counts[0][:2] == [29, 32], counts  # no fit: 144- and 288-key splits
    assert counts[Tuning().decode_fit][:2] == ([17, 24] if hkv == 4 else [29, 32]), counts


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
@pytest.mark.parametrize("d,hq,hkv", [(64, 9, 3), (128, 32, 8)])
@pytest.mark.parametrize("n_split", [1, 4, 32])
def test_flash_decode_own_row(k, kv, d, hq, hkv, n_split, rng):
    """own: each row's own key and value are not in the cache yet (their bytes there are poison) but
    in its QKV row (float32); the kernel quantizes them into the cache. The cache's bytes then
    equal the reference quantizer's (kv_layout.pack), and the outputs equal an early launch reading
    the cache that held them already, bit for bit; a padding row writes nothing, nor does a row
    whose own page is missing (it reads zeros there, as the early launch's load does)."""
    depths = [0, 5, 15, 16, 33, 300, 1000, 40]
    rows = len(depths) + 1
    pos = np.array(depths + [7], np.int32)
    seq = np.array(list(range(len(depths))) + [-1], np.int32)
    need = [p // PAGE + 1 for p in depths]
    max_pages, n_pages = max(need), sum(need) + 3
    order = rng.permutation(n_pages).astype(np.int32)
    table = np.full((rows, max_pages), -1, np.int32)
    at = 0
    for s, n in enumerate(need):
        table[s, :n] = order[at:at + n]
        at += n
    table[len(depths) - 1, need[-1] - 1] = -1  # the last row's own page is missing
    kf = rng.standard_normal((n_pages, hkv, PAGE, d)).astype(np.float32)
    vf = rng.standard_normal((n_pages, hkv, PAGE, d)).astype(np.float32)
    kc, vc = KL.pack(kf, kv), KL.pack(vf, kv)  # the caches holding every row, own ones too
    ld = (hq + 2 * hkv) * d
    qkv = rng.standard_normal((rows, ld)).astype(np.float32)
    vb, sb = KL.row_bytes(kv, d)
    kp, vp = kc.copy(), vc.copy()  # ... and with the own rows' bytes poisoned
    for s, p in enumerate(depths):
        page, slot = table[s, p // PAGE], p % PAGE
        if page < 0:
            continue
        qkv[s, hq * d:(hq + hkv) * d] = kf[page, :, slot].reshape(-1)
        qkv[s, (hq + hkv) * d:] = vf[page, :, slot].reshape(-1)
        for c in (kp, vp):
            c[page, :, slot * vb:(slot + 1) * vb] = 0x7F
            c[page, :, PAGE * vb + slot * sb:PAGE * vb + (slot + 1) * sb] = 0xFF  # f16 NaN scales

    def launch(kcache, vcache, own):
        out = cp.full((rows, hq * d), POISON, cp.float32)
        part_o = cp.full(rows * hq * n_split * d, POISON, cp.float32)
        part_ml = cp.full(rows * hq * n_split * 2, POISON, cp.float32)
        counter = cp.zeros(rows * hkv, cp.uint32)
        qd, posd, seqd, tabd = (cp.asarray(a) for a in (qkv, pos, seq, table))
        LA.flash_decode(k, qd.data.ptr, ld, rows, kcache.data.ptr, vcache.data.ptr, posd.data.ptr, seqd.data.ptr,
                        tabd.data.ptr, max_pages, PAGE, hq, hkv, d, 1 / math.sqrt(d), 0.0, 0, n_split,
                        part_o.data.ptr, part_ml.data.ptr, counter.data.ptr, out.data.ptr, hq * d, early=True,
                        kv=kv, own=(qd.data.ptr, ld) if own else None)
        cp.cuda.Device().synchronize()
        return out.get()

    ref = launch(cp.asarray(kc), cp.asarray(vc), False)
    kd, vd = cp.asarray(kp), cp.asarray(vp)
    got = launch(kd, vd, True)
    assert np.isfinite(ref).all() and (got == ref).all()
    assert (kd.get() == kc).all() and (vd.get() == vc).all(), "the own rows' bytes as the reference quantizer's"


@pytest.mark.parametrize("d,hq,hkv,n_rot", [(64, 9, 3, 64), (128, 32, 8, 128), (128, 32, 4, 64), (256, 8, 2, 256)])
@pytest.mark.parametrize("neox,norms", [(False, False), (True, True), (False, True)])
@pytest.mark.parametrize("n_split,sms", [(1, 0), (4, 0), (32, 0), (32, 132)])
def test_flash_decode_rope(d, hq, hkv, n_rot, neox, norms, n_split, sms, rng):
    """rope (f16 caches): q, k and v are raw QKV rows and flash_decode does rope_kv's work (QK norms,
    RoPE of the first n_rot dimensions in pairs or NEOX halves, the keys and values into the cache,
    whose own rows are poison before). Against rope_kv then an early launch: the same cache bytes and
    the same outputs, bit for bit; a padding row writes nothing, and a row whose own page is missing
    is left as rope_kv leaves it (q unrotated, nothing written) and reads zeros there, as the load does."""
    import dataclasses

    depths = [0, 5, 15, 16, 33, 300, 1000, 40]
    rows = len(depths) + 1
    pos = np.array(depths + [7], np.int32)
    seq = np.array(list(range(len(depths))) + [-1], np.int32)
    need = [p // PAGE + 1 for p in depths]
    max_pages, n_pages = max(need), sum(need) + 3
    order = rng.permutation(n_pages).astype(np.int32)
    table = np.full((rows, max_pages), -1, np.int32)
    at = 0
    for s, n in enumerate(need):
        table[s, :n] = order[at:at + n]
        at += n
    table[len(depths) - 1, need[-1] - 1] = -1  # the last row's own page is missing
    kc = rng.standard_normal((n_pages, hkv, PAGE, d)).astype(np.float16)
    vc = rng.standard_normal((n_pages, hkv, PAGE, d)).astype(np.float16)
    for s, p in enumerate(depths):  # the own rows: poison until written
        if table[s, p // PAGE] >= 0:
            kc[table[s, p // PAGE], :, p % PAGE] = vc[table[s, p // PAGE], :, p % PAGE] = np.float16(np.nan)
    ld = (hq + 2 * hkv) * d
    qkv = (rng.standard_normal((rows, ld)) * 3).astype(np.float32)
    inv_freq = cp.asarray(10000.0 ** (-np.arange(0, n_rot, 2) / n_rot))
    qnw = cp.asarray(rng.uniform(0.5, 1.5, d).astype(np.float32)) if norms else None
    knw = cp.asarray(rng.uniform(0.5, 1.5, d).astype(np.float32)) if norms else None
    kw = L.Kernels(dataclasses.replace(Tuning(), sm_count=sms).knobs())

    def launch(fold):
        qd, kd, vd, posd, seqd, tabd = (cp.asarray(a) for a in (qkv, kc, vc, pos, seq, table))
        rope = L.RopeKV(qd.data.ptr, ld, hq, hkv, d, d, n_rot, neox, qnw.data.ptr if norms else None,
                        knw.data.ptr if norms else None, 1e-6, inv_freq.data.ptr, posd.data.ptr, seqd.data.ptr,
                        tabd.data.ptr, max_pages, PAGE, kd.data.ptr, vd.data.ptr, "f16")
        if not fold:
            rope.launch(kw, 0, rows)
        out = cp.full((rows, hq * d), POISON, cp.float32)
        part_o = cp.full(rows * hq * n_split * d, POISON, cp.float32)
        part_ml = cp.full(rows * hq * n_split * 2, POISON, cp.float32)
        counter = cp.zeros(rows * hkv, cp.uint32)
        LA.flash_decode(kw, qd.data.ptr, ld, rows, kd.data.ptr, vd.data.ptr, posd.data.ptr, seqd.data.ptr,
                        tabd.data.ptr, max_pages, PAGE, hq, hkv, d, 1 / math.sqrt(d), 0.0, 0, n_split,
                        part_o.data.ptr, part_ml.data.ptr, counter.data.ptr, out.data.ptr, hq * d, early=True,
                        kv="f16", rope=rope if fold else None)
        cp.cuda.Device().synchronize()
        return out.get(), kd.get(), vd.get()

    ref, got = launch(False), launch(True)
    assert np.isfinite(ref[0]).all() and not ref[0][-1].any()
    assert (got[0] == ref[0]).all(), np.abs(got[0] - ref[0]).max()
    for a, b in zip(got[1:], ref[1:]):  # the caches' bytes (the poison of never-written rows included)
        assert (a.view(np.uint16) == b.view(np.uint16)).all()
    assert not np.isnan(ref[1][table[0, 0], :, 0]).any(), "rope_kv wrote the own rows"
