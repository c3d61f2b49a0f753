"""Tensor parallelism's collectives on the GPU: NCCL through CuPy (``cupy.cuda.nccl``), one rank
a process and a GPU (``tensor_parallel.py`` starts them).

Both run on the backend's stream, so they are captured into the decode and prefill graphs with
the kernels around them (NCCL supports stream capture): one graph launch a rank a step still
holds. While the kernels are being recorded for compilation (precompile.py) they do nothing.

- ``all_reduce``: the sum over the ranks, in place (the O and down products' partial sums): up to
  ``oneshot_rows`` rows (decode steps) the one-shot kernel over peer memory (allreduce.cu: each
  rank writes its rows into every rank's receive buffer, mapped into each other through CUDA IPC),
  NCCL above; ``row_reduce``: the same sum inside the next RMSNorm's launch (layers.cu's
  rmsnorm_allreduce, steps of ``norm_min_rows`` to ``norm_rows`` rows), so the sum costs no launch of
  its own;
- ``gather_logits``: each rank's vocabulary rows [t, V'] -> the whole [t, V] logits on every rank
  (an all-gather, then one kernel that puts rank-major parts side by side), so every rank's
  sampler draws the same token from the same logits and seeds: no token crosses the host.
"""

from __future__ import annotations

import contextlib

import cupy as cp
import numpy as np

from ...errors import BackendError
from ...quant_kernels import launch_layers as LL

_PLACE = cp.ElementwiseKernel(
    "raw float32 parts, int32 rows, int32 part, int32 vocab, int32 ld", "raw float32 out",
    """
    int r = i / vocab, v = i - r * vocab;
    int rank = v / part;
    out[r * ld + v] = parts[(rank * rows + r) * part + (v - rank * part)];
    """, "gguf_place_vocab_parts")


def nccl_module():
    try:
        from cupy.cuda import nccl
    except Exception as e:  # noqa: BLE001 (a CuPy built without NCCL, or no libnccl found)
        raise BackendError(f"tensor parallelism needs NCCL, which CuPy cannot load here ({e}); install "
                           "nvidia-nccl for this CUDA version, or run on one GPU") from None
    return nccl


def unique_id() -> tuple:
    return nccl_module().get_unique_id()


