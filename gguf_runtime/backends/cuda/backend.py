"""The CUDA backend: GPU-resident weights, preallocated buffers, sampling on the GPU, graphs.

Everything is allocated at load: weights, the paged KV cache, activations for the largest call,
and per-slot decode state (next token, position, sequence id, sampling parameters and history).
A decode step reads each slot's token and position from device memory and leaves the next token
there, so it is captured once per batch bucket (1, 2, 4, ... max_batch) and replayed; the host
reads tokens from a ring in pinned memory after an event, and never writes between tokens.

The single-sequence API (``prefill``/``eval``/``truncate``, ``start_single``/``end_single``
for engine.decode_loop) runs on slot 0; ``seq_add``/``batch_step``/``seq_token``/``seq_release``
run many slots at once. Prompt evaluation (chunks, padding, prefill graphs) is
``prefill.PrefillMixin``; the measured choices are the tuning table's (``tuning.py``).
"""

from __future__ import annotations

import secrets
from typing import Callable, Iterator, Sequence

import cupy as cp
import numpy as np

from ...model import rope_inv_freq
from .blocks import CudaBlocks
from .workspace import Workspace
from .precompile import precompile
from .prefill import PACK_HEAD, PrefillMixin
from .weights import DeviceWeights
from ...errors import BackendError, ContextOverflowError, GGUFError, UnsupportedModelError
from ...format.gguf_file import GGUFFile
from ...graphs import GraphManager, held
from ...graphs.manager import CaptureError
from .kv_cache import PAGE_SIZE, PagedKVCache
from . import tuning
from .tuning import Tuning
from ...model import forward, layers, lm_head_name
from ...format.model_config import OAI_GLU_ALPHA, OAI_GLU_LIMIT, ModelConfig
from ...quant_kernels import kv_layout as KL
from ...quant_kernels import launch_attention as LA
from ...quant_kernels import launch_layers as LL
from ...quant_kernels import launch_moe as LE
from ...quant_kernels import launchers as L
from ...quant_kernels import launch_sampling as LS
from ...quant_kernels import pdl
from ...quant_kernels.reference import dequantize
from ..host_loop import NOT_FINITE, host_sample_loop
from ...sampling import SamplingParams

RING = 64  # tokens per slot the pinned ring holds
HIST = LS.HIST  # tokens of penalty history a slot keeps
MAX_GPU_TOP_K = 1024
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
KV_RESERVE = 1 << 30  # GPU memory kept beside the KV cache and the workspace: f16 prefill copies, cuBLAS, graphs


