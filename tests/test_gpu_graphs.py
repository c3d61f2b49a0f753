"""Graph replay of the decode step: same tokens as eager, one launch per token, no allocation."""

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from gguf_runtime.engine.decode_loop import sample_loop  # noqa: E402
from gguf_runtime.backends.cuda.backend import CudaBackend  # noqa: E402
from gguf_runtime.format.gguf_file import open_gguf  # noqa: E402
from gguf_runtime.format.model_config import config_from_gguf  # noqa: E402
from gguf_runtime.quant_kernels import kv_layout as KL  # noqa: E402
from gguf_runtime.sampling import SamplingParams  # noqa: E402

from twin_files import TWINS, twin_path  # noqa: E402


@pytest.fixture(scope="module", params=TWINS)
def backend(request):
    f = open_gguf(twin_path(request.param))
    return CudaBackend(f, config_from_gguf(f), 512)


def generate(be, prompt, n, params, graph):
    be.use_graph = graph
    be.truncate(0)
    be.prefill(prompt)
    return list(sample_loop(be, n, params, prompt, frozenset()))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0),
                                    SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=11,
                                                   repeat_penalty=1.1)])
def test_replay_equals_eager(backend, params):
    prompt = [1, 5, 77, 900, 12]
    eager = generate(backend, prompt, 64, params, graph=False)
    graph = generate(backend, prompt, 64, params, graph=True)
    assert graph == eager
    assert len(backend.graphs.graphs) >= 1


def test_crosses_kv_pages(backend):
    """A 40-token prompt plus 64 tokens spans 7 pages of 16: replay still matches eager."""
    prompt = list(range(3, 43))
    p = SamplingParams(temperature=0.0)
    assert generate(backend, prompt, 64, p, graph=True) == generate(backend, prompt, 64, p, graph=False)


def test_one_graph_launch_per_token_and_no_allocation(backend):
    p = SamplingParams(temperature=0.0)
    generate(backend, [1, 2, 3], 8, p, graph=True)  # capture happens here
    pool = cp.get_default_memory_pool()
    backend.use_graph = True
    backend.truncate(0)
    backend.prefill([1, 2, 3])
    backend.stream.synchronize()
    kernels0, graphs0 = backend.kernels.launches, backend.graphs.launches
    mem0 = (pool.used_bytes(), pool.total_bytes())
    toks = list(sample_loop(backend, 201, p, [1, 2, 3], frozenset()))
    assert len(toks) == 201
    # the first token from the prompt's logits: three eager kernels (the finiteness check, the
    # slot's sampler state, the sampling); then one graph launch per token and no kernel of ours
    assert backend.kernels.launches - kernels0 == 3
    assert backend.graphs.launches - graphs0 == 200
    assert (pool.used_bytes(), pool.total_bytes()) == mem0


