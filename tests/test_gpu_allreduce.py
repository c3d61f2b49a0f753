"""allreduce.cu's one-shot all-reduce on one GPU: its ranks as concurrent streams, their receive
buffers in this GPU's memory (the protocol is the same over NVLink; test_gpu_tensor_parallel runs
it across two GPUs where a machine has them).

Every rank must get the float32 sum in rank order, bit for bit (ranks sample alone from it), over
calls of changing lengths: the buffers' rotation, the clearing of the last call's slots and the
"empty" value (-0.0, sent as +0.0) are what the calls exercise.
"""

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from gguf_runtime.quant_kernels import launch_layers as LL
from gguf_runtime.quant_kernels import launchers as L

EMPTY = 0x80000000  # -0.0f


def rank_sum(xs: list[np.ndarray]) -> np.ndarray:
    sent = [np.where(x.view(np.uint32) == EMPTY, np.float32(0.0), x) for x in xs]
    acc = sent[0].copy()
    for v in sent[1:]:
        acc = acc + v
    return acc


def same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all(), f"{what}: NaN positions differ"
    bad = np.flatnonzero(got.view(np.uint32)[~nan] != want.view(np.uint32)[~nan])
    assert bad.size == 0, f"{what}: {bad.size} sums differ, first at {bad[0]}: {got[~nan][bad[0]]} vs {want[~nan][bad[0]]}"


class Ranks:
    """world ranks on one GPU: receive buffers, counters and a stream each."""

    def __init__(self, world: int, cap: int) -> None:
        self.world, self.cap, self.k = world, cap, L.Kernels()
        self.recv = [cp.full(3 * world * cap, EMPTY, cp.uint32) for _ in range(world)]
        self.ptrs = cp.asarray(np.array([r.data.ptr for r in self.recv], np.uint64))
        self.epoch = [cp.zeros(LL.AR_BLOCKS, cp.uint32) for _ in range(world)]
        self.last = [cp.zeros(LL.AR_BLOCKS, cp.int32) for _ in range(world)]
        self.streams = [cp.cuda.Stream(non_blocking=True) for _ in range(world)]

    def launch(self, r: int, x: cp.ndarray) -> None:
        LL.allreduce_push(self.k, x.data.ptr, x.size, self.ptrs.data.ptr, self.epoch[r].data.ptr,
                          self.last[r].data.ptr, r, self.world, self.cap)


def inputs(rng, world: int, n: int) -> list[np.ndarray]:
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    xs[0][:4] = [-0.0, 0.0, np.nan, -0.0]  # the empty value as data, both zeros, a NaN
    xs[1][:4] = [-0.0, -0.0, 1.0, 3.0]
    return xs


@pytest.mark.parametrize("world", [2, 3, 4])
def test_push_allreduce_eager(world):
    rng = np.random.default_rng(world)
    cap = 8 * 256
    ranks = Ranks(world, cap)
    ranks.k.fn("allreduce.cu", "allreduce_push")  # (compiled before the first concurrent launch)
    for call in range(40):
        n = int(rng.choice([4, 256, 8 * 256, 3 * 256, 100, 2 * 256, 1000]))
        xs = inputs(rng, world, n)
        dev = [cp.asarray(x) for x in xs]
        cp.cuda.Device().synchronize()
        for r in range(world):
            with ranks.streams[r]:
                ranks.launch(r, dev[r])
        for s in ranks.streams:
            s.synchronize()
        want = rank_sum(xs)
        for r in range(world):
            same_bits(dev[r].get(), want, f"world {world}, call {call} (n {n}), rank {r}")