def check_supported(cfg: ModelConfig) -> None:
    if cfg.activation == "swiglu_oai" and (cfg.glu_alpha, cfg.glu_limit) != (OAI_GLU_ALPHA, OAI_GLU_LIMIT):
        raise UnsupportedModelError(  # (common.cuh's swiglu_oai_f has gpt-oss's constants)
            f"{cfg.arch}: a clamped SwiGLU of alpha {cfg.glu_alpha} and limit {cfg.glu_limit} (the CUDA kernel has "
            f"{OAI_GLU_ALPHA} and {OAI_GLU_LIMIT}); use --backend numpy")
    if cfg.expert_bias and not cfg.n_expert or cfg.activation == "swiglu_oai" and not cfg.n_expert:
        raise UnsupportedModelError(f"{cfg.arch}: biases and the clamped SwiGLU run on the CUDA backend in "
                                    "mixture-of-experts layers only; use --backend numpy")
    if cfg.attn_sinks and not LA.flash_ok(cfg.head_dim, cfg.head_dim_v, cfg.n_head // cfg.n_head_kv):
        raise UnsupportedModelError("attention sinks run on the CUDA flash kernels only: heads of "
                                    f"{', '.join(map(str, LA.FLASH_HEAD_DIMS))} values and up to 8 query heads a KV "
                                    "head; use --backend numpy")
    if cfg.n_expert:
        if cfg.n_expert > LE.MAX_EXPERTS or not 1 <= cfg.n_expert_used <= min(cfg.n_expert, LE.MAX_USED):
            raise UnsupportedModelError(
                f"{cfg.arch}: {cfg.n_expert} experts, {cfg.n_expert_used} a token; the CUDA router takes up to "
                f"{LE.MAX_EXPERTS} experts and up to {LE.MAX_USED} a token; use --backend numpy")
    if cfg.rope.attn_factor != 1.0 and cfg.rope.n_dims != cfg.head_dim:
        # (with every dimension rotated the factor scales q.k by its square: blocks.py folds it
        # into the attention scale; a partial rotation would need it inside the RoPE kernels)
        raise UnsupportedModelError(
            f"RoPE's attention factor over {cfg.rope.n_dims} of {cfg.head_dim} head dimensions (LongRoPE with a "
            "partial rotation) is not run by the CUDA backend yet; use --backend numpy")
    g = cfg.n_head // cfg.n_head_kv
    if cfg.head_dim not in (64, 128, 256) or cfg.head_dim_v != cfg.head_dim or g > 8:
        raise UnsupportedModelError(
            f"the CUDA attention kernels support head sizes 64/128/256 and up to 8 query heads per KV head "
            f"(this model: {cfg.head_dim}, {g}); use --backend numpy")
    if cfg.n_embd % 4 or cfg.n_embd > LL.RMSNORM_MAX_COLS:
        raise UnsupportedModelError(
            f"the CUDA RMSNorm kernel supports hidden sizes that are multiples of 4 up to {LL.RMSNORM_MAX_COLS} "
            f"(this model: {cfg.n_embd}); use --backend numpy")


def bucket_for(n: int, max_batch: int) -> int:
    return next(b for b in BUCKETS if b >= n or b >= max_batch)


class CudaBackend(PrefillMixin):
    name = "cuda"

    def __init__(self, f: GGUFFile, cfg: ModelConfig, n_ctx: int,
                 progress: Callable[[str, int, int], None] | None = None, max_rows: int | None = None,
                 use_graph: bool = True, note: Callable[[str], None] | None = None, max_batch: int = 1,
                 kv_tokens: int | None = None, kv_type: str | None = None, tune: Tuning | None = None,
                 comm=None) -> None:
        """comm: one rank of a model split over GPUs (collectives.NcclCollectives; f and cfg are then
        the rank's part, format/shard.py); tensor_parallel.py starts the ranks."""
        check_supported(cfg)
        if max_batch not in BUCKETS:
            raise BackendError(f"--max-batch {max_batch} is not one of {', '.join(map(str, BUCKETS))}")
        self.f, self.cfg, self.n_ctx, self.max_batch = f, cfg, n_ctx, max_batch
        self.use_graph, self.note = use_graph, note
        weight_bytes = sum(t.nbytes for t in f.tensors.values())
        sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        self.tune = tune or tuning.choose(weight_bytes, kv_type, max_rows, max_batch, n_head_kv=cfg.n_head_kv,
                                          sm_count=sms, head_dim=cfg.head_dim, arch=cfg.arch,
                                          moe=cfg.n_expert > 0)
        self.prefill_graph = use_graph and self.tune.prefill_graph  # prefill chunks as graphs, one per padded size
        self._prefill_runs: dict[tuple, int] = {}
        self._deep_buckets: dict[int, bool] = {}  # bucket -> whether it has deep graphs (_deep_bucket)
        self.pack_graph = self.prefill_graph  # packed prompt forwards as graphs, one per padded size
        self.pdl = pdl.supported(cp.cuda.Device()) and self.tune.pdl != "off"
        try:
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.kernels = L.Kernels(self.tune.knobs())
            self.weights = DeviceWeights(f, cfg, progress)
            # the workspace first: the KV check below sees the memory it leaves
            self.ws = Workspace(cfg, max(max_rows or self.tune.prefill_chunk, max_batch), max(max_batch, 64),
                                self.tune)
            kv_type = self.tune.kv_type
            self._check_kv_type(kv_type)
            page = PagedKVCache.page_bytes(cfg, kv_type=kv_type)
            n_pages = self._kv_pages(n_ctx, kv_tokens, page)
            if comm is not None:  # every rank the same pool (admission is decided alike everywhere)
                n_pages = comm.agree_min(n_pages)
            self._check_kv_fits(n_ctx, n_pages, page, kv_type)
            self.kv = PagedKVCache(cfg, n_ctx, n_seqs=max_batch, n_pages=n_pages, kv_type=kv_type)
            ff = None
            factors = cfg.rope.factors_for(n_ctx)  # Llama-3.1's rope_freqs; LongRoPE's long or short ones
            if factors:
                t = f.tensors[factors]
                ff = dequantize(f.raw(t.name), t.type_id, t.shape)
            self.inv_freq = {key: cp.asarray(rope_inv_freq(cfg, *key, ff))
                             for key in {cfg.rope_key(i) for i in range(cfg.n_layer)}}
            if comm is not None:
                comm.setup(self.kernels, self.ws.logits.shape[0], self.weights.mat(lm_head_name(cfg)).rows,
                           cfg.n_embd, self.tune.tp_oneshot_rows, self.tune.tp_reduce_off, self.tune.tp_norm_rows,
                           self.tune.tp_norm_min_rows)
            self.comm = comm
            self.blocks = CudaBlocks(cfg, self.weights, self.kv, self.ws, self.kernels, self.inv_freq, self.tune,
                                     comm)
            self._set_pdl_rows()
            self._init_slots()
            precompile(self, BUCKETS)
        except cp.cuda.memory.OutOfMemoryError as e:
            raise BackendError(f"the GPU ran out of memory loading the model ({e}); "
                               "lower --ctx-size or --max-batch, or use a smaller model") from None
        self.kv_page_bytes = page
        if note:
            per_token = page // PAGE_SIZE
            note(f"note: KV cache {kv_type} (keys and values), {per_token / 1024:g} KiB a token of context, "
                 f"{n_pages * PAGE_SIZE:,} tokens ({n_pages * page / 2**20:,.0f} MiB)")
        self.graphs = GraphManager(self.stream)
        self.last_logits: cp.ndarray | None = None
        if max_batch == 1:
            self.kv.reserve(0, n_ctx)

    # ---- setup ----------------------------------------------------------------------------------
    def _kv_pages(self, n_ctx: int, kv_tokens: int | None, page_bytes: int) -> int:
        """Pages in the KV pool: kv_tokens if given; else a full context per slot, capped for
        several slots at half the free GPU memory (at least one full context)."""
        per_seq = -(-n_ctx // PAGE_SIZE)
        if kv_tokens is not None:
            return max(1, -(-kv_tokens // PAGE_SIZE))
        want = per_seq * self.max_batch
        if self.max_batch > 1:
            free, _ = cp.cuda.runtime.memGetInfo()
            cap = max(per_seq, int(0.5 * free) // page_bytes)
            if want > cap:
                want = cap
                if self.note:
                    self.note(f"note: the KV cache holds {want * PAGE_SIZE} tokens for {self.max_batch} "
                              "sequences (half the free GPU memory); sequences wait for pages when it is full")
        return want

    def _check_kv_type(self, kv_type: str) -> None:
        """q8_0 / q4_0 caches are read by the flash kernels only: heads of 64, 128 or 256 values, keys
        and values alike, up to 8 query heads a KV head."""
        cfg = self.cfg
        if kv_type not in KL.KV_TYPES:
            raise BackendError(f"unknown KV cache type {kv_type!r}: use one of {', '.join(KL.KV_TYPES)}")
        if kv_type in KL.QUANT and not LA.flash_ok(cfg.head_dim, cfg.head_dim_v, cfg.n_head // cfg.n_head_kv):
            raise BackendError(
                f"a {kv_type} KV cache needs heads of {', '.join(map(str, LA.FLASH_HEAD_DIMS))} values (keys and "
                f"values alike) and up to 8 query heads a KV head; this model has {cfg.head_dim} / {cfg.head_dim_v} and "
                f"{cfg.n_head // cfg.n_head_kv}: use -ctk f16 -ctv f16")

    def _check_kv_fits(self, n_ctx: int, n_pages: int, page_bytes: int, kv_type: str) -> None:
        """One line naming the largest context that fits, where the KV cache asked for cannot:
        what is free after the weights and the workspace, less KV_RESERVE for the f16 copies and graphs."""
        free, _ = cp.cuda.runtime.memGetInfo()
        if n_pages * page_bytes <= free - KV_RESERVE:
            return
        pages = max(0, (free - KV_RESERVE) // page_bytes) // self.max_batch
        largest = pages * PAGE_SIZE
        raise BackendError(
            f"a context of {n_ctx:,} tokens needs {n_pages * page_bytes / 2**30:.1f} GiB of {kv_type} KV cache"
            f"{f' for {self.max_batch} sequences' if self.max_batch > 1 else ''}; {free / 2**30:.1f} GiB of GPU "
            f"memory is free after the weights, so the largest context that fits is about {largest:,} tokens: "
            "lower --ctx-size" + (" or --max-batch" if self.max_batch > 1 else ""))

    def _init_slots(self) -> None:
        n = self.max_batch
        z = lambda k, t=cp.int32: cp.zeros(k, t)  # noqa: E731
        self.tokens, self.pos = z(n), z(n)  # each slot's next input token and its position
        self.seq = cp.full(n, -1, cp.int32)  # slot id when active, -1 when free
        self.hist, self.hist_n, self.step = z(HIST * n), z(n), z(n)
        self.pval, self.pidx = z(LS.ARGMAX_BLOCKS * n, cp.float32), z(LS.ARGMAX_BLOCKS * n)
        self.counter = z(n, cp.uint32)
        nb = LS.topk_blocks(self.cfg.n_vocab)
        self.cand_v, self.cand_i = z(n * nb * LS.TOPK_MAX, cp.float32), z(n * nb * LS.TOPK_MAX)
        self.cand_n = z(n * nb)
        self.p_top_k, self.p_last_n = z(n), z(n)
        self.p_top_p, self.p_min_p, self.p_temp, self.p_penalty = (z(n, cp.float32) for _ in range(4))
        self.p_seed = z(n, cp.uint64)
        self._ring_mem = cp.cuda.alloc_pinned_memory(RING * n * 4)
        self.ring = np.frombuffer(self._ring_mem, np.int32, RING * n).reshape(RING, n)
        # logprobs (logprobs.cu): per slot top entries + 1 (0: none), a ring row a token beside the
        # token ring, the penalty window's raw logits; _lp: the reporting slots' top entries
        self.p_lp, self.lp_win = z(n), z(n * HIST * 2)
        self._lp_mem = cp.cuda.alloc_pinned_memory(RING * n * LS.LP_COLS * 4)
        self.lp_ring = np.frombuffer(self._lp_mem, np.float32, RING * n * LS.LP_COLS).reshape(RING, n, LS.LP_COLS)
        self._lp: dict[int, int] = {}
        # grammar masks (token_mask.cu): a pinned row a slot the host fills between steps (all ones:
        # free), copied to the device before a step that samples a constrained slot
        words = LS.mask_words(self.cfg.n_vocab)
        self._mask_mem = cp.cuda.alloc_pinned_memory(n * words * 4)
        self.mask_host = np.frombuffer(self._mask_mem, np.uint32, n * words).reshape(n, words)
        self.mask_host[:] = 0xFFFFFFFF
        self.mask_dev = cp.full((n, words), 0xFFFFFFFF, cp.uint32)
        self._masked: set[int] = set()
        self._state = [self.tokens, self.pos, self.hist, self.hist_n, self.step, self.counter]
        self._saved = [cp.empty_like(a) for a in self._state]
        self.sampler_state = LS.SamplerState(
            tokens=self.tokens.data.ptr, pos=self.pos.data.ptr, hist=self.hist.data.ptr,
            hist_n=self.hist_n.data.ptr, step=self.step.data.ptr, ring=self._ring_mem.ptr, ring_len=RING,
            n_seq=n, pval=self.pval.data.ptr, pidx=self.pidx.data.ptr, counter=self.counter.data.ptr,
            cand_v=self.cand_v.data.ptr, cand_i=self.cand_i.data.ptr, cand_n=self.cand_n.data.ptr,
            top_k=self.p_top_k.data.ptr, top_p=self.p_top_p.data.ptr, min_p=self.p_min_p.data.ptr,
            temp=self.p_temp.data.ptr, seed=self.p_seed.data.ptr, penalty=self.p_penalty.data.ptr,
            last_n=self.p_last_n.data.ptr, seq=self.seq.data.ptr, lp_k=self.p_lp.data.ptr,
            lp_ring=self._lp_mem.ptr, lp_win=self.lp_win.data.ptr)
        # _prime_many's table, a row per slot at most, and a slot map of up to 64 rows
        self._prime_buf = cp.empty(n * (LS.PRIME_COLS + HIST) + 64, cp.int32)
        # a packed forward's last rows (indices, then their residual rows) for its head: prefill.py
        self._pack_last = cp.zeros(PACK_HEAD, cp.int32)
        self._pack_x = cp.zeros((PACK_HEAD, self.cfg.n_embd), cp.float32)
        self._bad_rows = cp.zeros(64, cp.int32)  # _finite_rows' flags
        self.slot_len = [0] * n  # tokens whose K/V sit in the slot's pages
        self.decoding = [False] * n  # slots the batch steps advance (seq_first .. seq_release)
        self._verify_base: dict[int, int] = {}  # slot -> its length before a verification (verify_many)

    # ---- sampling -------------------------------------------------------------------------------
    @staticmethod
    def _mode(params: SamplingParams) -> tuple[bool, bool]:
        """(greedy, penalty): which sampling kernels a step launches."""
        return params.greedy, params.repeat_penalty != 1.0 and params.repeat_last_n != 0

    def _sample(self, greedy: bool, penalty: bool, lp: bool = False, masked: bool = False, *, rows: int,
                slot0: int = 0, row: int = 0, slots: int = 0) -> None:
        """Sample the next token of slots slot0.. (or of the device slot map ``slots``: one int32 per
        row, -1 skips it) from ``rows`` rows of ws.logits from ``row`` on; ``lp``: with the
        logprobs kernels around the sampler (they skip the slots that report none); ``masked``: the
        slots' grammar masks applied before it (free slots' rows are all ones)."""
        st, k, cfg, logits = self.sampler_state, self.kernels, self.cfg, self.ws.logits
        ld = logits.strides[0] // 4
        ptr = logits[row:].data.ptr
        if lp:
            LS.row_logprobs(k, ptr, ld, cfg.n_vocab, st, rows, slot0, slots)
        if penalty:
            LS.repeat_penalty(k, ptr, ld, cfg.n_vocab, st, rows, slot0, slots)
        if masked:
            LS.apply_mask(k, ptr, ld, cfg.n_vocab, self.mask_dev.data.ptr, st, rows, slot0, slots)
        if greedy:
            LS.argmax_sample(k, ptr, ld, cfg.n_vocab, st, rows, slot0, slots)
        else:
            LS.topk_sample(k, ptr, ld, cfg.n_vocab, st, rows, slot0, slots)
        if lp:
            LS.chosen_logprob(k, ptr, ld, st, rows, slot0, slots)

    def _finite_rows(self, logits: cp.ndarray) -> np.ndarray:
        """Whether each row of ``logits`` (at most 64) is free of NaNs and infinities (one kernel and
        a wait for the stream)."""
        rows = logits.shape[0]
        bad = self._bad_rows[:rows]
        with self.stream:
            LS.finite_rows(self.kernels, logits.data.ptr, logits.strides[0] // 4, logits.shape[1], rows, bad.data.ptr)
        return cp.asnumpy(bad, stream=self.stream) == 0

    def _check_finite(self, logits: cp.ndarray) -> None:
        """Damaged weights show in a prompt's logits: one line, where the GPU sampler would pick
        token 0 from NaNs for ever (one kernel and a wait per prompt)."""
        if not self._finite_rows(logits).all():
            raise GGUFError(NOT_FINITE)

    def gpu_sampling(self, params: SamplingParams) -> bool:
        """Whether the GPU sampler covers these parameters (else the host samples)."""
        return params.greedy or 0 < params.top_k <= MAX_GPU_TOP_K

    def _prime(self, slot: int, history: Sequence[int], params: SamplingParams, seed: int) -> None:
        """Start a slot's decoding (at admission, never between tokens): its history, position and
        sampler parameters, in one copy and one kernel (sampling.cu prime_slots)."""
        self._prime_many([(slot, history, params, seed)])

    def _prime_many(self, seqs: Sequence[tuple[int, Sequence[int], SamplingParams, int]],
                    slots: Sequence[int] = ()) -> int:
        """_prime for several (slot, history, params, seed). ``slots``, a packed forward's slot map
        for _sample, is copied after the table in the same copy; returns its device address (0
        without one)."""
        rows = [(slot, history, self.slot_len[slot] - 1,
                 p.top_k if 0 < p.top_k <= MAX_GPU_TOP_K else MAX_GPU_TOP_K,
                 HIST if p.repeat_last_n < 0 else min(HIST, p.repeat_last_n),
                 p.top_p, p.min_p, 0.0 if p.greedy else p.temperature, p.repeat_penalty, seed,
                 self._lp.get(slot, -1))
                for slot, history, p, seed in seqs]
        table = LS.prime_table(rows).ravel()
        n = table.shape[0]
        if len(slots):
            table = np.concatenate([table, np.asarray(slots, np.int32)])
        dev = self._prime_buf[:table.shape[0]]  # (reused in stream order: the copy waits for earlier readers)
        dev.set(table, stream=self.stream)
        with self.stream:
            LS.prime_slots(self.kernels, dev.data.ptr, len(rows), self.sampler_state)
        return dev[n:].data.ptr if len(slots) else 0

    # ---- the decode step and its graphs ---------------------------------------------------------
    def _set_pdl_rows(self) -> None:
        """Graphs of up to pdl_max_rows rows launch every kernel with programmatic dependent launch
        (tuning: pdl_any_rows, or decode steps on the matvecs only); larger ones only the kernels
        named in pdl_only."""
        t = self.tune
        self.pdl_max_rows = 1 << 30 if t.pdl == "all" or t.pdl_any_rows else t.decode_mmv_rows
        self.pdl_only = t.pdl_big_graph_kernels or False

    def end_collectives(self) -> None:
        """End this rank's communicator (a model split over GPUs): its CUDA graphs first, since
        NCCL's destroy and abort wait for ever until no graph holds one of its collectives (the
        graph manager holds the only references), then the abort. Once; a no-op without one."""
        comm = self.__dict__.get("comm")
        if comm is None:
            return
        self.comm = None
        graphs = self.__dict__.get("graphs")
        if graphs is not None:
            graphs.clear()
        comm.abort()

    def __del__(self) -> None:
        # (freed with a communicator still open: the blocks hold it too, and Python may drop it
        # before the graphs, whereupon NCCL's destructor would wait for them for ever)
        try:
            self.end_collectives()
        except Exception:  # noqa: BLE001 (interpreter shutdown: nothing left to end)
            pass

    def retune(self, tune: Tuning) -> None:
        """Measuring (bench/inproc_variants.py): other choices of the tuning table, for the
        choices that size nothing (kernel shapes, roles, PDL); captured graphs are dropped."""
        self.tune = tune
        self.blocks.retune(tune)
        self._set_pdl_rows()
        self.pdl = pdl.supported(cp.cuda.Device()) and tune.pdl != "off"
        self.graphs.clear()
        self._prefill_runs.clear()  # each chunk size runs eagerly once more (its warm-up) before its capture
        self._deep_buckets.clear()

    def _step(self, rows: int, mode: tuple[bool, bool], deep: bool = False) -> None:
        """Every active slot < rows: embed its token, run the model at its position, sample."""
        self._decode_forward(self.seq, self.tokens[:rows], self.pos[:rows], deep=deep)
        self._sample(*mode, rows=rows)

    def _decode_forward(self, seq: cp.ndarray, tokens: cp.ndarray, pos: cp.ndarray, verify: bool = False,
                        deep: bool = False) -> None:
        """A decode step's kernels over these rows (row r: sequence seq[r]), every row's logits into
        ws.logits; ``verify``: the rows are consecutive tokens of one sequence (blocks.verify);
        ``deep``: a batch whose rows hold many keys (blocks.deep)."""
        b, rows = self.blocks, tokens.shape[0]
        b.seq, b.mma, b.decode, b.verify, b.deep = seq, rows > b.decode_mmv_rows, True, verify, deep
        b.mmv_rows = b.decode_mmv_rows
        knobs = b.k.knobs
        if verify:
            b.k.knobs = b.tune.knobs(verify=True)
        try:
            forward(b, self.cfg, tokens, pos, all_logits=True)
        finally:
            b.verify = b.deep = False
            b.k.knobs = knobs

    def _deep_bucket(self, rows: int) -> bool:
        """Whether a batch step of this bucket changes its attention kernel when its rows hold many
        keys (blocks.tiles; then it has a graph of each kind)."""
        got = self._deep_buckets.get(rows)
        if got is None:
            b = self.blocks
            got = False
            if self.tune.tiles == "auto" and self.tune.tiles_max_keys > 0 and b.deep_ok():
                saved = b.mmv_rows, b.deep
                b.mmv_rows, b.deep = b.decode_mmv_rows, False  # (as _decode_forward sets them)
                try:
                    got = b.tiles(rows, decode=True)
                finally:
                    b.mmv_rows, b.deep = saved
            self._deep_buckets[rows] = got
        return got

    def _deep(self, rows: int) -> bool:
        """Whether this step's rows hold more keys than tiles_max_keys on average (over the bucket's
        rows: empty slots count as none)."""
        return self._deep_bucket(rows) and sum(self.slot_len[:rows]) > self.tune.tiles_max_keys * rows

    def _save_state(self) -> None:
        for src, dst in zip(self._state, self._saved):
            cp.copyto(dst, src)

    def _restore_state(self) -> None:
        for src, dst in zip(self._saved, self._state):
            cp.copyto(dst, src)

    def _graph_for(self, rows: int, mode: tuple[bool, bool], deep: bool = False):
        """The captured step for this bucket and sampling mode (and ``deep``: _deep), or None
        (eager). Parameters and seeds live in device memory, so one graph serves every setting of
        the mode."""
        if not self.use_graph:
            return None
        key = ("decode", rows, *mode) + (("deep",) if deep else ())
        if not self.graphs.has(key):
            try:
                self.graphs.capture(key, self._graph_step(rows, mode, deep),
                                    before_warmup=self._save_state, after_warmup=self._restore_state)
            except CaptureError as e:
                self.use_graph = False
                if self.note:
                    self.note(f"warning: CUDA graph capture failed ({e}); decoding eagerly")
                return None
        return key

    def _with_pdl(self, fn: Callable[[], None], rows: int) -> Callable[[], None]:
        """fn (a call of ``rows`` rows) as a step to capture: where pdl_max_rows allows it (and the
        GPU has it, quant_kernels/pdl.py) its kernels launched with programmatic dependent launch
        (else only pdl_only's), so each one's launch and weight loads overlap the end of the kernel
        before it in the replayed graph."""
        def step() -> None:
            self.kernels.pdl = self.pdl and (rows <= self.pdl_max_rows or self.pdl_only)
            try:
                fn()
            finally:
                self.kernels.pdl = False
        return step

    def _graph_step(self, rows: int, mode: tuple[bool, bool], deep: bool = False) -> Callable[[], None]:
        return self._with_pdl(lambda: self._step(rows, mode, deep), rows)

    def capture_buckets(self, mode: tuple[bool, bool] = (False, True),
                        progress: Callable[[str, int, int], None] | None = None) -> None:
        """Capture the batch graphs of every bucket up to max_batch, largest first; ``progress``
        is called once per bucket as ("capturing graphs", done, total)."""
        buckets = sorted((b for b in BUCKETS if b <= self.max_batch), reverse=True)
        for i, rows in enumerate(buckets):
            self._graph_for(rows, mode)
            if self._deep_bucket(rows):
                self._graph_for(rows, mode, deep=True)
            if progress:
                progress("capturing graphs", i + 1, len(buckets))

    def _launch(self, key, rows: int, mode: tuple[bool, bool], deep: bool = False) -> None:
        if key is not None:
            self.graphs.replay(key)
        else:
            with self.stream:
                self._step(rows, mode, deep)

    # ---- one sequence (slot 0) ------------------------------------------------------------------
    def start_single(self, history: list[int], params: SamplingParams, seed: int,
                     given: int | None = None) -> Callable[[], None]:
        """Start decoding slot 0 after its prompt (engine.decode_loop.sample_loop drives it):
        sample token 0 on the stream (``given``: token 0 is that token, not evaluated yet, and
        ``history`` the evaluated ones); returns the launch of one decode step (the graph of this
        sampling mode), which also counts the token it evaluates into the slot's length."""
        mode = self._mode(params)
        if given is None:
            self._check_finite(self.last_logits[-1:])
        self._prime(0, history, params, seed)
        with self.stream:
            if given is None:
                self._sample(*mode, rows=1)  # token 0, from the prompt's logits
            else:
                LS.commit_token(self.kernels, self.sampler_state, 0, int(given))
        key = self._graph_for(1, mode)

        def launch() -> None:
            self._launch(key, 1, mode)
            self.slot_len[0] += 1
        return launch

    def end_single(self) -> None:
        """After slot 0's last step: wait for the stream, mark the slot free for the sampler."""
        self.stream.synchronize()
        with self.stream:
            self.seq[0:1].fill(-1)

    def run_steps(self, n: int, params: SamplingParams, graph: bool = False) -> None:
        """Launch n single-sequence decode steps back to back (no host sync)."""
        mode = self._mode(params)
        key = self._graph_for(1, mode) if graph else None
        for _ in range(n):
            self._launch(key, 1, mode)
        self.slot_len[0] += n

    def start_decode(self, prompt: Sequence[int], params: SamplingParams, seed: int = 0, keep: int = 0) -> None:
        """Prefill the prompt into slot 0 after its first ``keep`` cached tokens and sample its
        first token on the device (benchmarks)."""
        self.truncate(keep)
        self.prefill(prompt)
        self._prime(0, list(prompt), params, seed)
        with self.stream:
            self._sample(*self._mode(params), rows=1)

    def host_sample_loop(self, n: int, params: SamplingParams, history: list[int],
                         stop: frozenset[int], constraint=None) -> Iterator[int]:
        """Sampling on the host, for parameters the GPU sampler lacks (top-k off or over 1024) and
        grammar-constrained output (its masks are the host's for now)."""
        first = cp.asnumpy(self.last_logits[-1], stream=self.stream)
        return host_sample_loop(self, n, params, history, stop, logits=first, constraint=constraint)

    # ---- many sequences --------------------------------------------------------------------------
    def seq_add(self, slot: int, prompt: Sequence[int], params: SamplingParams, max_new: int,
                seed: int | None = None, reuse: bool = False) -> int:
        """Admit a sequence into a free slot: reserve pages, prefill, sample its first token. With
        ``reuse`` the prompt's cached leading pages (kv.match) are taken as they are and only the
        rest is evaluated, and its full pages join the prefix cache. Returns the tokens evaluated."""
        cached = self.seq_start(slot, prompt, params, max_new, reuse)
        self.seq_prefill(slot, prompt[cached:])
        self.seq_first(slot, prompt, params, seed, publish=reuse)
        return len(prompt) - cached

    # seq_add in three parts, for a prompt evaluated in chunks between other sequences' decode steps
    def seq_start(self, slot: int, prompt: Sequence[int], params: SamplingParams, max_new: int,
                  reuse: bool = False) -> int:
        """Reserve the slot's pages for the prompt and max_new tokens (with ``reuse``, starting with
        the prompt's cached leading pages); returns the prompt tokens already there."""
        if not self.gpu_sampling(params):
            raise BackendError("batched decoding samples on the GPU: use top-k between 1 and 1024")
        kv = self.kv
        prefix = kv.match(prompt) if reuse and not kv.capacity(slot) else []
        kv.reserve(slot, min(self.n_ctx, len(prompt) + max_new), stream=self.stream, prefix=prefix)
        self.slot_len[slot] = len(prefix) * kv.page_size
        self.decoding[slot] = False
        return self.slot_len[slot]

    def seq_prefill(self, slot: int, tokens: Sequence[int]) -> None:
        """Evaluate the next tokens of the slot's prompt (the slot stays out of the decode steps)."""
        if len(tokens):
            self._eval(slot, tokens, all_logits=False)

    def seq_first(self, slot: int, prompt: Sequence[int], params: SamplingParams, seed: int | None = None,
                  publish: bool = False, row: int = 0) -> None:
        """After the prompt's last token was evaluated (nothing evaluated since): sample the first
        token (from row ``row`` of the last evaluation's logits: its part, after seq_prefill_many)
        and let the decode steps take the slot; ``publish``: its full pages join the prefix cache."""
        self._check_finite(self.last_logits[row:row + 1])
        if publish:
            self.kv.publish(slot, prompt)  # (enqueued before any later reader, on the one stream)
        seed = int(seed) if seed is not None else secrets.randbits(63)
        self._prime(slot, prompt, params, seed)
        with self.stream:
            self._push_masks([slot])
            self._sample(*self._mode(params), slot in self._lp, slot in self._masked, rows=1, slot0=slot, row=row)
        self.decoding[slot] = True

    slot_speculation = True  # verify_many / seq_commit serve the server's speculation (mirrored to a split model's ranks)

    def seq_commit(self, slot: int, tokens: Sequence[int]) -> None:
        """After verify_many: ``tokens`` (the kept proposals, then the target's next token) are
        committed as the sampler commits one (into the ring, where the host reads them as sampled
        ones, the penalty window and the next input), and the slot keeps the K/V of the verified
        rows they follow (its last sampled token's and the kept proposals')."""
        self.slot_len[slot] = self._verify_base[slot] + len(tokens)
        with self.stream:
            for t in tokens:
                LS.commit_token(self.kernels, self.sampler_state, slot, int(t))

    def seq_prefill_many(self, parts: Sequence[tuple[int, Sequence[int], tuple | None]]) -> None:
        """Evaluate several slots' next prompt tokens, as few forwards as the workspace allows:
        ``parts`` = (slot, tokens, first) in order, ``first`` = None or seq_first's (prompt, params,
        seed, publish) to sample the slot's first token once its part is evaluated (seed given:
        every rank of a split model samples alike). Parts are packed into forwards of at most
        the workspace's rows and logits rows (_forward_parts, flash prefill); a part alone in its
        forward, or every part where the flash kernel does not take prompt chunks, runs as seq_prefill."""
        parts = [(s, list(t), f) for s, t, f in parts if len(t) or f is not None]
        cap = self.ws.max_rows if self.part_align() else 0
        group: list = []
        rows = 0
        for part in parts + [None]:
            fits = part is not None and len(group) < min(64, self.ws.logits.shape[0]) and \
                rows + self.part_rows(len(part[1])) <= cap
            if group and not fits:
                self._run_parts(group)
                group, rows = [], 0
            if part is not None:
                group.append(part)
                rows += self.part_rows(len(part[1]))

    def _run_parts(self, group: list) -> None:
        if len(group) > 1 and all(len(t) for _, t, _ in group):
            self._forward_parts([(s, t) for s, t, _ in group])
            self._first_many([(row, s, first) for row, (s, _, first) in enumerate(group) if first is not None],
                             len(group))
            return
        for s, t, first in group:
            self.seq_prefill(s, t)
            if first is not None:
                self.seq_first(s, *first)

    def _first_many(self, firsts: list, rows: int) -> None:
        """seq_first of several slots after one packed forward: ``firsts`` = (logits row, slot,
        seq_first's (prompt, params, seed, publish)). One finiteness check (one wait), one prime
        launch and one sampling launch for all of them (the slot map sends row r to its slot)."""
        if not firsts:
            return
        ok = self._finite_rows(self.last_logits[:rows])
        if not all(ok[row] for row, _, _ in firsts):
            raise GGUFError(NOT_FINITE)
        slots = [-1] * rows
        for row, slot, (prompt, _, _, publish) in firsts:
            slots[row] = slot
            if publish:
                self.kv.publish(slot, prompt)
        seeds = [(slot, prompt, params, int(seed) if seed is not None else secrets.randbits(63))
                 for _, slot, (prompt, params, seed, _) in firsts]
        slot_map = self._prime_many(seeds, slots)
        modes = [self._mode(params) for _, _, (_, params, _, _) in firsts]
        with self.stream:  # greedy rows take the top-k kernel's greedy path where the group mixes both
            self._push_masks([slot for _, slot, _ in firsts])
            self._sample(all(g for g, _ in modes), any(p for _, p in modes),
                         any(slot in self._lp for _, slot, _ in firsts),
                         any(slot in self._masked for _, slot, _ in firsts), rows=rows, slots=slot_map)
        for _, slot, _ in firsts:
            self.decoding[slot] = True

    def batch_step(self, n_slots: int) -> None:
        """One decode step for every active slot below n_slots (the bucket's graph)."""
        rows = bucket_for(n_slots, self.max_batch)
        mode = (False, True)  # the general sampler: greedy and sampled rows, with penalties
        # ... and the logprobs kernels, the grammar masks where a slot asks (graphs of their own)
        extra = (any(s < rows for s in self._lp), self._push_masks([s for s in self._masked if s < rows]))
        if any(extra):
            mode += extra
        deep = self._deep(rows)
        self._launch(self._graph_for(rows, mode, deep), rows, mode, deep)
        for s in range(rows):
            if self.decoding[s]:  # (a slot whose prompt is evaluated in chunks meanwhile keeps its length)
                self.slot_len[s] += 1

    def new_event(self) -> held.Event:
        """An event for the launch-ahead loop to record after each launch: its record and query
        keep the GIL (graphs/held.py)."""
        return held.Event()

    def seq_token(self, slot: int, i: int) -> int:
        """The i-th token sampled for the slot (after the step that made it has completed)."""
        return int(self.ring[i % RING, slot])

    grammar_masks = True  # seq_constrain serves grammars in the batch steps (a split model's: mirror.py sends the rows)

    def seq_constrain(self, slot: int) -> np.ndarray:
        """Constrain the slot's next sequence by a grammar (before its seq_first): returns its
        pinned mask row (uint32 words, llguidance's bitmask layout), which the caller fills before
        seq_first and again after reading each token, before the next step is launched (a step
        copies the constrained slots' rows as it is launched)."""
        self._masked.add(slot)
        return self.mask_host[slot]

    def _push_masks(self, slots) -> bool:
        """Copy the constrained ones among ``slots``' mask rows to the device (stream order);
        whether there was one."""
        rows = [s for s in slots if s in self._masked]
        for s in rows:
            self.mask_dev[s].set(self.mask_host[s], stream=self.stream)
        return bool(rows)

    def seq_logprobs(self, slot: int, k: int) -> None:
        """Report the slot's next sequence's logprobs with ``k`` top entries (0..20; before its
        seq_first): seq_logprobs_entry reads them beside each token."""
        self._lp[slot] = min(max(int(k), 0), LS.LP_TOP)

    def seq_logprobs_entry(self, slot: int, i: int, tok: int):
        """sampling.token_logprobs' entry of the slot's i-th token ``tok`` (read with it)."""
        return LS.lp_entry(self.lp_ring[i % RING, slot], tok)

    def seq_release(self, slot: int, tokens: Sequence[int] = ()) -> None:
        """End the slot's sequence; ``tokens``, those whose K/V it wrote from position 0, keep its
        full pages in the prefix cache."""
        with self.stream:
            self.seq[slot:slot + 1].fill(-1)
        self.kv.release(slot, stream=self.stream, tokens=list(tokens))
        self.slot_len[slot] = 0
        self.decoding[slot] = False
        self._lp.pop(slot, None)
        if slot in self._masked:  # free again: all ones, here and on the device
            self._masked.discard(slot)
            self.mask_host[slot] = 0xFFFFFFFF
            with self.stream:
                self.mask_dev[slot].fill(0xFFFFFFFF)

    # ---- embeddings ------------------------------------------------------------------------------
    def hidden(self, tokens: Sequence[int], slot: int = 0) -> np.ndarray:
        """The final hidden states (after the output RMSNorm) of ``tokens`` as a sequence of their own
        at positions 0, 1, ...: host float32 [T, n_embd] (embeddings). Runs in ``slot``'s pages, in
        prefill chunks (eager, no logits): slot 0 of the single-sequence API (its cached tokens are
        forgotten: n_past becomes 0) or a free slot of the batch (the scheduler's; seq stays -1, so
        the batch steps write nothing there). Pages the slot lacks are reserved for the call
        (KVCacheFullError when the pool is short) and, where it had none, released after it."""
        n = len(tokens)
        if not n:
            raise ValueError("no tokens to evaluate")
        if n > self.n_ctx:
            raise ContextOverflowError(f"{n} tokens do not fit the context of {self.n_ctx}; raise --ctx-size or "
                                       "shorten the input")
        kv, ws, cfg = self.kv, self.ws, self.cfg
        had = kv.capacity(slot)
        kv.reserve(slot, n, stream=self.stream)
        out = np.empty((n, cfg.n_embd), np.float32)
        ids = np.asarray(tokens, np.int32)
        try:
            with self.stream:
                for s in range(0, n, ws.max_rows):
                    part = ids[s:s + ws.max_rows]
                    h = self._hidden_chunk(slot, part, s)
                    out[s:s + part.shape[0]] = cp.asnumpy(h, stream=self.stream)  # (blocking: ws.h is reused)
        finally:
            self.slot_len[slot] = 0
            if had == 0:
                kv.release(slot, stream=self.stream)
        return out

    def _hidden_chunk(self, slot: int, part: np.ndarray, past: int) -> cp.ndarray:
        """One chunk at positions past, past + 1, ... (padded in front as prefill.PrefillMixin._chunk
        pads), every layer, then the output norm into ws.h; its rows of the chunk's tokens."""
        ws, cfg = self.ws, self.cfg
        rows, pad = self._stage(slot, part, past, ws.max_rows)
        x = layers(self._prefill_mode(), cfg, ws.tokens[:rows], ws.pos[:rows])
        h = ws.h[:rows]
        LL.rmsnorm(self.kernels, x.data.ptr, x.strides[0] // 4, self.weights.vec("output_norm.weight").data.ptr,
                   h.data.ptr, h.strides[0] // 4, rows, cfg.n_embd, cfg.rms_eps)
        return h[pad:rows]