class NcclCollectives:
    """Rank ``rank`` of ``world``'s communicator (``init`` blocks until every rank has joined)."""

    def __init__(self, world: int, uid: tuple, rank: int) -> None:
        self.world, self.rank = world, rank
        self.nccl = nccl_module()
        self.comm = self.nccl.NcclCommunicator(world, uid, rank)
        self.kernels = None  # the backend's Kernels: nothing runs while they record (precompile)
        self.parts: cp.ndarray | None = None
        self.oneshot_floats = self.norm_rows = self.norm_min_rows = 0
        self._one = cp.zeros(1, cp.int64)
        self._own: list[int] = []  # receive buffers allocated here, and the other ranks' opened here
        self._opened: list[int] = []

    def setup(self, kernels, logits_rows: int, vocab_part: int, n_embd: int, oneshot_rows: int,
              reduce_off: bool = False, norm_rows: int = 0, norm_min_rows: int = 1) -> None:
        """Buffers of the logits' gather (each rank's part: the head's output, and every rank's), of
        the one-shot all-reduce (sums of up to oneshot_rows rows of n_embd; 0: NCCL only) and of
        the sums inside an RMSNorm (steps of norm_min_rows to norm_rows rows; 0: none)."""
        self.kernels = kernels
        self.reduce_off = reduce_off  # (measuring only: tuning.tp_reduce_off)
        self.vocab_part = vocab_part
        self.part = cp.zeros((logits_rows, vocab_part), cp.float32)
        self.parts = cp.zeros(self.world * logits_rows * vocab_part, cp.float32)
        multi = self.world > 1 and self._peers_reachable()
        self.oneshot_floats = oneshot_rows * n_embd if multi else 0
        if self.oneshot_floats:  # [3][world][oneshot_floats], blocks' buffer indices and last lengths
            self.recv_ptrs = self._peer_buffers(3 * self.world * self.oneshot_floats)
            self.epoch = cp.zeros(LL.AR_BLOCKS, cp.uint32)
            self.last = cp.zeros(LL.AR_BLOCKS, cp.int32)
        self.norm_rows = norm_rows if multi else 0
        self.norm_min_rows = norm_min_rows
        if self.norm_rows:  # [3][world][norm_rows][n_embd], a buffer index a row
            self.row_ptrs = self._peer_buffers(3 * self.world * self.norm_rows * n_embd)
            self.row_ep = cp.zeros(self.norm_rows, cp.uint32)

    def _peers_reachable(self) -> bool:
        """Whether every rank's GPU can read and write every other's memory (NVLink, or PCIe peer
        access); where one cannot, every rank sums on NCCL alone (the ranks agree)."""
        rt, me = cp.cuda.runtime, cp.cuda.Device().id
        mine = all(rt.deviceCanAccessPeer(me, r) for r in range(self.world) if r != me)
        return self.agree_min(int(mine)) == 1

    def _peer_buffers(self, words: int) -> cp.ndarray:
        """A receive buffer of ``words`` floats, all -0.0 (empty), in memory of this rank's own
        (cudaMalloc: an IPC handle names a whole allocation), and every rank's opened here through
        CUDA IPC (the handles travel by an NCCL all-gather): the device array of their pointers."""
        rt, w = cp.cuda.runtime, self.world
        own_ptr = rt.malloc(words * 4)
        self._own.append(own_ptr)
        own = cp.ndarray((words,), cp.uint32, cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(own_ptr, words * 4, self), 0))
        own.fill(0x80000000)
        handle = bytes(rt.ipcGetMemHandle(own_ptr))
        mine = cp.asarray(np.frombuffer(handle, np.uint8))
        every = cp.zeros(w * mine.size, cp.uint8)
        s = cp.cuda.get_current_stream()
        self.comm.allGather(mine.data.ptr, every.data.ptr, mine.size, self.nccl.NCCL_UINT8, s.ptr)
        s.synchronize()
        every = every.get().reshape(w, len(handle))
        ptrs = np.zeros(w, np.uint64)
        for r in range(w):
            # (opening lazily enables peer access)
            if r == self.rank:
                ptrs[r] = own_ptr
            else:
                ptrs[r] = rt.ipcOpenMemHandle(bytes(every[r]))
                self._opened.append(int(ptrs[r]))
        return cp.asarray(ptrs)

    def release_buffers(self) -> None:
        """Close the other ranks' receive buffers opened here and free this rank's own, once the
        other ranks have stopped (nothing writes into them any more): a server that unloads a split
        model gets their memory back."""
        rt = cp.cuda.runtime
        opened, self._opened, own, self._own = self._opened, [], self._own, []
        for ptr in opened:
            with contextlib.suppress(Exception):
                rt.ipcCloseMemHandle(ptr)
        for ptr in own:
            with contextlib.suppress(Exception):
                rt.free(ptr)

    def sums_in_norm(self, t: int) -> bool:
        """Whether a step of t rows leaves O's and down's sums to the next RMSNorm's launch."""
        return self.norm_min_rows <= t <= self.norm_rows

    def row_reduce(self, x: cp.ndarray) -> LL.RowReduce | None:
        """The sum of x's rows over the ranks, for the RMSNorm launch that reads them next (the
        rows' sums go back into x), or None where that kernel does not take them (a step outside
        sums_in_norm's rows, none set up, or measuring without sums)."""
        if not self.sums_in_norm(x.shape[0]) or self.reduce_off:
            return None
        return LL.RowReduce(x.data.ptr, x.strides[0] // 4, self.row_ptrs.data.ptr, self.row_ep.data.ptr, self.rank,
                            self.world, self.norm_rows)

    def _idle(self) -> bool:
        return self.kernels is not None and self.kernels.recorded is not None

    def all_reduce(self, x: cp.ndarray) -> None:
        """x (contiguous rows, float32) = the sum of every rank's x."""
        if self.reduce_off:
            return
        n = x.shape[0] * x.strides[0] // 4
        if n <= self.oneshot_floats and n % 4 == 0:  # (while the kernels record: noted for compiling at load)
            LL.allreduce_push(self.kernels, x.data.ptr, n, self.recv_ptrs.data.ptr, self.epoch.data.ptr,
                              self.last.data.ptr, self.rank, self.world, self.oneshot_floats)
            return
        if self._idle():
            return
        self.comm.allReduce(x.data.ptr, x.data.ptr, n, self.nccl.NCCL_FLOAT32, self.nccl.NCCL_SUM,
                            cp.cuda.get_current_stream().ptr)

    def gather_logits(self, t: int, out: cp.ndarray) -> None:
        """out[:t, :V] = the ranks' parts (self.part[:t] on each) side by side."""
        if self._idle():
            return
        vp = self.vocab_part
        s = cp.cuda.get_current_stream().ptr
        self.comm.allGather(self.part.data.ptr, self.parts.data.ptr, t * vp, self.nccl.NCCL_FLOAT32, s)
        vocab = out.shape[1]
        _PLACE(self.parts, cp.int32(t), cp.int32(vp), cp.int32(vocab), cp.int32(out.strides[0] // 4), out,
               size=t * vocab)

    def abort(self) -> None:
        """End the communicator. NCCL's abort returns only once every rank of the host has called
        it, so the ranks end theirs together (tensor_parallel.py's close). CuPy calls it holding the
        GIL: no timeout of ours could bound it, nor would any other thread of this process run."""
        comm, self.comm = self.comm, None
        if comm is not None:
            with contextlib.suppress(Exception):  # (already torn down: nothing left to end)
                comm.abort()

    def agree_min(self, n: int) -> int:
        """The least n over the ranks (sizes each rank must share: the KV pool's pages)."""
        self._one.fill(n)
        s = cp.cuda.get_current_stream()
        self.comm.allReduce(self._one.data.ptr, self._one.data.ptr, 1, self.nccl.NCCL_INT64, self.nccl.NCCL_MIN,
                            s.ptr)
        s.synchronize()
        return int(self._one.get()[0])
