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
