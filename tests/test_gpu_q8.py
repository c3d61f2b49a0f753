"""The int8-activation (q8, dp4a) matvec path against numpy, on fresh random inputs, outputs poisoned.

The q8 kernels compute W x' exactly up to f32 rounding, where x' = dequantize_q8(quantize_q8(x))
(reference_q8.py mirrors the kernels' quantizer bit for bit): so they are held to the f32 bound
(1e-5) against W x' in float64, and to a loose bound against W x (the quantization itself). With
rests (``rest``: Tuning.q8_res) x' = dequantize_q8_rest(quantize_q8_rest(x)), every writer and
reader of the int8 copies likewise.
"""

import dataclasses

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from gguf_runtime.engine.decode_loop import sample_loop  # noqa: E402
from gguf_runtime.backends.numpy.backend import silu  # noqa: E402
from gguf_runtime.quant_kernels import launch_attention as LA  # noqa: E402
from gguf_runtime.quant_kernels import launchers as L  # noqa: E402
from gguf_runtime.backends.cuda.tuning import Tuning  # noqa: E402
from gguf_runtime.quant_kernels import launch_layers as LL  # noqa: E402
from gguf_runtime.quant_kernels.formats import BY_NAME, FORMATS, SUPPORTED  # noqa: E402
from gguf_runtime.quant_kernels.reference_q8 import (dequantize_q8, dequantize_q8_rest, quantize_q8,  # noqa: E402
                                                     quantize_q8_rest)
from path_model import assert_all_rows  # noqa: E402
from test_gpu_backend import F32, Q8  # noqa: E402
from twin_files import twin_path  # noqa: E402
from test_gpu_kernels import POISON, cols_for, rel, upload  # noqa: E402

INT_TYPES = [n for n in SUPPORTED if n not in ("F32", "F16", "BF16")]
REST = pytest.mark.parametrize("rest", [False, True], ids=["q8", "q8_rest"])
Q8_REST = dict(cos_gap=1e-6, max_rel=3e-3)  # measured 1.5e-7 / 5.7e-4 (int8 alone 1.5e-4 / 1.8e-2; H100)


@pytest.fixture(scope="module")
def k():
    return L.Kernels(Tuning().knobs())  # the launch choices the backend makes


