"""Token grids (launchers.token_grid / token_groups, matvec.cu): a matvec of b tokens launched as
b one-token products side by side, or as b / t products of t tokens (token groups). Each token's outputs (rows, the int8 copies a q8 epilogue writes, RoPE'd rows
and the KV cache) must equal a one-token launch on that token's rows bit for bit: that is what makes
a speculative verification row a decode step's row. Outputs poisoned; inputs fresh and random.
"""

import dataclasses

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from gguf_runtime.backends.cuda.tuning import Tuning  # noqa: E402
from gguf_runtime.quant_kernels import launchers as L  # noqa: E402
from test_gpu_kernels import POISON, cols_for, upload  # noqa: E402
from test_gpu_q8 import Q8Buf, quantized  # noqa: E402

TOKENS = pytest.mark.parametrize("b", [2, 3, 4, 8])


@pytest.fixture(scope="module", params=[0, 2, 4, -1], ids=["one-token", "groups-of-2", "groups-of-4", "wide-rows"])
def kernels(request):
    """(one-token launches, token grids up to 8 tokens: of one-token blocks, or of blocks of 2 or 4
    tokens wherever that divides b; or, wide-rows, the verification's shapes: the rule's grids with
    wider row groups, launchers.mmv_config's several)."""
    wide = request.param < 0
    grid = dataclasses.replace(Tuning(), mmv_token_grid=8, mmv_grid_tokens=max(request.param, 0),
                               mmv_wide_rows="all" if wide else "off")
    return L.Kernels(Tuning().knobs()), L.Kernels(grid.knobs())


