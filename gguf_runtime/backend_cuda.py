"""The CUDA backend: GPU-resident weights, preallocated buffers, sampling on the GPU.

Everything is allocated at load (weights, paged KV cache, activations for the largest call,
sampler state); a decode step launches a fixed sequence of kernels that read the token and its
position from device memory and leave the next token there, so the step can be replayed as a
CUDA graph. The host reads sampled tokens from a ring in pinned memory.
"""

from __future__ import annotations

import secrets
from typing import Callable, Iterator, Sequence

import cupy as cp
import numpy as np

from .backend_numpy import rope_inv_freq
from .cuda_blocks import CudaBlocks, Workspace
from .cuda_weights import DeviceWeights
from .errors import BackendError, ContextOverflowError, UnsupportedModelError
from .gguf_file import GGUFFile
from .graphs import GraphManager
from .graphs.manager import CaptureError
from .kv_cache import PagedKVCache
from .model import forward
from .model_config import ModelConfig
from .quant_kernels import launchers as L
from .quant_kernels.reference import dequantize
from .sampling import Sampler, SamplingParams

PREFILL_CHUNK = 512
RING = 64
LOOKAHEAD = 4  # decode steps enqueued ahead of the token the host is reading
HIST = 64
MAX_GPU_TOP_K = 1024
LOGITS_ROWS = 64


def check_supported(cfg: ModelConfig) -> None:
    g = cfg.n_head // cfg.n_head_kv
    if cfg.head_dim not in (64, 128, 256) or cfg.head_dim_v != cfg.head_dim or g > 8:
        raise UnsupportedModelError(
            f"the CUDA attention kernels support head sizes 64/128/256 and up to 8 query heads per KV head "
            f"(this model: {cfg.head_dim}, {g}); use --backend numpy")


