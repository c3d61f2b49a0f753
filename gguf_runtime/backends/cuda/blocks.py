"""``model.Blocks`` on the GPU: each block is a short, fixed sequence of kernel launches.

Matrix products by row count: up to ``mmv_rows`` rows (MAX_MMV_TOKENS; in the decode steps of
big models, 2: the tuning table) run the dequantizing matvec kernels (f32 or int8 activations: single-sequence
decode, small batches, short prompts). More rows run either the
tensor-core kernels (``mma = True``: batch decode steps) or, for prefill, cuBLAS on f16 copies of
the matrices (``f16_weights``: Q/K/V and gate/up stacked, one product each; f16 inputs written by the
kernel before, f32 accumulate and output; the residual add is its beta = 1; ``cublas_gemm``: it
can be captured, so prefill chunks run as graphs too). ``seq`` maps the rows of the current call
to KV-cache sequence slots (< 0: a padding row that writes nothing). Every array returned is a view of the
preallocated ``Workspace``: nothing is allocated per call.
"""

from __future__ import annotations

import dataclasses

import cupy as cp

from .cublas_gemm import CublasGemm
from .f16_weights import F16Weights
from .weights import DeviceWeights
from .tuning import Tuning
from .workspace import Workspace, attn_shape, n_splits
from .kv_cache import PagedKVCache
from ...model import lm_head_name
from ...format.model_config import ROPE_NEOX, ModelConfig
from ...quant_kernels import kv_layout as KL
from ...quant_kernels import launch_attention as LA
from ...quant_kernels import launch_layers as LL
from ...quant_kernels import launch_mma as LM
from ...quant_kernels import launch_moe as LE
from ...quant_kernels import launchers as L
from ...quant_kernels.formats import FORMATS