def test_prefill_graph_equals_eager(backend, rng):
    """Prompt chunks over MAX_MMV_TOKENS rows run padded in front to a multiple of 64 rows; a
    padded size is captured on its second use and replayed after. The graph's logits and KV cache
    are the eager run's, bit for bit, and the padding rows write no keys or values."""
    first, more = (rng.integers(0, backend.cfg.n_vocab, n).tolist() for n in (40, 100))  # 64 and 128 rows
    kv = backend.kv
    backend.use_graph = True

    def run(graph):
        backend.prefill_graph = graph
        kv.k.fill(0x47)  # poison bytes, finite in f32 and f16: positions no run writes keep them
        kv.v.fill(0xC7)
        backend.truncate(0)
        a = backend.eval(first, all_logits=True)
        b = backend.eval(more)
        backend.stream.synchronize()
        return a, b, cp.asnumpy(kv.k), cp.asnumpy(kv.v)

    q = backend.tune.prefill_quantum
    sizes = [(-(-n // q) * q, a) for n, a in ((40, True), (100, False))]
    backend._prefill_runs.clear()
    for key in [("prefill", *s) for s in sizes]:
        backend.graphs.graphs.pop(key, None)
    launches0 = backend.graphs.launches
    first_use = run(True)  # each padded size's first use runs eagerly (the capture's warm-up)
    assert backend.graphs.launches == launches0
    ref = run(False)
    assert ref[0].shape == (40, backend.cfg.n_vocab) and ref[1].shape == (1, backend.cfg.n_vocab)
    for g, r in zip(first_use, ref):
        assert np.array_equal(g, r)
    for i in range(3):  # capture (each size's third use here), then replays
        got = run(True)
        for g, r in zip(got, ref):
            assert np.array_equal(g, r)
    assert backend.graphs.launches - launches0 == 6
    assert all(backend.graphs.has(("prefill", *s)) for s in sizes)
    # slot 0's first 140 positions hold keys and values; everything else keeps the poison (padding
    # rows sit at the position after their chunk's last: 140 for the second chunk)
    table = cp.asnumpy(kv.table[0])
    written = np.zeros((kv.n_pages, kv.page_size), bool)
    for p in range(140):
        written[table[p // kv.page_size], p % kv.page_size] = True
    cfg = backend.cfg
    k, v = (np.moveaxis(np.stack([KL.unpack(x, kv.kv_type, kv.page_size, d) for x in raw]), 3, 2)
            for raw, d in zip(ref[2:], (cfg.head_dim, cfg.head_dim_v)))  # [layer, page, slot, head, dim]
    pk, pv = (KL.unpack(np.full(a.shape[-1], b, np.uint8), kv.kv_type, kv.page_size, d).flat[0]
              for a, b, d in ((kv.k, 0x47, cfg.head_dim), (kv.v, 0xC7, cfg.head_dim_v)))
    assert (k[:, written] != pk).all() and (v[:, written] != pv).all()
    assert (k[:, ~written] == pk).all() and (v[:, ~written] == pv).all()


@pytest.mark.parametrize("driver", [True, False])
def test_held_calls(monkeypatch, driver):
    """graphs/held.py's calls (libcuda through PyDLL, or CuPy's where the driver is missing): an
    event recorded behind a kernel still running is not done, then is after synchronize; a copy from
    pinned memory lands; a graph launched through it runs (its writes seen)."""
    from gguf_runtime.graphs import held

    if not driver:
        monkeypatch.setattr(held, "_lib", False)
    assert (held.driver() is not None) == driver
    spin = cp.RawKernel(r'''extern "C" __global__ void spin(long long n, int* out) {
        long long t0 = clock64(); while (clock64() - t0 < n) {} out[0] = 7; }''', "spin")
    s = cp.cuda.Stream(non_blocking=True)
    out = cp.full(1, -1, dtype=cp.int32)
    ev = held.Event()
    cp.cuda.Device().synchronize()  # (the arrays' fills ran on the default stream)
    with s:
        spin((1,), (1,), (np.int64(200_000_000), out))  # ~0.1 s
    ev.record(s)
    assert not ev.done
    ev.synchronize()
    assert ev.done and int(out[0]) == 7
    rng = np.random.default_rng(3)
    src = cp.cuda.alloc_pinned_memory(4 * 1000)
    host = np.frombuffer(src, np.int32, 1000)
    host[:] = rng.integers(-(1 << 30), 1 << 30, 1000)
    dst = cp.full(1000, -1, dtype=cp.int32)
    cp.cuda.Device().synchronize()
    held.copy_to_device(dst.data.ptr, host.ctypes.data, 4 * 1000, s)
    s.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(dst), host)
    y = cp.full(64, -1.0, dtype=cp.float32)
    x = cp.asarray(rng.standard_normal(64).astype(np.float32))
    cp.cuda.Device().synchronize()
    with s:
        cp.multiply(x, 3.0, out=y)  # (compiled and loaded before the capture)
        s.synchronize()
        s.begin_capture()
        cp.multiply(x, 3.0, out=y)
        g = s.end_capture()
    g.upload(s)
    for _ in range(2):  # (the first launch may instantiate through CuPy)
        with s:
            y.fill(-1.0)
        held.launch_graph(g, s)
        s.synchronize()
        np.testing.assert_allclose(cp.asnumpy(y), cp.asnumpy(x) * 3.0, rtol=1e-6)