class CudaBackend:
    name = "cuda"

    def __init__(self, f: GGUFFile, cfg: ModelConfig, n_ctx: int,
                 progress: Callable[[str, int, int], None] | None = None, max_rows: int = PREFILL_CHUNK,
                 use_graph: bool = True, note: Callable[[str], None] | None = None) -> None:
        check_supported(cfg)
        self.f, self.cfg, self.n_ctx = f, cfg, n_ctx
        try:
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.kernels = L.Kernels()
            self.weights = DeviceWeights(f, cfg, progress)
            self.kv = PagedKVCache(cfg, n_ctx, n_seqs=1)
            self.ws = Workspace(cfg, max_rows, LOGITS_ROWS)
            ff = None
            if cfg.rope.freq_factors:
                t = f.tensors[cfg.rope.freq_factors]
                ff = dequantize(f.raw(t.name), t.type_id, t.shape)
            self.inv_freq = {key: cp.asarray(rope_inv_freq(cfg, *key, ff))
                             for key in {cfg.rope_key(i) for i in range(cfg.n_layer)}}
            self.blocks = CudaBlocks(cfg, self.weights, self.kv, self.ws, self.kernels, self.inv_freq)
            self._precompile()
            self._init_sampler_state()
        except cp.cuda.memory.OutOfMemoryError as e:
            raise BackendError(f"the GPU ran out of memory loading the model ({e}); "
                               "lower --ctx-size or use a smaller model") from None
        self.n_past = 0
        self.last_logits: cp.ndarray | None = None
        self.use_graph = use_graph
        self.note = note
        self.graphs = GraphManager(self.stream)
        self._events = [cp.cuda.Event(disable_timing=True) for _ in range(RING)]

    def _precompile(self) -> None:
        """Compile every kernel this model can launch, one NVRTC pass per source file."""
        cfg, w = self.cfg, self.weights
        names = []
        for i in range(cfg.n_layer):
            p = f"blk.{i}."
            qkv = [w.mat(p + n) for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight")]
            gate, up = w.mat(p + "ffn_gate.weight"), w.mat(p + "ffn_up.weight")
            for b in L.MMV_TOKENS:
                names.append(L.mmv_name([m.struct for m in qkv], b, L.rows_per_warp([m.rows for m in qkv], b), 0))
                for n, mode in (("attn_output.weight", 1), ("ffn_down.weight", 1), ("attn_output.weight", 0),
                                ("ffn_down.weight", 0), ("ffn_gate.weight", 0), ("ffn_up.weight", 0)):
                    m = w.mat(p + n)
                    names.append(L.mmv_name([m.struct], b, L.rows_per_warp([m.rows], b), mode))
                names.append(L.glu_name(gate.struct, b, L.ACT[cfg.activation]))
        head = w.mat("output.weight" if "output.weight" in w.mats else "token_embd.weight")
        for b in L.MMV_TOKENS:
            names.append(L.mmv_name([head.struct], b, L.rows_per_warp([head.rows], b), 0))
        names.append(f"embed_rows<{w.mat('token_embd.weight').struct}>")
        names += [f"dequant_f16<{s}>" for s in {m.struct for m in w.mats.values()}]
        self.kernels.prepare("matvec.cu", names)
        self.kernels.prepare("layers.cu", ["rmsnorm", "rope_kv", "glu", "to_f16", "add_bias", "softcap"])
        self.kernels.prepare("attention.cu", [f"attn_split<{cfg.head_dim}, {cfg.n_head // cfg.n_head_kv}>",
                                              "attn_reduce"])
        self.kernels.prepare("sampling.cu", ["repeat_penalty", "argmax_sample", "topk_sample"])

    def _init_sampler_state(self, n_seq: int = 1) -> None:
        z = lambda n, t=cp.int32: cp.zeros(n, t)  # noqa: E731
        self.hist, self.hist_n, self.step = z(HIST * n_seq), z(n_seq), z(n_seq)
        self.pval = z(L.ARGMAX_BLOCKS * n_seq, cp.float32)
        self.pidx = z(L.ARGMAX_BLOCKS * n_seq)
        self.counter = z(n_seq, cp.uint32)
        self.p_top_k, self.p_last_n = z(n_seq), z(n_seq)
        self.p_top_p, self.p_min_p, self.p_temp, self.p_penalty = (z(n_seq, cp.float32) for _ in range(4))
        self.p_seed = z(n_seq, cp.uint64)
        self._ring_mem = cp.cuda.alloc_pinned_memory(RING * n_seq * 4)
        self.ring = np.frombuffer(self._ring_mem, np.int32, RING * n_seq)
        self._state = [self.ws.tokens[:n_seq], self.ws.pos[:n_seq], self.hist, self.hist_n, self.step, self.counter]
        self._saved = [cp.empty_like(a) for a in self._state]
        self.sampler_state = L.SamplerState(
            tokens=self.ws.tokens.data.ptr, pos=self.ws.pos.data.ptr, hist=self.hist.data.ptr,
            hist_n=self.hist_n.data.ptr, step=self.step.data.ptr, ring=self._ring_mem.ptr, ring_len=RING,
            n_seq=n_seq, pval=self.pval.data.ptr, pidx=self.pidx.data.ptr, counter=self.counter.data.ptr,
            top_k=self.p_top_k.data.ptr, top_p=self.p_top_p.data.ptr, min_p=self.p_min_p.data.ptr,
            temp=self.p_temp.data.ptr, seed=self.p_seed.data.ptr, penalty=self.p_penalty.data.ptr,
            last_n=self.p_last_n.data.ptr)

    def _set_params(self, b: int, params: SamplingParams, seed: int) -> None:
        """Write sequence b's sampling parameters (host writes at prefill, never between tokens)."""
        s = self.stream
        last_n = HIST if params.repeat_last_n < 0 else min(HIST, params.repeat_last_n)
        top_k = params.top_k if 0 < params.top_k <= MAX_GPU_TOP_K else MAX_GPU_TOP_K
        self.p_top_k[b:b + 1].set(np.array([top_k], np.int32), stream=s)
        self.p_last_n[b:b + 1].set(np.array([last_n], np.int32), stream=s)
        self.p_top_p[b:b + 1].set(np.array([params.top_p], np.float32), stream=s)
        self.p_min_p[b:b + 1].set(np.array([params.min_p], np.float32), stream=s)
        self.p_temp[b:b + 1].set(np.array([params.temperature if not params.greedy else 0.0], np.float32), stream=s)
        self.p_penalty[b:b + 1].set(np.array([params.repeat_penalty], np.float32), stream=s)
        self.p_seed[b:b + 1].set(np.array([seed], np.uint64), stream=s)

    # ---- evaluation ----------------------------------------------------------------------------
    def truncate(self, n: int) -> None:
        self.n_past = min(self.n_past, n)

    def eval(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Append tokens; host copy of the last (or every) token's logits (tests and fallback)."""
        out = self._eval(tokens, all_logits)
        return cp.asnumpy(out, stream=self.stream)

    def _eval(self, tokens: Sequence[int], all_logits: bool) -> cp.ndarray:
        n = len(tokens)
        if self.n_past + n > self.n_ctx:
            raise ContextOverflowError(f"{self.n_past + n} tokens do not fit the context of {self.n_ctx}; "
                                       "raise --ctx-size or shorten the input")
        if all_logits and n > LOGITS_ROWS:
            raise ValueError(f"all_logits is limited to {LOGITS_ROWS} tokens per call on the GPU")
        ids = np.asarray(tokens, np.int32)
        with self.stream:
            for s in range(0, n, self.ws.max_rows):
                part = ids[s:s + self.ws.max_rows]
                t = part.shape[0]
                self.ws.tokens[:t].set(part, stream=self.stream)
                self.ws.pos[:t].set(np.arange(self.n_past, self.n_past + t, dtype=np.int32), stream=self.stream)
                last = s + t >= n
                logits = forward(self.blocks, self.cfg, self.ws.tokens[:t], self.ws.pos[:t],
                                 all_logits=all_logits and last)
                self.n_past += t
        self.last_logits = logits
        return logits

    def prefill(self, tokens: Sequence[int]) -> None:
        self._eval(tokens, all_logits=False)
        self._prompt_tail = list(tokens)

    # ---- sampling ------------------------------------------------------------------------------
    def _decode_step(self) -> None:
        """One token: ws.tokens[0] at ws.pos[0] -> logits -> (the caller samples)."""
        forward(self.blocks, self.cfg, self.ws.tokens[:1], self.ws.pos[:1])

    def _sample(self, greedy: bool, penalty: bool, rows: int = 1) -> None:
        """Sample every row's next token from ws.logits (parameters are in device memory)."""
        st, k, cfg = self.sampler_state, self.kernels, self.cfg
        logits = self.ws.logits
        ld = logits.strides[0] // 4
        if penalty:
            L.repeat_penalty(k, logits.data.ptr, ld, cfg.n_vocab, st, rows)
        if greedy:
            L.argmax_sample(k, logits.data.ptr, ld, cfg.n_vocab, st, rows)
        else:
            L.topk_sample(k, logits.data.ptr, ld, cfg.n_vocab, st, rows)

    @staticmethod
    def _mode(params: SamplingParams) -> tuple[bool, bool]:
        return params.greedy, params.repeat_penalty != 1.0 and params.repeat_last_n != 0

    def gpu_sampling(self, params: SamplingParams) -> bool:
        """Whether the GPU sampler covers these parameters (else the host samples)."""
        return params.greedy or 0 < params.top_k <= MAX_GPU_TOP_K

    def _prime(self, history: list[int], params: SamplingParams, seed: int) -> None:
        """Host writes before the first sample (allowed: this is prefill, not between tokens)."""
        self._set_params(0, params, seed)
        tail = np.asarray(history[-HIST:], np.int32)
        hist = np.zeros(HIST, np.int32)
        hist[:tail.shape[0]] = tail
        with self.stream:
            self.hist.set(hist, stream=self.stream)
            self.hist_n.set(np.array([tail.shape[0]], np.int32), stream=self.stream)
            self.step.fill(0)
            self.counter.fill(0)
            self.ws.pos[:1].set(np.array([self.n_past - 1], np.int32), stream=self.stream)

    # ---- the decode step and its graph ----------------------------------------------------------
    def _step(self, mode: tuple[bool, bool]) -> None:
        self._decode_step()
        self._sample(*mode)

    def _save_state(self) -> None:
        for src, dst in zip(self._state, self._saved):
            cp.copyto(dst, src)

    def _restore_state(self) -> None:
        for src, dst in zip(self._saved, self._state):
            cp.copyto(dst, src)

    def _graph_for(self, mode: tuple[bool, bool]):
        """The captured decode step for this sampling mode, or None (eager). Parameters and seeds
        live in device memory, so one graph serves every setting of the mode."""
        if not self.use_graph:
            return None
        key = ("decode", 1, *mode)
        if not self.graphs.has(key):
            try:
                self.graphs.capture(key, lambda: self._step(mode),
                                    before_warmup=self._save_state, after_warmup=self._restore_state)
            except CaptureError as e:
                self.use_graph = False
                if self.note:
                    self.note(f"warning: CUDA graph capture failed ({e}); decoding eagerly")
                return None
        return key

    def _launch(self, key, mode: tuple[bool, bool]) -> None:
        if key is not None:
            self.graphs.replay(key)
        else:
            with self.stream:
                self._step(mode)

    def sample_loop(self, n: int, params: SamplingParams, history: list[int],
                    stop: frozenset[int]) -> Iterator[int]:
        """Yield up to n tokens; decode steps run LOOKAHEAD ahead of the host, which reads each
        token from the pinned ring after its step's event, and checks stops lazily."""
        if not self.gpu_sampling(params):
            yield from self._host_sample_loop(n, params, history, stop)
            return
        seed = int(params.seed) if params.seed is not None else secrets.randbits(63)
        mode = self._mode(params)
        self._prime(history, params, seed)
        with self.stream:
            self._sample(*mode)  # token 0, from the prompt's logits
            self._events[0].record(self.stream)
        key = self._graph_for(mode)
        issued = 0  # decode steps launched; step j evaluates token j-1 and samples token j
        base = self.n_past
        try:
            for i in range(n):
                while issued < min(i + LOOKAHEAD, n - 1):
                    self._launch(key, mode)
                    issued += 1
                    self._events[issued % RING].record(self.stream)
                self._events[i % RING].synchronize()
                tok = int(self.ring[i % RING])
                yield tok
                if tok in stop:
                    return
        finally:
            self.stream.synchronize()
            self.n_past = base + issued

    def run_steps(self, n: int, params: SamplingParams, graph: bool = False) -> None:
        """Launch n decode steps back to back (no host sync): each samples the next input token."""
        mode = self._mode(params)
        key = self._graph_for(mode) if graph else None
        for _ in range(n):
            self._launch(key, mode)
        self.n_past += n

    def start_decode(self, prompt: Sequence[int], params: SamplingParams, seed: int = 0) -> None:
        """Prefill the prompt and sample the first token on the device (benchmarks)."""
        self.truncate(0)
        self.prefill(prompt)
        self._prime(list(prompt), params, seed)
        with self.stream:
            self._sample(*self._mode(params))

    def _host_sample_loop(self, n: int, params: SamplingParams, history: list[int],
                          stop: frozenset[int]) -> Iterator[int]:
        sampler = Sampler(params)
        hist = list(history)
        logits = cp.asnumpy(self.last_logits[-1], stream=self.stream)
        for i in range(n):
            tok = sampler.sample(logits, hist)
            yield tok
            if tok in stop or i == n - 1:
                return
            hist.append(tok)
            logits = self.eval([tok])[-1]