def test_push_allreduce_graph_replays():
    """Three sums of different lengths captured in one graph a rank, replayed with new inputs: the
    counters in device memory carry the rotation from replay to replay."""
    world, cap, lengths = 2, 4 * 512, (512, 4 * 512, 8)
    rng = np.random.default_rng(7)
    ranks = Ranks(world, cap)
    ranks.k.fn("allreduce.cu", "allreduce_push")
    src = [[cp.zeros(n, cp.float32) for n in lengths] for _ in range(world)]
    dst = [[cp.zeros(n, cp.float32) for n in lengths] for _ in range(world)]
    dst[0][0][...] = src[0][0]  # (the copy kernel compiled before the capture)
    graphs = []
    for r in range(world):
        s = ranks.streams[r]
        with s:
            s.begin_capture()
            for a, b in zip(src[r], dst[r]):
                b[...] = a
                ranks.launch(r, b)
            graphs.append(s.end_capture())
    for rep in range(5):
        xs = [[inputs(rng, world, n)[r] for n in lengths] for r in range(world)]  # (fresh values a replay)
        for r in range(world):
            for a, x in zip(src[r], xs[r]):
                a.set(x)
        cp.cuda.Device().synchronize()
        for r in range(world):
            graphs[r].launch(ranks.streams[r])
        for s in ranks.streams:
            s.synchronize()
        for j, n in enumerate(lengths):
            want = rank_sum([xs[r][j] for r in range(world)])
            for r in range(world):
                same_bits(dst[r][j].get(), want, f"replay {rep}, sum {j} (n {n}), rank {r}")


@pytest.mark.parametrize("world", [2, 4])
def test_rmsnorm_allreduce(world):
    """layers.cu's rmsnorm_allreduce: each rank's rows summed in rank order into x (bit for bit), then
    the very norm rmsnorm computes over those sums (y, its f16 copy and its int8 copy, bit for bit),
    over calls of 1 to 8 rows (each row's buffer index turns on its own)."""
    from gguf_runtime.quant_kernels.launch_core import Q8Vec

    n, cap, ld, eps = 1024, 8, 1040, 1e-5
    rng = np.random.default_rng(world + 10)
    k = L.Kernels()
    recv = [cp.full(3 * world * cap * n, EMPTY, cp.uint32) for _ in range(world)]
    ptrs = cp.asarray(np.array([r.data.ptr for r in recv], np.uint64))
    ep = [cp.zeros(cap, cp.uint32) for _ in range(world)]
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(world)]
    w = cp.asarray(rng.standard_normal(n).astype(np.float32))

    def outputs():
        return (cp.full((cap, ld), np.nan, cp.float32), cp.full((cap, ld), 0xFFFF, cp.uint16),
                cp.full((cap, n), 0x7F, cp.int8), cp.full((cap, n // 16, 4), np.nan, cp.float32))

    def norm(x, rows, out, reduce=None):
        y, y16, q, s = out
        LL.rmsnorm(k, x.data.ptr, ld, w.data.ptr, y.data.ptr, ld, rows, n, eps, y16=y16.data.ptr, ld16=ld,
                   q8=Q8Vec(q.data.ptr, n, s.data.ptr, n // 16), reduce=reduce)

    k.fn("layers.cu", "rmsnorm_allreduce")  # (compiled before the first concurrent launch)
    for call in range(16):
        rows = int(rng.choice([1, 3, 8, 2, 5]))
        xs = [(rng.standard_normal((rows, ld)) * (r + 1)).astype(np.float32) for r in range(world)]
        xs[0][0, :2] = [-0.0, 0.0]
        dev = [cp.asarray(x) for x in xs]
        outs = [outputs() for _ in range(world)]
        cp.cuda.Device().synchronize()
        for r in range(world):
            with streams[r]:
                norm(dev[r], rows, outs[r], LL.RowReduce(dev[r].data.ptr, ld, ptrs.data.ptr, ep[r].data.ptr, r, world,
                                                         cap))
        for s in streams:
            s.synchronize()
        want = rank_sum([x[:, :n] for x in xs])
        ref_x = cp.asarray(np.pad(want, ((0, 0), (0, ld - n))))
        ref = outputs()
        norm(ref_x, rows, ref)
        cp.cuda.Device().synchronize()
        for r in range(world):
            what = f"world {world}, call {call} ({rows} rows), rank {r}"
            same_bits(dev[r].get()[:, :n], want, what + ": sums")
            for name, got, exp in zip(("y", "y16", "q8", "q8 scales"), outs[r], ref):
                g, e = got[:rows].get(), exp[:rows].get()
                assert np.array_equal(g.view(np.uint8), e.view(np.uint8)), f"{what}: {name} differs"