class CudaBlocks:
    def __init__(self, cfg: ModelConfig, w: DeviceWeights, kv: PagedKVCache, ws: Workspace,
                 kernels: L.Kernels, inv_freq: dict[tuple[float, float], cp.ndarray], tune: Tuning,
                 comm=None) -> None:
        self.cfg, self.w, self.kv, self.ws, self.k = cfg, w, kv, ws, kernels
        # one rank of a model split over GPUs (collectives.py, format/shard.py): O's and down's
        # products are partial sums, all-reduced; the head's rows are a part of the vocabulary
        self.comm = comm
        self.lead = comm is None or comm.rank == 0  # the rank whose products add the residual
        # x whose rows are still this rank's part of their sum: the next RMSNorm's launch sums them
        # (collectives.row_reduce); O's and down's products within the layers leave it so
        self._unsummed: cp.ndarray | None = None
        self.inv_freq = inv_freq
        # RoPE's attention factor (LongRoPE) scales the cos and sin of q and k alike: with every
        # dimension rotated (check_supported) that is q.k times its square
        self.attn_scale = cfg.attn_scale * cfg.rope.attn_factor ** 2
        # only the flash kernels read a quantized cache: every call goes to flash_attn.cu or
        # flash_decode.cu (the backend checks flash_ok at load)
        self.flash_only = kv.kv_type in KL.QUANT
        self.seq = ws.seq  # row -> sequence slot, for the rows of the current call
        self.mma = False  # tensor-core kernels for > mmv_rows rows (capturable) instead of cuBLAS
        # the current call's matvec rows: MAX_MMV_TOKENS, or for decode steps tune.decode_mmv_rows
        self.mmv_rows = L.MAX_MMV_TOKENS
        self.flash_rows = 0  # query rows a flash prefill block takes (0: flash_config's; packed prompts: 16)
        self.decode = False  # every row one token of its own sequence (a decode step), else prefill
        # a decode step's kernels over consecutive tokens of one sequence (speculative verification):
        # row i reads the keys rows before it write in the same call, so nothing loads them early;
        # each row's attention splits as a one-row step's (the matvecs' per-row sums do not depend
        # on the rows: on their path a row's logits are a decode step's, bit for bit)
        self.verify = False
        # a batch decode step whose rows hold many keys (the backend's choice, tiles_max_keys, only
        # where deep_ok): its attention on flash_decode.cu, not attention_tiles.cu (its own graphs)
        self.deep = False
        self._rope: L.RopeKV | None = None  # the RoPE + KV write attn_in left to attend's kernel
        self._own = False  # attn_in left the rows' K (rotated) and V for attend's flash_decode to cache
        self.retune(tune)
        self.f16: F16Weights | None = None  # made by load_f16
        self.gemm: CublasGemm | None = None  # made by load_f16 (the cuBLAS prefill path)
        self._q8_ready: tuple[str, int] | None = None  # (norm, rows) that q8_norm holds from an epilogue
        self._att_q8: L.Q8Vec | None = None  # q8_plain when the last attend wrote its output's int8 copy
        self._no_rests: dict[L.Q8Vec, L.Q8Vec] = {}  # _q8_for's views of the buffers with res 0

    def retune(self, tune: Tuning) -> None:
        """Take the tuning table's choices (at load; bench/inproc_variants.py again between
        variants, with the captured graphs dropped)."""
        self.tune = tune
        self.decode_mmv_rows = tune.decode_mmv_rows
        self.k.knobs = tune.knobs()
        # the attention kernel's block shapes of small and big calls
        self.attn_shapes = (attn_shape(self.cfg, tune.attn_small), attn_shape(self.cfg, tune.attn_big))

    def load_f16(self) -> None:
        """The f16 weights of the cuBLAS prefill path (resident copies or scratch), allocated;
        F16Weights.fill makes the resident copies."""
        if self.ws.max_rows > L.MAX_MMV_TOKENS and self.f16 is None:
            self.f16 = F16Weights(self.cfg, self.w, self.k, self.tune.f16_resident_max_bytes)
            self.gemm = CublasGemm()

    # ---- helpers -------------------------------------------------------------------------------
    def _small(self, rows: int) -> bool:
        return rows <= self.mmv_rows

    def _gemm16(self, x16: cp.ndarray, t: int, names: tuple[str, ...], y: cp.ndarray, accumulate: bool) -> None:
        """y[:t, :N] (+)= x16[:t, :K] @ W.T, W = the matrices ``names`` stacked by rows (f16)."""
        assert self.f16 is not None and self.gemm is not None
        w16 = self.f16.get(names)
        self.gemm.wt_x(w16.rows, t, w16.cols, w16.ptr, x16.data.ptr, x16.strides[0] // 2, y.data.ptr,
                       y.strides[0] // 4, accumulate)

    def _norm(self, x: cp.ndarray, name: str, y: cp.ndarray, res: cp.ndarray | None = None,
              f16: bool = False, q8: L.Q8Vec | None = None, w2: str | None = None,
              reduce: LL.RowReduce | None = None) -> None:
        """y = rmsnorm(x) (+ res); f16: also into ws.x16 (the next tensor-core matmul's input); q8:
        also the int8 copy (of y times RMSNorm w2's weight, for a matvec that applies that norm);
        reduce: x's rows summed over the ranks first (into x)."""
        x16 = self.ws.x16 if f16 else None
        LL.rmsnorm(self.k, x.data.ptr, x.strides[0] // 4, self.w.vec(name).data.ptr, y.data.ptr, y.strides[0] // 4,
                   x.shape[0], x.shape[1], self.cfg.rms_eps,
                   res.data.ptr if res is not None else None, res.strides[0] // 4 if res is not None else 0,
                   x16.data.ptr if x16 is not None else None, x16.strides[0] // 2 if x16 is not None else 0, q8=q8,
                   w2=self.w.vec(w2).data.ptr if w2 else None, reduce=reduce)

    def _sum_now(self, x: cp.ndarray) -> None:
        """x's sum over the ranks, if it waits for one, by an all-reduce of its own."""
        if self._unsummed is not None:
            assert self._unsummed.data.ptr == x.data.ptr and self._unsummed.shape == x.shape
            self._unsummed = None
            self.comm.all_reduce(x)

    def _sum_in_norm(self, x: cp.ndarray) -> LL.RowReduce | None:
        """The row sums for the norm kernel about to read x, if x waits for them (or, where that
        kernel cannot take them, an all-reduce now and None)."""
        if self._unsummed is None:
            return None
        reduce = self.comm.row_reduce(x)
        if reduce is None:
            self._sum_now(x)
        else:
            self._unsummed = None
        return reduce

    def _q8_for(self, t: int, mats: list[L.Mat], buf: L.Q8Vec | None, role: str) -> L.Q8Vec | None:
        """buf (an int8 activation buffer) when the matvec of these matrices over t rows takes it,
        with the rests where the tuning table gives them to ``role`` (one of tuning.ROLE_SETS)."""
        if buf is None or not self._small(t) or not L.q8_capable(mats):
            return None
        if not buf.res or role in self.tune.q8_res:
            return buf
        plain = self._no_rests.get(buf)  # the view without rests, made once per buffer
        if plain is None:
            plain = self._no_rests[buf] = dataclasses.replace(buf, res=0)
        return plain

    def _role_after(self, norm: str) -> str:
        """The matvec role an RMSNorm's output feeds."""
        return ("head" if norm == "output_norm.weight" else "glu" if norm.endswith(self.cfg.ffn_norm + ".weight")
                else "qkv")

    def _quantized(self, a: cp.ndarray, mats: list[L.Mat], role: str) -> L.Q8Vec | None:
        """a's int8 copy (quantize_q8, into q8_plain) when the matvec of mats takes int8 activations."""
        q8 = self._q8_for(a.shape[0], mats, self.ws.q8_plain, role)
        if q8 is not None:
            LL.quantize_q8(self.k, a.data.ptr, a.strides[0] // 4, a.shape[1], a.shape[0], q8)
        return q8

    def _epilogue_rows(self, x: cp.ndarray, name: str) -> int | None:
        """The first row of x in q8_norm when the last residual epilogue left x's rows there,
        multiplied by RMSNorm ``name``'s weight (x: rows of ws.x, as forward passes them)."""
        if self._q8_ready is None or self._q8_ready[0] != name:
            return None
        base, stride = self.ws.x.data.ptr, self.ws.x.strides[0]
        off = x.data.ptr - base
        if off < 0 or off % stride or x.strides[0] != stride or off // stride + x.shape[0] > self._q8_ready[1]:
            return None
        return off // stride

    def tiles(self, t: int, decode: bool | None = None) -> bool:
        """Whether a call of t rows (a decode step: ``decode``, else the current call's kind) takes
        attention_tiles.cu: batch decode steps, by shape only."""
        cfg = self.cfg
        decode = self.decode if decode is None else decode
        mode = self.tune.tiles
        if (not decode or self._small(t) or mode == "off" or not LA.tiles_ok(cfg.head_dim, cfg.head_dim_v)
                or self.flash_only or cfg.attn_sinks):  # (attention_tiles.cu adds no sinks)
            return False
        return mode == "on" or (t * cfg.n_head_kv >= self.tune.tiles_min_blocks and not self.deep)

    def deep_ok(self) -> bool:
        """Whether a batch decode step that attention_tiles.cu would take can run on flash_decode.cu
        instead (an f16 cache, the tuning table's flash_decode and flash_decode_batch)."""
        cfg = self.cfg
        return (self.tune.flash_decode and self.tune.flash_decode_batch and self.kv.kv_type == "f16"
                and LA.flash_ok(cfg.head_dim, cfg.head_dim_v, cfg.n_head // cfg.n_head_kv))

    def flash(self, t: int) -> bool:
        """Whether a call of t rows takes flash_attn.cu: prompt chunks over MAX_MMV_TOKENS rows (their
        rows are one sequence), by shape and the tuning table."""
        cfg = self.cfg
        return (not self.decode and not self._small(t) and (self.tune.flash or self.flash_only)
                and LA.flash_ok(cfg.head_dim, cfg.head_dim_v, cfg.n_head // cfg.n_head_kv))

    def decode_flash(self, t: int) -> bool:
        """Whether a call of t rows takes flash_decode.cu: with an f16 cache, decode steps on the
        matvecs (up to MAX_MMV_TOKENS rows), and larger ones that attention_tiles.cu does not take
        where the tuning table says so, by shape; with a q8_0 / q4_0 cache (only the flash kernels
        read it: the backend checks flash_ok at load) every call flash_prefill does not take."""
        cfg = self.cfg
        if self.flash_only:
            return self.decode or self._small(t)
        return (self.decode and self.tune.flash_decode and self.kv.kv_type == "f16"
                and (self._small(t) or self.tune.flash_decode_batch)
                and LA.flash_ok(cfg.head_dim, cfg.head_dim_v, cfg.n_head // cfg.n_head_kv))

    def _own_ok(self, t: int) -> bool:
        """Whether a call of t rows may leave its keys and values to flash_decode to quantize into
        a q8_0 / q4_0 cache (decode rows that load early; the tuning table's own_row)."""
        return (self.flash_only and self.decode and not self.verify and self.tune.attn_early and self.tune.own_row
                and self._small(t))

    def _rope_in_attention(self, t: int, rope: L.RopeKV) -> bool:
        """Whether a call of t rows leaves rope_kv's work to flash_decode (f16 caches, decode rows
        that load early; the tuning table's decode_rope): where the QKV matvec's epilogue cannot do
        it (QK norms, NEOX pairs) and on the tensor-core path, whose products have no such epilogue."""
        cfg = self.cfg
        return (self.tune.decode_rope and self.decode and not self.verify and self.tune.attn_early
                and self.kv.kv_type == "f16" and not self.k.knobs.decode_bulk and not self.tiles(t)
                and self.decode_flash(t) and rope.head_dim == rope.head_dim_v == cfg.head_dim
                and rope.n_rot % 2 == 0 and not (self._small(t) and rope.fusable))

    def _big_mma(self, t: int) -> bool:
        return self.mma and not self._small(t)

    def _head_mma(self, t: int) -> bool:
        """A decode step of t rows takes the output head on the tensor cores from the tuning table's
        head_mma_rows; a verification's rows keep the matvec head of a one-row step, so speculation's
        greedy tokens stay those of plain decoding."""
        n = self.tune.head_mma_rows
        return self.decode and not self.verify and 0 < n <= t and self.ws.x16 is not None

    def _normed(self, x: cp.ndarray, name: str, mats: list[L.Mat], mma: bool = False
                ) -> tuple[cp.ndarray, tuple[int, float] | None, L.Q8Vec | None]:
        """The input of the products with ``mats`` after RMSNorm ``name``: on the matvec path (x, the
        norm for the matvec to fuse, None); otherwise (ws.h, None, q8) with ws.h (and ws.x16 on the
        tensor-core and cuBLAS paths, and the int8 copy q8 where the matvec takes it) written by a
        norm kernel. ``mma``: the products run on the tensor cores whatever the rows (ws.x16)."""
        t = x.shape[0]
        q8 = None if mma else self._q8_for(t, mats, self.ws.q8_norm, self._role_after(name))
        if q8 is None and not mma and self._small(t) and x.shape[1] <= self.tune.fuse_norm_max_cols:
            self._sum_now(x)
            return x, (self.w.vec(name).data.ptr, self.cfg.rms_eps), None
        row = self._epilogue_rows(x, name) if q8 is not None else None
        if row is not None:  # no norm kernel: the matvec normalizes (matvec_block.cuh)
            self._sum_now(x)
            return x, None, dataclasses.replace(q8.rows_from(row), norm_eps=self.cfg.rms_eps)
        h = self.ws.h[:t]
        self._norm(x, name, h, f16=True, q8=q8, reduce=self._sum_in_norm(x))
        self._q8_ready = None
        return h, None, q8

    # ---- blocks --------------------------------------------------------------------------------
    def embed(self, tokens: cp.ndarray) -> cp.ndarray:
        t = tokens.shape[0]
        x = self.ws.x[:t]
        self._q8_ready = None
        self._unsummed = None
        LL.embed(self.k, self.w.mat("token_embd.weight"), tokens.data.ptr, t, x.data.ptr, x.strides[0] // 4,
                 self.cfg.embed_scale)
        return x

    def attn_in(self, x: cp.ndarray, layer: int, positions: cp.ndarray) -> cp.ndarray:
        cfg, ws, p = self.cfg, self.ws, f"blk.{layer}."
        t = x.shape[0]
        qkv = ws.qkv[:t]
        hq, hk, d = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim, cfg.head_dim
        names = [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]
        h, norm, q8 = self._normed(x, p + "attn_norm.weight", [self.w.mat(n) for n in names])
        cols = [0, hq, hq + hk]
        biases = [p + "attn_q.bias", p + "attn_k.bias", p + "attn_v.bias"] if cfg.attn_bias else [None] * 3
        ld = qkv.strides[0] // 4
        kc, vc = self.kv.layer(layer)
        qn = self.w.vec(p + "attn_q_norm.weight").data.ptr if cfg.qk_norm else None
        kn = self.w.vec(p + "attn_k_norm.weight").data.ptr if cfg.qk_norm else None
        rope = L.RopeKV(qkv.data.ptr, ld, cfg.n_head, cfg.n_head_kv, d, cfg.head_dim_v, cfg.rope.n_dims,
                        cfg.rope.style == ROPE_NEOX, qn, kn, cfg.rms_eps, self.inv_freq[cfg.rope_key(layer)].data.ptr,
                        positions.data.ptr, self.seq.data.ptr, self.kv.table.data.ptr, self.kv.max_pages,
                        self.kv.page_size, kc, vc, self.kv.kv_type,
                        own=self._own_ok(t))
        in_attention = self._rope_in_attention(t, rope)
        if in_attention:
            self._rope = rope  # attend's flash_decode applies it
        if self._small(t):  # RoPE + KV write in the matvec's epilogue where it can (else a rope_kv launch)
            fused = L.mmv(self.k, [self.w.mat(n) for n in names], [(qkv.data.ptr + 4 * c, ld) for c in cols],
                          [self.w.vec(b).data.ptr if b else None for b in biases], h.data.ptr, h.strides[0] // 4,
                          t, 0, norm=norm, rope=None if in_attention else rope, q8=q8,
                          config=self.tune.mmv_override("QKV"), kstage="qkv" in self.tune.kstage)
            self._own = rope.own and fused  # attend's flash_decode writes the rows' keys and values
            return qkv
        if self.mma:
            LM.mma(self.k, [self.w.mat(n) for n in names], [(qkv.data.ptr + 4 * c, ld) for c in cols],
                  [self.w.vec(b).data.ptr if b else None for b in biases], ws.x16.data.ptr, ws.x16.strides[0] // 2,
                  t, 0, ws.split)
        else:
            self._gemm16(ws.x16, t, tuple(names), qkv, accumulate=False)
            for n, c, b in zip(names, cols, biases):
                if b:
                    LL.add_bias(self.k, qkv.data.ptr + 4 * c, ld, self.w.vec(b).data.ptr, self.w.mat(n).rows, t)
        if (self.tiles(t) and self.tune.attn_early and self.tune.tiles_rope and rope.qnw is None and rope.knw is None
                and rope.n_rot % 2 == 0):
            self._rope = rope  # attend's kernel applies it (attention_tiles.cu)
        elif not in_attention:
            rope.launch(self.k, 0, t)
        return qkv

    def attend(self, layer: int, q: cp.ndarray, positions: cp.ndarray) -> cp.ndarray:
        cfg, ws = self.cfg, self.ws
        t = q.shape[0]
        out = ws.att[:t]
        kc, vc = self.kv.layer(layer)
        own, self._own = self._own, False
        # the int8 copy for the O projection, written by the attention kernel itself (attn_out takes it)
        q8 = self._q8_for(t, [self.w.mat(f"blk.{layer}.attn_output.weight")], ws.q8_plain, "o")
        self._att_q8 = q8 if q8 is not None and cfg.head_dim % 16 == 0 else None
        if self.tiles(t):
            rope, self._rope = self._rope, None
            LA.attention_tiles(self.k, q.data.ptr, q.strides[0] // 4, t, kc, vc, positions.data.ptr,
                               self.seq.data.ptr, self.kv.table.data.ptr, self.kv.max_pages, self.kv.page_size,
                               cfg.n_head, cfg.n_head_kv, cfg.head_dim, self.attn_scale, cfg.attn_softcap or 0.0,
                               cfg.layer_window[layer], out.data.ptr, out.strides[0] // 4, ws.x16.data.ptr,
                               ws.x16.strides[0] // 2, early=self.tune.attn_early,
                               inv_freq=rope.inv_freq if rope else 0, n_rot=rope.n_rot if rope else 0,
                               neox=rope.neox if rope else False, kv=self.kv.kv_type)
            return out
        if self.flash(t):  # a prompt chunk: one sequence (prefill.py), tensor-core flash attention
            LA.flash_prefill(self.k, q.data.ptr, q.strides[0] // 4, t, kc, vc, positions.data.ptr, self.seq.data.ptr,
                             self.kv.table.data.ptr, self.kv.max_pages, self.kv.page_size, cfg.n_head, cfg.n_head_kv,
                             cfg.head_dim, self.attn_scale, cfg.attn_softcap or 0.0, cfg.layer_window[layer],
                             out.data.ptr, out.strides[0] // 4, ws.x16.data.ptr, ws.x16.strides[0] // 2,
                             kv=self.kv.kv_type, sinks=self._sinks(layer), config=self._flash_config())
            return out
        if self.decode_flash(t):  # a decode step on the matvecs: tensor-core attention, keys split
            rope, self._rope = self._rope, None
            LA.flash_decode(self.k, q.data.ptr, q.strides[0] // 4, t, kc, vc, positions.data.ptr, self.seq.data.ptr,
                            self.kv.table.data.ptr, self.kv.max_pages, self.kv.page_size, cfg.n_head, cfg.n_head_kv,
                            cfg.head_dim, self.attn_scale, cfg.attn_softcap or 0.0, cfg.layer_window[layer],
                            n_splits(self.tune, t, self.mmv_rows), ws.part_o.data.ptr, ws.part_ml.data.ptr,
                            ws.attn_counter.data.ptr, out.data.ptr, out.strides[0] // 4,
                            None if self._small(t) else ws.x16.data.ptr,
                            0 if self._small(t) else ws.x16.strides[0] // 2, q8=self._att_q8,
                            early=self.decode and self.tune.attn_early and not self.verify, kv=self.kv.kv_type,
                            sinks=self._sinks(layer), own=(q.data.ptr, q.strides[0] // 4) if own else None,
                            per_row=self.verify, config=self._deep_config(), rope=rope)
            return out
        LA.attention(self.k, q.data.ptr, q.strides[0] // 4, t, kc, vc, positions.data.ptr, self.seq.data.ptr,
                    self.kv.table.data.ptr, self.kv.max_pages, self.kv.page_size, cfg.n_head, cfg.n_head_kv,
                    cfg.head_dim, self.attn_scale, cfg.attn_softcap or 0.0, cfg.layer_window[layer],
                    n_splits(self.tune, t, self.mmv_rows), ws.part_o.data.ptr, ws.part_ml.data.ptr,
                    ws.attn_counter.data.ptr,
                    out.data.ptr, out.strides[0] // 4, None if self._small(t) else ws.x16.data.ptr,
                    0 if self._small(t) else ws.x16.strides[0] // 2, q8=self._att_q8,
                    shape=self.attn_shapes[not self._small(t)],
                    early=self.decode and self.tune.attn_early and not self.verify, kv=self.kv.kv_type,
                    sinks=self._sinks(layer))
        return out

    def _deep_config(self) -> tuple[int, int, int] | None:
        """flash_decode's (warps, keys a tile, stages) for a deep batch step (the tuning table's
        deep_decode_*), None for other steps (the decode knobs' or decode_config's rule)."""
        t = self.tune
        if not self.deep or (t.deep_decode_shape is None and not t.deep_decode_warps):
            return None
        knobs = (t.deep_decode_warps, *(t.deep_decode_shape or (0, 0)))
        return LA.decode_config(self.cfg.head_dim, self.kv.kv_type, knobs)

    def _flash_config(self) -> tuple[int, int, int] | None:
        """flash_prefill's (WT, KT, ST) with flash_rows query rows a block, or None (its rule)."""
        if not self.flash_rows:
            return None
        cfg = self.cfg
        _, kt, st = LA.flash_config(cfg.head_dim, cfg.n_head // cfg.n_head_kv, self.kv.kv_type, self.k.knobs.flash)
        return max(1, self.flash_rows // 16), kt, st

    def _sinks(self, layer: int) -> int:
        """The layer's attention sink logits (gpt-oss: one a head), or 0."""
        return self.w.vec(f"blk.{layer}.attn_sinks.weight").data.ptr if self.cfg.attn_sinks else 0

    def _project_residual(self, a: cp.ndarray, name: str, x: cp.ndarray, post_norm: str | None,
                          a16: cp.ndarray | None = None, a_q8: L.Q8Vec | None = None,
                          then: tuple[str, list[L.Mat]] | None = None, defer_reduce: bool = False,
                          norm_next: bool = False, bias: int = 0) -> cp.ndarray:
        """x += post_norm(W a) (no norm: straight into x). a16: a's f16 copy (over MAX_MMV_TOKENS
        rows); a_q8: a's int8 copy when already written; then = (the next RMSNorm, the matrices it
        feeds): on the int8 path the epilogue also writes x * its weight into q8_norm. norm_next:
        the next block's _normed reads x next (a split model may leave the sum to that norm).
        bias: W's bias (f32 rows), added by the matvec (within MAX_MMV_TOKENS rows only)."""
        t = a.shape[0]
        assert not bias or (self._small(t) and not post_norm)
        target = self.ws.o[:t] if post_norm else x
        self._q8_ready = None
        # a split model: rank 0's product adds the residual, the others' overwrite x, and the
        # all-reduce sums them (x is the same on every rank); no epilogue sees a partial sum
        beta = 0 if post_norm or not self.lead else 1
        if self.comm is not None:
            then = None
        if self._small(t):
            w = self.w.mat(name)
            role = "O" if name.endswith("attn_output.weight") else "DOWN"
            q8 = a_q8 or self._quantized(a, [w], role.lower())
            out = None
            if (q8 is not None and then is not None and not post_norm and x.data.ptr == self.ws.x.data.ptr
                    and w.rows % L.Q8_OUT_ROWS == 0):
                nq8 = self._q8_for(t, then[1], self.ws.q8_norm, self._role_after(then[0]))
                if nq8 is not None:
                    out = (nq8, self.w.vec(then[0]).data.ptr)
                    self._q8_ready = (then[0], t)
            L.mmv(self.k, [w], [(target.data.ptr, target.strides[0] // 4)], [bias or None], a.data.ptr,
                  a.strides[0] // 4, t, beta, q8=q8, q8_out=out,
                  config=self.tune.mmv_override(role, FORMATS[w.type_id].name),
                  kstage=role.lower() in self.tune.kstage)
        elif self.mma:
            LM.mma(self.k, [self.w.mat(name)], [(target.data.ptr, target.strides[0] // 4)], [None], a16.data.ptr,
                  a16.strides[0] // 2, t, beta, self.ws.split)
        else:
            self._gemm16(a16, t, (name,), target, accumulate=beta == 1)
        if self.comm is not None and (post_norm or not defer_reduce):
            if norm_next and not post_norm and self.comm.sums_in_norm(t):
                self._unsummed = target  # (summed by the next norm's launch: _sum_in_norm)
            else:
                self.comm.all_reduce(target)
        if post_norm:  # x += post_norm(target); on the int8 path also the next norm's input, as above
            q8 = None
            if then is not None and self.tune.post_q8 and x.data.ptr == self.ws.x.data.ptr and x.shape[1] % 16 == 0:
                q8 = self._q8_for(t, then[1], self.ws.q8_norm, self._role_after(then[0]))
                if q8 is not None:
                    self._q8_ready = (then[0], t)
            self._norm(target, post_norm, x, res=x, q8=q8, w2=then[0] if q8 is not None else None)
        return x

    def attn_out(self, x: cp.ndarray, a: cp.ndarray, layer: int) -> cp.ndarray:
        p = f"blk.{layer}."
        # the next norm's int8 input from the epilogue (a mixture of experts: _moe_then's)
        then = self._moe_then(p, a.shape[0]) if self.cfg.n_expert else (
            p + self.cfg.ffn_norm + ".weight", [self.w.mat(p + "ffn_gate.weight"), self.w.mat(p + "ffn_up.weight")])
        a_q8, self._att_q8 = self._att_q8, None  # attend's int8 copy of a (this layer's, just written)
        # (gpt-oss) O's bias: in the matvec's epilogue on one GPU, else added after the product
        bias = self.w.vec(p + "attn_output.bias").data.ptr if self.cfg.o_bias else 0
        in_mv = bool(bias) and self.comm is None and self._small(a.shape[0])
        after = bool(bias) and not in_mv
        if after:  # no epilogue writes the next norm's input
            then = None
        x = self._project_residual(a, p + "attn_output.weight", x,
                                   p + "post_attention_norm.weight" if self.cfg.post_norms else None,
                                   a16=None if self._small(a.shape[0]) else self.ws.x16, a_q8=a_q8, then=then,
                                   defer_reduce=after, norm_next=not self.cfg.n_expert, bias=bias if in_mv else 0)
        if after:  # (split: rank 0's bias, the others' zeros, then the sum)
            LL.add_bias(self.k, x.data.ptr, x.strides[0] // 4, bias, self.cfg.n_embd, a.shape[0])
            if self.comm is not None:
                self.comm.all_reduce(x)
        return x

    def _after_ffn(self, layer: int) -> tuple[str, list[L.Mat]]:
        """The RMSNorm after layer's FFN and the matrices it feeds."""
        if layer + 1 == self.cfg.n_layer:
            return "output_norm.weight", [self.w.mat(lm_head_name(self.cfg))]
        p = f"blk.{layer + 1}."
        return p + "attn_norm.weight", [self.w.mat(p + n) for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight")]

    def ffn(self, x: cp.ndarray, layer: int) -> cp.ndarray:
        if self.cfg.n_expert:
            return self._moe(x, layer)
        cfg, ws, p = self.cfg, self.ws, f"blk.{layer}."
        t = x.shape[0]
        g = ws.g[:t]
        more = layer + 1 < cfg.n_layer  # (the next layer's norm reads x next; after the last, the caller)
        gate_name, up_name = p + "ffn_gate.weight", p + "ffn_up.weight"
        gate, up = self.w.mat(gate_name), self.w.mat(up_name)
        post = p + "post_ffw_norm.weight" if cfg.post_norms else None
        big = self._big_mma(t)
        h, norm, q8 = self._normed(x, p + cfg.ffn_norm + ".weight", [gate, up])
        down = p + "ffn_down.weight"
        if self._small(t) and gate.type_id == up.type_id:
            g_q8 = None  # the GLU's epilogue writes the int8 input of the down projection
            if q8 is not None and gate.rows % L.Q8_OUT_ROWS == 0:
                g_q8 = self._q8_for(t, [self.w.mat(down)], self.ws.q8_plain, "down")
            L.mmv_glu(self.k, gate, up, h.data.ptr, h.strides[0] // 4, t, cfg.activation, g.data.ptr,
                      g.strides[0] // 4, norm=norm, q8=q8, q8_out=g_q8, config=self.tune.mmv_override("GLU"),
                      kstage="glu" in self.tune.kstage)
            return self._project_residual(g, down, x, post, a_q8=g_q8, then=self._after_ffn(layer), norm_next=more)
        if big and gate.type_id == up.type_id:
            g16 = ws.g16
            LM.mma_glu(self.k, gate, up, ws.x16.data.ptr, ws.x16.strides[0] // 2, t, cfg.activation, g16.data.ptr,
                      g16.strides[0] // 2, ws.split)
            return self._project_residual(g, down, x, post, a16=g16, then=self._after_ffn(layer), norm_next=more)
        if self._small(t) or big:
            u = ws.u[:t]
            if big:
                x16, ld16 = ws.x16.data.ptr, ws.x16.strides[0] // 2
                LM.mma(self.k, [gate], [(g.data.ptr, g.strides[0] // 4)], [None], x16, ld16, t, 0, ws.split)
                LM.mma(self.k, [up], [(u.data.ptr, u.strides[0] // 4)], [None], x16, ld16, t, 0, ws.split)
            else:
                L.mmv(self.k, [gate], [(g.data.ptr, g.strides[0] // 4)], [None], h.data.ptr, h.strides[0] // 4, t, 0,
                      norm=norm, q8=q8)
                L.mmv(self.k, [up], [(u.data.ptr, u.strides[0] // 4)], [None], h.data.ptr, h.strides[0] // 4, t, 0,
                      norm=norm, q8=q8)
            g16 = ws.g16 if big else None
            LL.glu(self.k, g.data.ptr, u.data.ptr, g.strides[0] // 4, cfg.n_ff, t, cfg.activation, g.data.ptr,
                   g.strides[0] // 4, g16.data.ptr if big else None, g16.strides[0] // 2 if big else 0)
            return self._project_residual(g, down, x, post, a16=g16, then=self._after_ffn(layer), norm_next=more)
        u = ws.u[:t]
        self._gemm16(ws.x16, t, (gate_name, up_name), g, accumulate=False)  # g | u: adjacent halves
        LL.glu(self.k, g.data.ptr, u.data.ptr, g.strides[0] // 4, cfg.n_ff, t, cfg.activation, None, 0,
               ws.x16.data.ptr, ws.x16.strides[0] // 2)
        return self._project_residual(g, down, x, post, a16=ws.x16, norm_next=more)

    def _moe_then(self, p: str, t: int) -> tuple[str, list[L.Mat]] | None:
        """The FFN norm and the experts' gate and up for O's epilogue to write their int8 input
        (steps of t rows up to tuning moe_norm_epilogue: no norm kernel, the router and the expert
        products normalize), where _moe's matvec path takes it: no biases, no shared expert, int8
        inputs for both."""
        cfg = self.cfg
        if not 0 < t <= self.tune.moe_norm_epilogue or cfg.expert_bias or cfg.n_ff_shexp:
            return None
        mats = [self.w.mat(p + "ffn_gate_exps.weight"), self.w.mat(p + "ffn_up_exps.weight")]
        if mats[0].type_id != mats[1].type_id or not L.q8_capable(mats):
            return None
        return p + cfg.ffn_norm + ".weight", mats

    def _moe(self, x: cp.ndarray, layer: int) -> cp.ndarray:
        """x += the chosen experts' SwiGLUs (model.ComposedBlocks.moe): a norm kernel writes h (and its
        int8 copy where the experts' matvecs take it), the router's logits and top-k stay on the
        device. Within the matvec rows each (token, rank) slot is one matvec over its expert's rows
        (moe.cu; down's input the GLU's outputs quantized to int8) and the down kernel sums the k
        products into x; past them, _moe_mma. A split model (format/shard.py: each expert's rows on
        every rank): every rank picks the same experts, its parts add into x (the residual on rank 0
        alone: the others' x is zeroed once h is made), and the all-reduce sums them."""
        self._sum_now(x)
        self._moe_ffn(x, layer)
        if self.comm is not None:
            self.comm.all_reduce(x)
        return x

    def _moe_ffn(self, x: cp.ndarray, layer: int) -> cp.ndarray:
        cfg, ws, p = self.cfg, self.ws, f"blk.{layer}."
        t, used = x.shape[0], cfg.n_expert_used
        slots = t * used
        gate, up = self.w.mat(p + "ffn_gate_exps.weight"), self.w.mat(p + "ffn_up_exps.weight")
        down = self.w.mat(p + "ffn_down_exps.weight")
        h = ws.h[:t]
        norm_name = p + cfg.ffn_norm + ".weight"
        q8 = self._q8_for(t, [gate, up], ws.q8_norm, "glu")
        row = self._epilogue_rows(x, norm_name) if q8 is not None else None
        if row is None:
            self._norm(x, norm_name, h, q8=q8)
            src, rnorm = h, None
        else:  # O's epilogue wrote x * the norm's weight as int8 with its squares: the products normalize
            q8 = dataclasses.replace(q8.rows_from(row), norm_eps=cfg.rms_eps)
            src, rnorm = x, (self.w.vec(norm_name).data.ptr, cfg.rms_eps)
        self._q8_ready = None
        lds = src.strides[0] // 4
        logits, ids, w = ws.moe_logits, ws.moe_ids.data.ptr, ws.moe_w.data.ptr
        router = self.w.mat(p + "ffn_gate_inp.weight")
        glu_topk = None
        if self.tune.moe_router_topk and not cfg.expert_bias and t <= LE.ROUTER_TILE and router.struct == "TF32":
            LE.router_topk(self.k, router, src.data.ptr, lds, t, logits.data.ptr, logits.strides[0] // 4, used,
                           cfg.expert_norm, ids, w, ws.moe_count.data.ptr, norm=rnorm)
        else:
            LE.router(self.k, router, src.data.ptr, lds, t, logits.data.ptr, logits.strides[0] // 4, norm=rnorm)
            bias = self.w.vec(p + "ffn_gate_inp.bias").data.ptr if cfg.expert_bias else 0  # (added by topk)
            one_wave = LE.glu_blocks(cfg.n_ff_exp, slots, self.tune.moe_rows[0]) <= \
                self.tune.moe_topk_glu_blocks * self.tune.sm_count
            if self._small(t) and gate.type_id == up.type_id and one_wave:
                # the matvec GLU picks the experts (its first kernel to read them) and writes them for down
                glu_topk = LE.TopK(logits.data.ptr, logits.strides[0] // 4, cfg.n_expert, cfg.expert_norm, w, bias)
            else:
                LE.topk(self.k, logits.data.ptr, logits.strides[0] // 4, cfg.n_expert, used, cfg.expert_norm, t,
                        ids, w, bias=bias)
        if self.comm is not None and not self.lead:  # (h and the experts are chosen: only this rank's parts add)
            cp.cuda.runtime.memsetAsync(x.data.ptr, 0, t * x.strides[0], cp.cuda.get_current_stream().ptr)
        if cfg.expert_bias:
            self._moe_biased(x, h, q8, layer, glu_topk)
            return x
        g, n = ws.moe_g, cfg.n_ff_exp
        ldg = g.strides[0] // 4
        if not self._small(t) and gate.type_id == up.type_id and gate.cols % 8 == 0 and down.cols % 8 == 0:
            self._moe_mma(x, h, gate, up, down, slots)
            if cfg.n_ff_shexp:
                self._shared_expert(x, h, q8, layer)
            return x
        gq = self._q8_for(t, [down], ws.moe_gq, "down") if t <= L.MAX_MMV_TOKENS and self.tune.moe_down_q8 else None
        r_glu = self.tune.moe_rows[0]
        fused = gq is not None and gate.type_id == up.type_id and r_glu == 8 and n % 16 == 0
        if gate.type_id == up.type_id:  # (fused: the GLU's q8 epilogue writes down's int8 input)
            LE.glu(self.k, gate, up, n, ids, used, src.data.ptr, lds, slots, cfg.activation, g.data.ptr, ldg, q8=q8,
                   r=r_glu, q8_out=gq if fused else None, mb=self._moe_min_blocks(gate, 0, q8), topk=glu_topk)
        else:
            u = ws.moe_u
            for m, out in ((gate, g), (up, u)):
                LE.mv(self.k, m, n, ids, used, src.data.ptr, lds, slots, out.data.ptr, ldg,
                      q8=q8 if L.q8_capable([m]) else None)
            LL.glu(self.k, g.data.ptr, u.data.ptr, ldg, n, slots, cfg.activation, g.data.ptr, ldg)
        if gq is not None and not fused:
            LL.quantize_q8(self.k, g.data.ptr, ldg, n, slots, gq)
        then, out = self._down_then(x, layer, down, gq), None
        if then is not None:
            out = (then[1], self.w.vec(then[0]).data.ptr)
        LE.down(self.k, down, cfg.n_embd, ids, w, used, g.data.ptr, ldg, t, x.data.ptr, x.strides[0] // 4, q8=gq,
                r=self.tune.moe_rows[1], mb=self._moe_min_blocks(down, 1, gq),
                sub=self.tune.moe_down_sub, q8_out=out)
        if then is not None:
            self._q8_ready = (then[0], t)
        if cfg.n_ff_shexp:
            self._shared_expert(x, h, q8, layer)
        return x

    def _down_then(self, x: cp.ndarray, layer: int, down: L.Mat, gq: L.Q8Vec | None
                   ) -> tuple[str, L.Q8Vec] | None:
        """(the RMSNorm after this layer's FFN, its int8 input buffer) where the experts' down writes
        that input in its epilogue (tuning moe_down_epilogue): 16 rows a block in sub-warp sets, one
        GPU, no shared expert adding after it, x the rows of ws.x."""
        t = x.shape[0]
        if (not 0 < t <= self.tune.moe_down_epilogue or self.comm is not None or self.cfg.n_ff_shexp
                or not self.tune.moe_down_sub or not LE.down_sub(down, gq) or self.cfg.n_embd % 16
                or self.tune.moe_rows[1] != LE.DOWN_Q8_OUT_R
                or x.data.ptr != self.ws.x.data.ptr):
            return None
        name, mats = self._after_ffn(layer)
        nq8 = self._q8_for(t, mats, self.ws.q8_norm, self._role_after(name))
        return (name, nq8) if nq8 is not None else None

    def _moe_min_blocks(self, m: L.Mat, which: int, q8: L.Q8Vec | None) -> int:
        """Launch bounds of the experts' matvec GLU (which 0) or down (1): the tuning table's for the
        type, on int8 inputs only (the measured path; on f32 inputs some types would spill)."""
        return self.tune.moe_bounds(FORMATS[m.type_id].name)[which] if q8 is not None else 1

    def _moe_biased(self, x: cp.ndarray, h: cp.ndarray, q8: L.Q8Vec | None, layer: int,
                    glu_topk: LE.TopK | None) -> None:
        """The experts with biases (gpt-oss: gate, up and down each add its expert's row) and its
        clamped SwiGLU: within the matvec rows moe_glu adds the gate and up biases before the GLU
        (its q8 epilogue writing down's int8 input) and moe_down adds down's under the router's
        weights; past them the slots sorted by expert into tensor-core tiles for each product
        (moe_mma_down's kernel: outputs in slot order), the biases and the GLU (layers.cu) in slot
        order, its outputs gathered back in expert order (f16) for down, combined in rank order.
        glu_topk: the GLU picks the experts (_moe_ffn launched no top-k)."""
        cfg, ws, p = self.cfg, self.ws, f"blk.{layer}."
        t, used, n = x.shape[0], cfg.n_expert_used, cfg.n_ff_exp
        slots = t * used
        gate, up, down = (self.w.mat(p + f"ffn_{m}_exps.weight") for m in ("gate", "up", "down"))
        bias = {m: self.w.mat(p + f"ffn_{m}_exps.bias").qs for m in ("gate", "up", "down")}  # [experts, n] f32
        ids, w = ws.moe_ids.data.ptr, ws.moe_w.data.ptr
        g, u = ws.moe_g[:slots], ws.moe_u[:slots]
        ldh, ldg = h.strides[0] // 4, g.strides[0] // 4
        if self._small(t):
            gq = (self._q8_for(t, [down], ws.moe_gq, "down")
                  if t <= L.MAX_MMV_TOKENS and self.tune.moe_down_q8 and n % 16 == 0 else None)
            r_glu = self.tune.moe_rows[0]
            if gate.type_id == up.type_id:  # biases and GLU in moe_glu (fused: its q8 epilogue writes gq)
                fused = gq is not None and r_glu == 8
                LE.glu(self.k, gate, up, n, ids, used, h.data.ptr, ldh, slots, cfg.activation, g.data.ptr, ldg,
                       q8=q8, r=r_glu, q8_out=gq if fused else None, biases=(bias["gate"], bias["up"]),
                       mb=self._moe_min_blocks(gate, 0, q8), topk=glu_topk)
            else:
                fused = False
                for m, out, name in ((gate, g, "gate"), (up, u, "up")):
                    LE.mv(self.k, m, n, ids, used, h.data.ptr, ldh, slots, out.data.ptr, ldg,
                          q8=q8 if L.q8_capable([m]) else None)
                    LE.add_bias(self.k, out.data.ptr, ldg, bias[name], ids, n, slots)
                LL.glu(self.k, g.data.ptr, u.data.ptr, ldg, n, slots, cfg.activation, g.data.ptr, ldg)
            if gq is not None and not fused:
                LL.quantize_q8(self.k, g.data.ptr, ldg, n, slots, gq)
            LE.down(self.k, down, cfg.n_embd, ids, w, used, g.data.ptr, ldg, t, x.data.ptr, x.strides[0] // 4, q8=gq,
                    r=self.tune.moe_rows[1], bias=bias["down"],
                    mb=self._moe_min_blocks(down, 1, gq), sub=self.tune.moe_down_sub)
            return
        tb = LE.mma_tile_slots(slots, cfg.n_expert, self.tune.moe_mma_slots)
        order, tiles, xs, g16, ys = ws.moe_order, ws.moe_tiles, ws.moe_xs16, ws.moe_g16b, ws.moe_ys
        n_tiles = LE.max_tiles(slots, cfg.n_expert, tb)
        LE.sort(self.k, ids, slots, cfg.n_expert, ws.moe_pos.data.ptr, order.data.ptr, tiles.data.ptr, tb)
        LE.gather_f16(self.k, h.data.ptr, ldh, order.data.ptr, used, cfg.n_embd, xs.data.ptr, xs.strides[0] // 2, slots)
        for m, out, name in ((gate, g, "gate"), (up, u, "up")):
            LE.down_mma(self.k, m, n, tiles.data.ptr, n_tiles, order.data.ptr, xs.data.ptr, xs.strides[0] // 2,
                        out.data.ptr, ldg, tb)
            LE.add_bias(self.k, out.data.ptr, ldg, bias[name], ids, n, slots)
        LL.glu(self.k, g.data.ptr, u.data.ptr, ldg, n, slots, cfg.activation, g.data.ptr, ldg)
        LE.gather_f16(self.k, g.data.ptr, ldg, order.data.ptr, 1, n, g16.data.ptr, g16.strides[0] // 2, slots)
        LE.down_mma(self.k, down, cfg.n_embd, tiles.data.ptr, n_tiles, order.data.ptr, g16.data.ptr,
                    g16.strides[0] // 2, ys.data.ptr, ys.strides[0] // 4, tb)
        LE.add_bias(self.k, ys.data.ptr, ys.strides[0] // 4, bias["down"], ids, cfg.n_embd, slots)
        LE.combine(self.k, ys.data.ptr, ys.strides[0] // 4, w, used, x.data.ptr, x.strides[0] // 4, cfg.n_embd, t)

    def _shared_expert(self, x: cp.ndarray, h: cp.ndarray, q8: L.Q8Vec | None, layer: int) -> None:
        """x += sigmoid(h . w) SwiGLU(h) (Qwen2-MoE's shared expert, model.ComposedBlocks.moe): on the
        matvec path with h's int8 copy (q8, the experts'; made here when they had none), past it on
        the tensor cores with h in f16; the gate an f32 dot product in add_gated."""
        cfg, ws, p = self.cfg, self.ws, f"blk.{layer}."
        t = x.shape[0]
        gate, up, down = (self.w.mat(p + f"ffn_{n}_shexp.weight") for n in ("gate", "up", "down"))
        g, u, y = ws.shexp_g[:t], ws.shexp_u[:t], ws.shexp_y[:t]
        ldh, ldg, ldy = h.strides[0] // 4, g.strides[0] // 4, y.strides[0] // 4
        if self._small(t):
            if not L.q8_capable([gate, up]):
                q8 = None
            elif q8 is None:
                q8 = self._quantized(h, [gate, up], "glu")
            if gate.type_id == up.type_id:
                L.mmv_glu(self.k, gate, up, h.data.ptr, ldh, t, cfg.activation, g.data.ptr, ldg, q8=q8)
            else:
                for m, out in ((gate, g), (up, u)):
                    L.mmv(self.k, [m], [(out.data.ptr, ldg)], [None], h.data.ptr, ldh, t, 0,
                          q8=q8 if L.q8_capable([m]) else None)
                LL.glu(self.k, g.data.ptr, u.data.ptr, ldg, cfg.n_ff_shexp, t, cfg.activation, g.data.ptr, ldg)
            L.mmv(self.k, [down], [(y.data.ptr, ldy)], [None], g.data.ptr, ldg, t, 0,
                  q8=self._quantized(g, [down], "down"))
        else:
            x16, g16 = ws.x16, ws.shexp_g16
            ld16, ldg16 = x16.strides[0] // 2, g16.strides[0] // 2
            LE.gather_f16(self.k, h.data.ptr, ldh, ws.rows_in_order.data.ptr, 1, cfg.n_embd, x16.data.ptr, ld16, t)
            if gate.type_id == up.type_id:
                LM.mma_glu(self.k, gate, up, x16.data.ptr, ld16, t, cfg.activation, g16.data.ptr, ldg16, ws.split)
            else:
                for m, out in ((gate, g), (up, u)):
                    LM.mma(self.k, [m], [(out.data.ptr, ldg)], [None], x16.data.ptr, ld16, t, 0, ws.split)
                LL.glu(self.k, g.data.ptr, u.data.ptr, ldg, cfg.n_ff_shexp, t, cfg.activation, None, 0, g16.data.ptr,
                       ldg16)
            LM.mma(self.k, [down], [(y.data.ptr, ldy)], [None], g16.data.ptr, ldg16, t, 0, ws.split)
        LL.add_gated(self.k, x.data.ptr, x.strides[0] // 4, h.data.ptr, ldh,
                     self.w.vec(p + "ffn_gate_inp_shexp.weight").data.ptr, y.data.ptr, ldy, cfg.n_embd, t)

    def _moe_mma(self, x: cp.ndarray, h: cp.ndarray, gate: L.Mat, up: L.Mat, down: L.Mat, slots: int) -> None:
        """The experts' products grouped by expert on the tensor cores (moe_mma.cu): the slots sorted
        by expert in tiles of up to tb slots, their rows gathered in f16, the GLU's f16 outputs in that
        order into down, the products summed into x in rank order."""
        cfg, ws = self.cfg, self.ws
        t, used = x.shape[0], cfg.n_expert_used
        tb = LE.mma_tile_slots(slots, cfg.n_expert, self.tune.moe_mma_slots)
        order, tiles, xs, g, ys = ws.moe_order, ws.moe_tiles, ws.moe_xs16, ws.moe_g16, ws.moe_ys
        n_tiles = LE.max_tiles(slots, cfg.n_expert, tb)
        LE.sort(self.k, ws.moe_ids.data.ptr, slots, cfg.n_expert, ws.moe_pos.data.ptr, order.data.ptr,
                tiles.data.ptr, tb)
        LE.gather_f16(self.k, h.data.ptr, h.strides[0] // 4, order.data.ptr, used, cfg.n_embd, xs.data.ptr,
                      xs.strides[0] // 2, slots)
        LE.glu_mma(self.k, gate, up, cfg.n_ff_exp, tiles.data.ptr, n_tiles, xs.data.ptr, xs.strides[0] // 2,
                   cfg.activation, g.data.ptr, g.strides[0] // 2, tb)
        LE.down_mma(self.k, down, cfg.n_embd, tiles.data.ptr, n_tiles, order.data.ptr, g.data.ptr,
                    g.strides[0] // 2, ys.data.ptr, ys.strides[0] // 4, tb)
        LE.combine(self.k, ys.data.ptr, ys.strides[0] // 4, ws.moe_w.data.ptr, used, x.data.ptr, x.strides[0] // 4,
                   cfg.n_embd, t)

    def logits(self, x: cp.ndarray) -> cp.ndarray:
        cfg, ws = self.cfg, self.ws
        t = x.shape[0]
        if t > ws.logits.shape[0]:
            raise ValueError(f"logits for {t} rows requested; the workspace holds {ws.logits.shape[0]}")
        head = self.w.mat(lm_head_name(cfg))
        # a split model: this rank's vocabulary rows, then every rank's into ws.logits
        out = ws.logits[:t] if self.comm is None else self.comm.part[:t]
        ld = out.strides[0] // 4
        mma = self._big_mma(t) or self._head_mma(t)
        h, norm, q8 = self._normed(x, "output_norm.weight", [head], mma)
        if mma:
            LM.mma(self.k, [head], [(out.data.ptr, ld)], [None], self.ws.x16.data.ptr, self.ws.x16.strides[0] // 2,
                  t, 0, self.ws.split)
        else:
            for s in range(0, t, L.MAX_MMV_TOKENS):
                n = min(L.MAX_MMV_TOKENS, t - s)
                L.mmv(self.k, [head], [(out[s:].data.ptr, ld)], [None], h[s:].data.ptr, h.strides[0] // 4, n, 0,
                      norm=norm, q8=q8, config=self.tune.mmv_override("HEAD"),
                      kstage="head" in self.tune.kstage)  # q8 only when t <= MAX_MMV_TOKENS
        if self.comm is not None:
            out = ws.logits[:t]
            self.comm.gather_logits(t, out)
            ld = out.strides[0] // 4
        if cfg.final_softcap:
            LL.softcap(self.k, out.data.ptr, ld, cfg.n_vocab, t, cfg.final_softcap)
        return out