def equal(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and np.array_equal(a, b, equal_nan=True), what


@TOKENS
@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q4_K"])
def test_f32_product_with_fused_norm_and_bias(kernels, name, b, rng):
    k1, kg = kernels
    keep = []
    cols = cols_for(name, 2)
    mats = [upload(name, n, cols, rng, keep) for n in (128, 64, 64)]
    assert L.token_grid(kg, b, 256, 256 * cols, 2, 1, 0) == b
    x = cp.asarray(rng.standard_normal((b, cols)).astype(np.float32))
    nw = cp.asarray((1 + 0.2 * rng.standard_normal(cols)).astype(np.float32))
    bias = [cp.asarray(rng.standard_normal(m.rows).astype(np.float32)) for m, _ in mats]
    outs = []
    for grid in (False, True):
        y = cp.full((b, 256 + 8), POISON, cp.float32)
        offs = (0, 128, 192)
        if grid:
            L.mmv(kg, [m for m, _ in mats], [(y.data.ptr + 4 * o, y.shape[1]) for o in offs],
                  [c.data.ptr for c in bias], x.data.ptr, cols, b, 0, norm=(nw.data.ptr, 1e-5))
        else:
            for t in range(b):
                L.mmv(k1, [m for m, _ in mats], [(y.data.ptr + 4 * (t * y.shape[1] + o), y.shape[1]) for o in offs],
                      [c.data.ptr for c in bias], x.data.ptr + 4 * t * cols, cols, 1, 0, norm=(nw.data.ptr, 1e-5))
        outs.append(y.get())
    equal(outs[1], outs[0], "grid vs one-token launches")
    assert np.isnan(outs[1][:, 256:]).all() and np.isfinite(outs[1][:, :256]).all()


@TOKENS
@pytest.mark.parametrize("rest", [False, True])
@pytest.mark.parametrize("name", ["Q4_1", "Q4_K"])
def test_residual_q8_epilogue(kernels, name, rest, b, rng):
    """y += W a from int8 activations, with the q8 epilogue's int8 copy of y times w."""
    k1, kg = kernels
    keep = []
    rows = 256 if name == "Q4_K" else 96
    cols = cols_for(name)
    m, _ = upload(name, rows, cols, rng, keep)
    a = (rng.standard_normal((b, cols)) * 2).astype(np.float32)
    abuf, _ = quantized(k1, a, keep, rest)
    y0 = rng.standard_normal((b, rows)).astype(np.float32)
    nw = cp.asarray((1 + 0.3 * rng.standard_normal(rows)).astype(np.float32))
    outs = []
    for grid in (False, True):
        yd, out = cp.asarray(y0), Q8Buf(b, rows, rest)
        if grid:
            L.mmv(kg, [m], [(yd.data.ptr, rows)], [None], 0, cols, b, 1, q8=abuf.vec, q8_out=(out.vec, nw.data.ptr))
        else:
            for t in range(b):
                L.mmv(k1, [m], [(yd.data.ptr + 4 * t * rows, rows)], [None], 0, cols, 1, 1,
                      q8=abuf.vec.rows_from(t), q8_out=(out.vec.rows_from(t), nw.data.ptr))
        outs.append((yd.get(), out.q.get(), out.s.get()))
    for got, want, what in zip(outs[1], outs[0], ("y", "int8 copy", "scales")):
        equal(got, want, what)
    assert not np.array_equal(outs[1][0], y0)


@TOKENS
@pytest.mark.parametrize("name", ["Q4_1", "Q4_K"])
def test_glu_with_q8_epilogue(kernels, name, b, rng):
    k1, kg = kernels
    keep = []
    rows, cols = 64, cols_for(name)
    (g, _), (u, _) = upload(name, rows, cols, rng, keep), upload(name, rows, cols, rng, keep)
    x = (rng.standard_normal((b, cols)) * 3).astype(np.float32)
    buf, _ = quantized(k1, x, keep)
    outs = []
    for grid in (False, True):
        y, out = cp.full((b, rows), POISON, cp.float32), Q8Buf(b, rows)
        if grid:
            L.mmv_glu(kg, g, u, 0, cols, b, "silu", y.data.ptr, rows, q8=buf.vec, q8_out=out.vec)
        else:
            for t in range(b):
                L.mmv_glu(k1, g, u, 0, cols, 1, "silu", y.data.ptr + 4 * t * rows, rows, q8=buf.vec.rows_from(t),
                          q8_out=out.vec.rows_from(t))
        outs.append((y.get(), out.q.get(), out.s.get()))
    for got, want, what in zip(outs[1], outs[0], ("y", "int8 copy", "scales")):
        equal(got, want, what)
    assert np.isfinite(outs[1][0]).all()


@TOKENS
@pytest.mark.parametrize("kv16", [False, True])
def test_qkv_with_fused_rope_and_cache_write(kernels, kv16, b, rng):
    """Q rotated in place, K and V into the paged cache at each token's position; a padding token
    (sequence -1) writes nothing."""
    k1, kg = kernels
    keep = []
    t_pos = np.array([3, 9, 30, 17, 4, 25, 11, 0][:b], np.int32)
    seq = np.zeros(b, np.int32)
    seq[1] = -1
    d, hq, hkv, cols, page = 64, 8, 2, 768, 16
    mats = [upload("Q4_1", n * d, cols, rng, keep) for n in (hq, hkv, hkv)]
    x = rng.standard_normal((b, cols)).astype(np.float32)
    buf, _ = quantized(k1, x, keep)
    pos, seqd = cp.asarray(t_pos), cp.asarray(seq)
    inv = cp.asarray(10000.0 ** (-np.arange(0, d, 2) / d))
    table = cp.asarray(np.array([[1, 0]], np.int32))
    width = (hq + 2 * hkv) * d
    outs = []
    for grid in (False, True):
        qkv = cp.full((b, width), POISON, cp.float32)
        kc, vc = (cp.full((2, hkv, page, d), POISON, cp.float16 if kv16 else cp.float32) for _ in range(2))

        def rope(t):
            return L.RopeKV(qkv.data.ptr + 4 * t * width, width, hq, hkv, d, d, d, False, None, None, 1e-6,
                            inv.data.ptr, pos.data.ptr + 4 * t, seqd.data.ptr + 4 * t, table.data.ptr, 2, page,
                            kc.data.ptr, vc.data.ptr, "f16" if kv16 else "f32")

        def outs_of(t):
            return [(qkv.data.ptr + 4 * (t * width + c), width) for c in (0, hq * d, (hq + hkv) * d)]

        if grid:
            fused = L.mmv(kg, [m for m, _ in mats], outs_of(0), [None] * 3, 0, cols, b, 0, rope=rope(0), q8=buf.vec)
        else:
            for t in range(b):
                fused = L.mmv(k1, [m for m, _ in mats], outs_of(t), [None] * 3, 0, cols, 1, 0, rope=rope(t),
                              q8=buf.vec.rows_from(t))
        assert fused
        cp.cuda.runtime.deviceSynchronize()
        outs.append((qkv.get()[:, :hq * d], kc.get(), vc.get()))
    for got, want, what in zip(outs[1], outs[0], ("Q", "K cache", "V cache")):
        equal(got, want, what)
    assert np.isfinite(outs[1][1].astype(np.float32)).sum() == (b - 1) * hkv * d  # padding wrote nothing


@pytest.mark.parametrize("b", [2, 4])
@pytest.mark.parametrize("rows,cols", [(8192, 512), (32768, 576)])
def test_many_rows_and_output_heads(kernels, rows, cols, b, rng):
    """Many row blocks from int8 activations (4 rows a group): 8,192 x 512 runs as a grid, a
    vocabulary-sized head (past GRID_MAX_WEIGHTS) as b-token chunks, each equal to one-token launches."""
    k1, kg = kernels
    keep = []
    m, _ = upload("Q8_0", rows, cols, rng, keep)
    assert (L.token_grid(kg, b, rows, rows * cols, 4, 1, 1) > 1) == (rows * cols <= L.GRID_MAX_WEIGHTS)
    x = rng.standard_normal((b, cols)).astype(np.float32)
    buf, _ = quantized(k1, x, keep)
    outs = []
    for grid in (False, True):
        y = cp.full((b, rows), POISON, cp.float32)
        if grid:
            L.mmv(kg, [m], [(y.data.ptr, rows)], [None], 0, cols, b, 0, q8=buf.vec)
        else:
            for t in range(b):
                L.mmv(k1, [m], [(y.data.ptr + 4 * t * rows, rows)], [None], 0, cols, 1, 0, q8=buf.vec.rows_from(t))
        outs.append(y.get())
    equal(outs[1], outs[0], "rows")
    assert np.isfinite(outs[1]).all()


def test_token_grid_choice():
    """Only where the knob allows b, for matrices up to GRID_MAX_WEIGHTS, within CUDA's limit on
    gridDim.y and one wave of the GPU (two for 8 tokens)."""
    kg = L.Kernels(dataclasses.replace(Tuning(), mmv_token_grid=4).knobs())
    k0 = L.Kernels(Tuning().knobs())
    w = 1 << 20
    assert L.token_grid(kg, 4, 1024, w, 2, 1, 0) == 4
    assert L.token_grid(kg, 5, 1024, w, 2, 1, 0) == 1  # past the knob
    assert L.token_grid(kg, 1, 1024, w, 2, 1, 0) == 1
    assert L.token_grid(k0, 2, 1024, w, 2, 1, 0) == 1  # off
    assert L.token_grid(kg, 2, 1024, L.GRID_MAX_WEIGHTS + 1, 2, 1, 0) == 1  # a head's bytes: read once
    assert L.token_grid(kg, 2, 8, w, 2, 1, 0) == 2  # one block of 8 rows
    assert L.token_grid(kg, 2, 4 * 70000, w, 1, 1, 0) == 1  # past gridDim.y's limit
    # one wave: 132 SMs x 32 warps; a q8 epilogue's blocks (io 3) of 16 rows take 16 WG / R warps
    k132 = L.Kernels(dataclasses.replace(Tuning(), mmv_token_grid=8, sm_count=132, mmv_grid_groups=False).knobs())
    assert L.token_grid(k132, 4, 960, w, 2, 1, 1) == 4  # 120 blocks of 4 warps
    assert L.token_grid(k132, 4, 1536, w, 1, 1, 3) == 1  # 96 blocks of 16 warps: 6,144 warps
    assert L.token_grid(k132, 2, 1536, w, 1, 1, 3) == 2  # 3,072
    assert L.token_grid(k132, 4, 576, w, 1, 2, 3) == 1  # 36 blocks of 32 warps: 4,608
    # 8 tokens may take two waves (the tuning table's mmv_grid_waves 1:2)
    assert L.token_grid(k132, 8, 960, w, 1, 1, 3) == 8  # 60 blocks of 16 warps: 7,680
    assert L.token_grid(k132, 8, 1536, w, 1, 1, 3) == 1  # 12,288
    k1w = L.Kernels(dataclasses.replace(Tuning(), mmv_token_grid=8, sm_count=132, mmv_grid_waves=(1, 1)).knobs())
    assert L.token_grid(k1w, 8, 960, w, 1, 1, 3) == 1
    # token groups (grid_groups): where one-token blocks do not fit, the fewest tokens a block that do
    kgg = L.Kernels(dataclasses.replace(Tuning(), mmv_token_grid=8, sm_count=132, mmv_grid_groups=True).knobs())
    one = lambda t: (1, 1)  # noqa: E731  (the shape whatever the tokens: 16 warps a block of 16 rows)
    assert L.token_groups(k132, 8, 1536, w, one, 3) == 1  # off: 8 one-token blocks do not fit
    assert L.token_groups(kgg, 8, 1536, w, one, 3) == 4  # 4 x 1,536 warps: two waves (8 tokens)
    assert L.token_groups(kgg, 8, 3072, w, one, 3) == 2  # 4 x 3,072 warps would not fit two; 2 x
    assert L.token_groups(kgg, 8, 960, w, one, 3) == 8  # one-token blocks fit (two waves for 8 tokens)
    assert L.token_groups(kgg, 4, 1536, w, one, 3) == 2  # 2 x 1,536 warps
    assert L.token_groups(kgg, 3, 1536, w, one, 3) == 1  # 3 tokens: no group divides them
    kt = L.Kernels(dataclasses.replace(Tuning(), mmv_token_grid=8, mmv_grid_tokens=2).knobs())
    assert L.token_groups(kt, 8, 1 << 16, w, one, 3) == 4 and L.token_groups(kt, 3, 256, w, one, 3) == 3


def test_wide_rows_keep_one_tokens_warps():
    """mmv_config / glu_q8_out_config with ``several`` (verification's matvecs): wider row groups but
    one token's WG, which fixes each row's order of sums; on the small models' shapes (lone matrices
    under 2,048 rows with and without the q8 epilogue, output heads, GLUs) and at every token count."""
    shapes = [(["TQ4_1"], [576], 576), (["TQ4_1"], [576], 1536), (["TQ8_0"], [640], 2048),
              (["TQ4_K"], [640], 1024), (["TQ8_0"], [49152], 576), (["TQ6_K"], [262144], 640)]
    for structs, rows, cols in shapes:
        for q8_out in (False, True):
            if q8_out and rows[0] >= 32768:
                continue
            one = L.mmv_config(structs, rows, cols, 1, q8_out)
            for b in (1, 2, 4, 8):
                r, wg = L.mmv_config(structs, rows, cols, b, q8_out, several=True)
                assert wg == one[1] and r in (1, 2, 4) and all(n % (4 * r) == 0 for n in rows), \
                    (structs, rows, cols, b, q8_out, r, wg)
    for struct, n, cols in (("TQ4_1", 1536, 576), ("TQ8_0", 2048, 640), ("TQ4_K", 14336, 4096)):
        one = L.glu_q8_out_config(struct, n, cols, 1)
        for b in (2, 4, 8):
            old = L.glu_q8_out_config(struct, n, cols, b)
            r, wg = L.glu_q8_out_config(struct, n, cols, b, several=True)
            assert wg == old[1] and r in (2, 4)
            if cols < 4096:
                assert wg == one[1] and r == 4