class Q8Buf:
    """A poisoned int8 activation buffer of rows x cols (q8 layout of Workspace); rest: each row's
    second part (from cols + 16) holds the rests' int8."""

    def __init__(self, rows, cols, rest=False):
        self.res = cols + 16 if rest else 0
        self.q = cp.full((rows, (cols + 16) * (2 if rest else 1)), 0x7F, cp.int8)
        self.s = cp.full((rows, cols // 16 + 1, 4), POISON, cp.float32)
        self.vec = L.Q8Vec(self.q.data.ptr, self.q.shape[1], self.s.data.ptr, self.s.shape[1], res=self.res)
        self.cols = cols

    def get(self):
        """(q, d, s, sum of squares) of the written columns, then with rests (q2, d2)."""
        s = self.s.get()[:, :self.cols // 16]
        q = self.q.get()
        out = (q[:, :self.cols], s[..., 0], s[..., 1], s[..., 2])
        return out + ((q[:, self.res:self.res + self.cols], s[..., 3]) if self.res else ())

    def untouched(self):
        """Whether nothing was written past the columns (and past the rests' columns)."""
        q = self.q.get()
        pads = [q[:, self.cols:self.cols + 16]] + ([q[:, self.res + self.cols:]] if self.res else [])
        return all((p == 0x7F).all() for p in pads) and np.isnan(self.s.get()[:, self.cols // 16]).all()


def piece_ssq(v):
    v = np.asarray(v, np.float64)
    return (v.reshape(*v.shape[:-1], -1, 16) ** 2).sum(-1)


def check_q8(buf, v, ssq_of=None):
    """buf holds quantize_q8(v) (with rests: quantize_q8_rest(v)) bit for bit, and the pieces'
    squares of ssq_of (default v)."""
    got = buf.get()
    q, d, s, ssq = got[:4]
    want = quantize_q8_rest(v) if buf.res else quantize_q8(v)
    assert (q == want[0]).all() and (d == want[1]).all()
    np.testing.assert_allclose(s, want[2], rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(ssq, piece_ssq(v if ssq_of is None else ssq_of), rtol=1e-5, atol=1e-30)
    if buf.res:
        assert (got[4] == want[3]).all() and (got[5] == want[4]).all()


def seen(v, rest):
    """v as the int8 matvecs multiply it (float64)."""
    if rest:
        q, d, _, q2, d2 = quantize_q8_rest(v)
        return dequantize_q8_rest(q, d, q2, d2)
    return dequantize_q8(*quantize_q8(v)[:2])


def quantized(k, x, keep, rest=False):
    """x (float32 rows x cols) quantized on the GPU by quantize_q8; checked against numpy bit for bit."""
    xd = cp.asarray(x)
    keep.append(xd)
    buf = Q8Buf(*x.shape, rest=rest)
    LL.quantize_q8(k, xd.data.ptr, x.shape[1], x.shape[1], x.shape[0], buf.vec)
    check_q8(buf, x)
    keep.append(buf)
    return buf, seen(x, rest)


@REST
def test_quantize_q8_matches_numpy(k, rest, rng):
    x = (rng.standard_normal((5, 4096 + 16)) * 3).astype(np.float32)
    x[2, 32:48] = 0  # a zero piece
    x[3, 64:80] = np.float32(1e-35)  # under the amax floor
    x[4, 100] = 400.0  # an outlier: its piece's other values keep few steps (what rests are for)
    keep = []
    buf, xd = quantized(k, x, keep, rest)
    err = rel(xd, x)
    assert err < (1e-4 if rest else 1e-2)  # ~0.3% for int8 steps of max / 127; rests: ~1e-5
    assert rest or err > 1e-3  # the bound is not loose enough to pass either way
    assert buf.untouched(), "wrote past the columns"


@REST
@pytest.mark.parametrize("n", [4096, 5200])  # one float4 per thread; 1,300 float4s over 1,024 threads
def test_rmsnorm_int8_copy(k, n, rest, rng):
    """rmsnorm's int8 copy is quantize_q8 of its own f32 output, bit for bit."""
    x = (rng.standard_normal((3, n)) * np.array([[1.0], [0.01], [1e-3]])).astype(np.float32)  # ms down to eps
    w = (1 + 0.3 * rng.standard_normal(n)).astype(np.float32)
    xd, wd = cp.asarray(x), cp.asarray(w)
    y = cp.full((3, n), POISON, cp.float32)
    buf = Q8Buf(3, n, rest)
    LL.rmsnorm(k, xd.data.ptr, n, wd.data.ptr, y.data.ptr, n, 3, n, 1e-5, q8=buf.vec)
    assert buf.untouched()
    for r, want in enumerate(rmsnorm_np(x, w, 1e-5)):
        assert rel(y.get()[r], want) < 1e-5, r
    check_q8(buf, y.get())


@REST
@pytest.mark.parametrize("b,n", [(1, 640), (3, 640), (2, 5216)])  # 5,216: 1,304 float4s over 1,024 threads
def test_post_norm_residual_then_normed_consumer(k, b, n, rest, rng):
    """Gemma-3's post-norm in place (x += rmsnorm(o) w) with w2, the next norm's weight: the int8
    copy is of x * w2 with x's squares, bit for bit, and a matvec fed it with norm_eps computes
    V rmsnorm(x) w2."""
    keep = []
    o = rng.standard_normal((b, n)).astype(np.float32)
    x0 = rng.standard_normal((b, n)).astype(np.float32)
    w, w2 = ((1 + 0.3 * rng.standard_normal(n)).astype(np.float32) for _ in range(2))
    od, xd, wd, w2d = (cp.asarray(a) for a in (o, x0, w, w2))
    buf = Q8Buf(b, n, rest)
    LL.rmsnorm(k, od.data.ptr, n, wd.data.ptr, xd.data.ptr, n, b, n, 1e-6, xd.data.ptr, n, q8=buf.vec, w2=w2d.data.ptr)
    x1 = xd.get()
    assert rel(x1, x0 + rmsnorm_np(o, w, 1e-6)) < 1e-5
    check_q8(buf, x1 * w2, ssq_of=x1)
    v, wv = upload("Q5_0", 64, n, rng, keep)  # Gemma-3's QKV type
    z = cp.full((b, 64), POISON, cp.float32)
    L.mmv(k, [v], [(z.data.ptr, 64)], [None], 0, n, b, 0, q8=dataclasses.replace(buf.vec, norm_eps=1e-6))
    hq = seen(x1 * w2, rest)
    scale = 1 / np.sqrt((x1.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)
    assert rel(z.get(), (hq @ wv.T) * scale) < 1e-5


def rmsnorm_np(x, w, eps):
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + eps) * w).astype(np.float32)


@REST
@pytest.mark.parametrize("name", INT_TYPES)
@pytest.mark.parametrize("b", [1, 3, 8])
def test_mmv_q8_every_type(k, name, b, rest, rng):
    keep = []
    rows, cols = 72, cols_for(name)
    m, w = upload(name, rows, cols, rng, keep)
    x = rng.standard_normal((b, cols)).astype(np.float32)
    buf, xq = quantized(k, x, keep, rest)
    bias = rng.standard_normal(rows).astype(np.float32)
    bd = cp.asarray(bias)
    y = cp.full((b, rows + 5), POISON, cp.float32)
    L.mmv(k, [m], [(y.data.ptr, y.shape[1])], [bd.data.ptr], 0, cols, b, 0, q8=buf.vec)
    got = y.get()
    assert rel(got[:, :rows], xq @ w.T + bias) < 1e-5
    assert rel(got[:, :rows], x.astype(np.float64) @ w.T + bias) < (1e-4 if rest else 2e-2)  # int8: ~3e-3
    assert np.isnan(got[:, rows:]).all(), "wrote past the rows"
    y0 = rng.standard_normal((b, rows)).astype(np.float32)  # residual mode, with the bias
    yd = cp.asarray(y0)
    L.mmv(k, [m], [(yd.data.ptr, rows)], [bd.data.ptr], 0, cols, b, 1, q8=buf.vec)
    assert rel(yd.get(), y0 + xq @ w.T + bias) < 1e-5


@REST
@pytest.mark.parametrize("config", [None, (1, 1), (4, 1), (1, 4), (2, 2)])
def test_mmv_q8_configs_mixed_types(k, config, rest, rng):
    """Three matrices of different types on one x (the 8B's Q4_K/Q4_K/Q6_K QKV), every (R, WG)."""
    keep = []
    cols = 1024
    mats = [upload(n, r, cols, rng, keep) for n, r in (("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 32))]
    x = rng.standard_normal((2, cols)).astype(np.float32)
    buf, xq = quantized(k, x, keep, rest)
    ys = [cp.full((2, m.rows), POISON, cp.float32) for m, _ in mats]
    L.mmv(k, [m for m, _ in mats], [(y.data.ptr, y.shape[1]) for y in ys], [None] * 3, 0, cols, 2, 0,
          config=config, q8=buf.vec)
    for (m, w), y in zip(mats, ys):
        assert rel(y.get(), xq @ w.T) < 1e-5


@REST
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("b", [1, 4])
def test_mmv_glu_q8(k, name, b, rest, rng):
    keep = []
    rows, cols = 96, cols_for(name)
    (g, wg), (u, wu) = upload(name, rows, cols, rng, keep), upload(name, rows, cols, rng, keep)
    x = (rng.standard_normal((b, cols)) * 4).astype(np.float32)
    buf, xq = quantized(k, x, keep, rest)
    y = cp.full((b, rows), POISON, cp.float32)
    L.mmv_glu(k, g, u, 0, cols, b, "silu", y.data.ptr, rows, q8=buf.vec)
    assert rel(y.get(), silu(xq @ wg.T) * (xq @ wu.T)) < 1e-5


@REST
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q4_1"])
@pytest.mark.parametrize("b,config", [(1, None), (3, None), (8, None), (1, (1, 2)), (2, (2, 2)), (1, (4, 2)),
                                      (2, (8, 1))])
def test_residual_q8_epilogue_then_normed_consumer(k, name, b, config, rest, rng):
    """y += W a (+ a bias at odd b) with the q8 epilogue writes y * w's int8 copy and y's squares; a
    matvec fed that copy with norm_eps computes V rmsnorm(y) w, as rmsnorm then a q8 matvec would."""
    keep = []
    rows = 256 if FORMATS[BY_NAME[name]].block_elems == 256 else 96  # whole 16-row blocks; the consumer's K
    cols = cols_for(name)
    m, w = upload(name, rows, cols, rng, keep)
    size = 10.0 ** -(1.5 * (np.arange(b) % 3))[:, None]  # rows of RMS ~1, 0.03, 0.001: eps matters in the last
    a = (rng.standard_normal((b, cols)) * size).astype(np.float32)
    abuf, aq = quantized(k, a, keep, rest)
    y0 = (rng.standard_normal((b, rows)) * size).astype(np.float32)
    nw = (1 + 0.3 * rng.standard_normal(rows)).astype(np.float32)
    yd, nwd = cp.asarray(y0), cp.asarray(nw)
    bias = (rng.standard_normal(rows) * size[-1]).astype(np.float32) if b % 2 else np.zeros(rows, np.float32)
    bd = cp.asarray(bias)
    out = Q8Buf(b, rows, rest)
    L.mmv(k, [m], [(yd.data.ptr, rows)], [bd.data.ptr if b % 2 else None], 0, cols, b, 1, q8=abuf.vec,
          q8_out=(out.vec, nwd.data.ptr), config=config)
    y1 = yd.get()
    for r in range(b):
        assert rel(y1[r], y0[r] + aq[r] @ w.T + bias) < 1e-5, r
    check_q8(out, y1 * nw, ssq_of=y1)  # the kernel's own y times w, in f32: bit for bit
    assert out.untouched()
    # the consumer: V (rows2 x rows) applied to the epilogue's copy with the norm
    v, wv = upload(name, 64, rows, rng, keep)
    z = cp.full((b, 64), POISON, cp.float32)
    eps = 1e-5
    L.mmv(k, [v], [(z.data.ptr, 64)], [None], 0, rows, b, 0, q8=dataclasses.replace(out.vec, norm_eps=eps))
    hq = seen(y1 * nw, rest)
    scale = 1 / np.sqrt((y1.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps)
    for r, want in enumerate((hq @ wv.T) * scale):
        assert rel(z.get()[r], want) < 1e-5, r


@pytest.mark.parametrize("rest_in,rest_out", [(True, False), (False, True)])
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q5_0"])
def test_epilogues_with_rests_on_one_side(k, name, rest_in, rest_out, rng):
    """Rests are per role (Tuning.q8_res): a residual matvec and a GLU read their input with or
    without rests and write their outputs' int8 copy the other way (IO bits 3 and 4 apart)."""
    keep = []
    cols, rows = cols_for(name), 256 if FORMATS[BY_NAME[name]].block_elems == 256 else 96
    m, w = upload(name, rows, cols, rng, keep)
    (g, wg), (u, wu) = upload(name, rows, cols, rng, keep), upload(name, rows, cols, rng, keep)
    a = (rng.standard_normal((2, cols)) * 3).astype(np.float32)
    abuf, aq = quantized(k, a, keep, rest_in)
    y0 = rng.standard_normal((2, rows)).astype(np.float32)
    nw = (1 + 0.3 * rng.standard_normal(rows)).astype(np.float32)
    yd, nwd = cp.asarray(y0), cp.asarray(nw)
    out = Q8Buf(2, rows, rest_out)
    L.mmv(k, [m], [(yd.data.ptr, rows)], [None], 0, cols, 2, 1, q8=abuf.vec, q8_out=(out.vec, nwd.data.ptr))
    y1 = yd.get()
    assert rel(y1, y0 + aq @ w.T) < 1e-5
    check_q8(out, y1 * nw, ssq_of=y1)
    assert out.untouched()
    y = cp.full((2, rows), POISON, cp.float32)
    gout = Q8Buf(2, rows, rest_out)
    L.mmv_glu(k, g, u, 0, cols, 2, "silu", y.data.ptr, rows, q8=abuf.vec, q8_out=gout.vec)
    yv = y.get()
    assert rel(yv, silu(aq @ wg.T) * (aq @ wu.T)) < 1e-5
    check_q8(gout, yv)
    assert gout.untouched()


@pytest.mark.parametrize("b,config,cols", [(1, None, 512), (2, None, 512), (5, None, 512), (1, None, 4096),
                                           (1, (4, 1), 512), (1, (4, 2), 512), (2, (8, 1), 512)])
@REST
def test_glu_q8_epilogue(k, b, config, cols, rest, rng):
    """config: an override's rows per group (R / 2 gate and R / 2 up rows) and warps per group;
    at 4,096 columns and one token the default is two gate and two up rows per two warps."""
    keep = []
    rows = 64
    (g, wg), (u, wu) = upload("Q4_K", rows, cols, rng, keep), upload("Q4_K", rows, cols, rng, keep)
    x = (rng.standard_normal((b, cols)) * 4).astype(np.float32)
    buf, xq = quantized(k, x, keep, rest)
    y = cp.full((b, rows), POISON, cp.float32)
    out = Q8Buf(b, rows, rest)
    L.mmv_glu(k, g, u, 0, cols, b, "silu", y.data.ptr, rows, q8=buf.vec, q8_out=out.vec, config=config)
    yv = y.get()
    assert rel(yv, silu(xq @ wg.T) * (xq @ wu.T)) < 1e-5
    check_q8(out, yv)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("b,config,cols", [(1, None, 4096), (3, None, 4096), (8, None, 6144), (1, (2, 1), 4096),
                                           (2, (4, 2), 4096), (1, None, 12288)])
@REST
def test_glu_staged_scales_equal_unstaged(k, name, b, config, cols, rest, rng):
    """The GLU with its block's scales decoded into shared memory (kstage) writes the same bits as
    the one decoding them per unit, outputs and int8 copy, and matches numpy (12,288 columns: 96
    KiB of staged scales, past the default 48)."""
    assert L.kstage_bytes("T" + name, cols, 32)
    keep = []
    rows = 96  # six blocks of 16 gate and 16 up rows
    (g, wg), (u, wu) = upload(name, rows, cols, rng, keep), upload(name, rows, cols, rng, keep)
    x = (rng.standard_normal((b, cols)) * 4).astype(np.float32)
    buf, xq = quantized(k, x, keep, rest)
    got = []
    for kstage in (False, True):
        y = cp.full((b, rows), POISON, cp.float32)
        out = Q8Buf(b, rows, rest)
        L.mmv_glu(k, g, u, 0, cols, b, "silu", y.data.ptr, rows, q8=buf.vec, q8_out=out.vec, config=config,
                  kstage=kstage)
        got.append((y.get(), *out.get()))
    for a, c in zip(*got):
        np.testing.assert_array_equal(a, c)
    assert rel(got[1][0], silu(xq @ wg.T) * (xq @ wu.T)) < 1e-5


def test_kstage_bytes_only_for_k_quants_within_the_limit():
    assert L.kstage_bytes("TQ4_K", 4096, 32) == 32 * 1024 and L.kstage_bytes("TQ6_K", 14336) == 56 * 1024
    assert L.kstage_bytes("TQ4_K", 256 * 48, 32) == L.KSTAGE_MAX and not L.kstage_bytes("TQ4_K", 256 * 49, 32)
    assert L.kstage_bytes(["TQ4_K", "TQ4_K", "TQ6_K"], 4096, 8) == 8 * 1024
    assert not L.kstage_bytes(["TQ4_K", "TQ5_0"], 4096, 8) and not L.kstage_bytes("TQ4_1", 4096)
    assert not L.kstage_bytes("TQ4_K", L.KSTAGE_MIN_COLS - 256)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("b,config,cols", [(1, None, 14336), (1, None, 4096), (2, None, 4096), (8, None, 4608),
                                           (1, (1, 2), 4096), (3, (4, 2), 4096)])
@REST
def test_residual_staged_scales_equal_unstaged(k, name, b, config, cols, rest, rng):
    """y += W a with the q8 epilogue and the block's scales staged (the o-proj and down projection:
    kstage) writes the same bits as the per-unit decode, y and the int8 copy."""
    assert L.kstage_bytes("T" + name, cols)
    keep = []
    rows = 64
    m, w = upload(name, rows, cols, rng, keep)
    a = rng.standard_normal((b, cols)).astype(np.float32)
    abuf, aq = quantized(k, a, keep, rest)
    y0 = rng.standard_normal((b, rows)).astype(np.float32)
    nwd = cp.asarray((1 + 0.3 * rng.standard_normal(rows)).astype(np.float32))
    got = []
    for kstage in (False, True):
        yd = cp.asarray(y0)
        out = Q8Buf(b, rows, rest)
        L.mmv(k, [m], [(yd.data.ptr, rows)], [None], 0, cols, b, 1, q8=abuf.vec, q8_out=(out.vec, nwd.data.ptr),
              config=config, kstage=kstage)
        got.append((yd.get(), *out.get()))
    for x, y in zip(*got):
        np.testing.assert_array_equal(x, y)
    assert rel(got[1][0], y0 + aq @ w.T) < 1e-5


@pytest.mark.parametrize("names,config", [(("Q4_K", "Q4_K", "Q6_K"), None), (("Q6_K", "Q4_K", "Q4_K"), (1, 4)),
                                          (("Q6_K",), (4, 1)), (("Q4_K",), (2, 2)), (("Q6_K", "Q6_K"), (1, 1))])
@pytest.mark.parametrize("b", [1, 3, 8])
@REST
def test_mmv_staged_scales_equal_unstaged(k, names, config, b, rest, rng):
    """Q/K/V-like groups and a head-like matrix (no epilogue; 1 to 16 rows a block) with their
    blocks' scales staged (kstage) write the same bits as the per-unit decode, and match numpy."""
    keep = []
    cols = 4096
    mats = [upload(name, rows, cols, rng, keep) for name, rows in zip(names, (64, 32, 32))]
    x = rng.standard_normal((b, cols)).astype(np.float32)
    buf, xq = quantized(k, x, keep, rest)
    got = []
    for kstage in (False, True):
        ys = [cp.full((b, m.rows), POISON, cp.float32) for m, _ in mats]
        L.mmv(k, [m for m, _ in mats], [(y.data.ptr, y.shape[1]) for y in ys], [None] * len(mats), 0, cols, b, 0,
              config=config, q8=buf.vec, kstage=kstage)
        got.append([y.get() for y in ys])
    for (m, w), y0, y1 in zip(mats, *got):
        np.testing.assert_array_equal(y0, y1)
        assert rel(y1, xq @ w.T) < 1e-5


@pytest.mark.parametrize("config", [None, (2, 2)])
def test_qkv_q8_with_fused_rope_equals_f32_path_on_quantized_x(k, config, rng):
    """QKV with RoPE and the KV write fused, from int8 activations, equals the f32 path fed the
    dequantized activations x' (same cache slots, same values to f32 rounding); at two warps per
    group the f32 path runs rope_kv after the product instead. Into f16 caches (both paths) the
    keys and values are the float32 ones rounded."""
    keep = []
    t, d, hq, hkv, cols, page = 3, 64, 8, 2, 768, 16
    mats = [upload("Q4_K", n * d, cols, rng, keep) for n in (hq, hkv, hkv)]
    x = rng.standard_normal((t, cols)).astype(np.float32)
    buf, xq = quantized(k, x, keep)
    xqd = cp.asarray(xq.astype(np.float32))
    pos, seq = cp.asarray(np.array([3, 9, 30], np.int32)), cp.asarray(np.array([0, -1, 0], np.int32))
    inv = cp.asarray(10000.0 ** (-np.arange(0, d, 2) / d))
    table = cp.asarray(np.array([[1, 0]], np.int32))
    width = (hq + 2 * hkv) * d
    outs = {}
    for use_q8 in (False, True):
        for kv16 in (False, True):
            qkv = cp.full((t, width), POISON, cp.float32)
            kc, vc = (cp.full((2, hkv, page, d), POISON, cp.float16 if kv16 else cp.float32) for _ in range(2))
            rope = L.RopeKV(qkv.data.ptr, width, hq, hkv, d, d, d, False, None, None, 1e-6, inv.data.ptr,
                            pos.data.ptr, seq.data.ptr, table.data.ptr, 2, page, kc.data.ptr, vc.data.ptr,
                            "f16" if kv16 else "f32")
            L.mmv(k, [m for m, _ in mats], [(qkv.data.ptr + 4 * c, width) for c in (0, hq * d, (hq + hkv) * d)],
                  [None] * 3, xqd.data.ptr, cols, t, 0, rope=rope, q8=buf.vec if use_q8 else None, config=config)
            cp.cuda.runtime.deviceSynchronize()
            outs[use_q8, kv16] = (qkv.get()[[0, 2], :hq * d], kc.get().astype(np.float32), vc.get())
    (q0, k0, v0), (q1, k1, v1) = outs[False, False], outs[True, False]
    assert rel(q1, q0) < 1e-5
    np.testing.assert_array_equal(np.isnan(k1), np.isnan(k0))
    assert rel(np.nan_to_num(k1), np.nan_to_num(k0)) < 1e-5
    assert rel(np.nan_to_num(v1), np.nan_to_num(v0)) < 1e-5
    assert np.isfinite(k1).sum() == 2 * hkv * d  # two live rows; the padding row wrote nothing
    for use_q8 in (False, True):
        q, k32, v32 = outs[use_q8, False]
        q16, k16, v16 = outs[use_q8, True]
        assert (q16 == q).all()  # the Q rows do not depend on the cache's type
        np.testing.assert_array_equal(np.isnan(k16), np.isnan(k32))
        assert rel(np.nan_to_num(k16), np.nan_to_num(k32)) < 1e-3  # f16 rounding: 2^-11 relative
        np.testing.assert_array_equal(np.nan_to_num(v16), np.nan_to_num(v32).astype(np.float16))


# ---- the whole model on either path ---------------------------------------------------------------
@pytest.mark.parametrize("q8", ["1", "0", "res"])
def test_model_matches_numpy_and_graph_matches_eager(monkeypatch, q8, rng):
    """SmolLM2's twin with int8 activations (the default), with their rests (q8_res) and with f32
    ones and the norm fused (q8=0): logits as close to the numpy backend's as each path allows
    (test_gpu_backend's bars; rests: Q8_REST), and graph decoding gives the eager tokens exactly."""
    from gguf_runtime.backends.cuda.backend import CudaBackend
    from gguf_runtime.backends.numpy.backend import NumpyBackend
    from gguf_runtime.format.gguf_file import open_gguf
    from gguf_runtime.format.model_config import config_from_gguf
    from gguf_runtime.sampling import SamplingParams

    tune = {"1": "q8=1", "res": "q8_res=qkv+o+glu+down+head", "0": "q8=0;kv_type=f32"}[q8]  # 0: float32 throughout
    monkeypatch.setenv("GGUF_RUN_TUNE", tune)
    f = open_gguf(twin_path("smollm2"))
    cfg = config_from_gguf(f)
    npb, cub = NumpyBackend(f, cfg, 256), CudaBackend(f, cfg, 256)
    assert (cub.ws.q8_norm is not None) == (q8 != "0") and bool(cub.tune.q8_res) == (q8 == "res")
    ids = rng.integers(0, cfg.n_vocab, 7).tolist()
    ref, got = npb.eval(ids, all_logits=True), cub.eval(ids, all_logits=True)
    assert_all_rows(got, ref, what=f"smollm2 7 rows, {tune}", **{"1": Q8, "res": Q8_REST, "0": F32}[q8])
    prompt = [1, 17, 300, 4000, 9, 52]
    params = SamplingParams(temperature=0.0)
    runs = []
    for graph in (False, True):
        cub.use_graph = graph
        cub.truncate(0)
        cub.prefill(prompt)
        runs.append(list(sample_loop(cub, 24, params, prompt, frozenset())))
    assert runs[0] == runs[1]


@REST
@pytest.mark.parametrize("d,hq,hkv", [(128, 32, 8), (64, 9, 3)])
@pytest.mark.parametrize("kernel", [LA.attention, LA.flash_decode], ids=["split", "flash_decode"])
def test_attention_int8_copy(k, d, hq, hkv, kernel, rest, rng):
    """attention with q8 writes the same output and, from the block that writes it (one split or
    the merging block), its int8 copy: quantize_q8 of the output bit for bit."""
    page, n_ctx, n_split = 16, 320, 32
    max_pages = n_ctx // page
    kc, vc = (rng.standard_normal((max_pages, hkv, page, d)).astype(np.float32) for _ in range(2))
    pos = np.array([0, 5, 40, 319], np.int32)  # one split (the default shape: up to 128 keys), then 3
    t = pos.shape[0]
    q = rng.standard_normal((t, hq * d)).astype(np.float32)
    table = rng.permutation(max_pages).astype(np.int32)[None]
    qd, kd, vd, posd, seqd, tabd = (cp.asarray(a) for a in (q, kc, vc, pos, np.zeros(t, np.int32), table))
    part_o = cp.zeros(t * hq * n_split * d, cp.float32)
    part_ml = cp.zeros(t * hq * n_split * 2, cp.float32)
    counter = cp.zeros(t * hkv, cp.uint32)
    outs = []
    buf = Q8Buf(t, hq * d, rest)
    for q8 in (None, buf.vec):
        out = cp.full((t, hq * d), POISON, cp.float32)
        kernel(k, qd.data.ptr, hq * d, t, kd.data.ptr, vd.data.ptr, posd.data.ptr, seqd.data.ptr,
               tabd.data.ptr, max_pages, page, hq, hkv, d, 1 / np.sqrt(d), 0.0, 0, n_split, part_o.data.ptr,
               part_ml.data.ptr, counter.data.ptr, out.data.ptr, hq * d, q8=q8)
        outs.append(out.get())
    assert np.isfinite(outs[1]).all() and (outs[0] == outs[1]).all()
    check_q8(buf, outs[1])
    assert buf.untouched()
    assert not counter.get().any()
