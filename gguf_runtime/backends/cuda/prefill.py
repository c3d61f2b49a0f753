"""Prompt evaluation on the CUDA backend, in chunks of up to the workspace's rows.

A chunk of more than MAX_MMV_TOKENS rows runs padded in front to a multiple of the tuning table's prefill_quantum rows
(padding rows belong to sequence -1 and write nothing), so a padded size always launches the same
kernels. Its first run is eager and doubles as the warm-up; from its second run on it is a CUDA
graph (one per padded size and logits mode), which takes the host's launch cost out of prefill:
hundreds of Python launches per chunk for a small model's 30 layers. Smaller chunks with every
row's logits (sampled speculative decoding's verification: the last token and its proposals) are
graphed the same way from their second run. Several sequences' prompt parts packed in one forward
(the server's admissions) are graphed the same way, one graph per padded size: their rows padded at
the end to a multiple of prefill_quantum, their last rows' indices in a device buffer, the head
always over 64 rows. Greedy verification (verify_many, eval_argmax) runs a decode step's kernels
over up to verify_rows tokens, a graph per row count (capture_verify makes them all at once).
"""

from __future__ import annotations

from typing import Sequence

import cupy as cp
import numpy as np

from ...errors import ContextOverflowError
from ...graphs import held
from ...graphs.manager import CaptureError
from ...model import forward, layers
from ...quant_kernels import launch_attention as LA
from ...quant_kernels import launch_sampling as LS
from ...quant_kernels import launchers as L

PACK_HEAD = 64  # rows of the head after a packed forward (the most parts it holds)
ID_RING = 4  # pinned staging buffers of a forward's token ids, positions and sequences (used in turn)

class PrefillMixin:
    """``eval``/``prefill``/``truncate`` of CudaBackend (its attributes: ws, kv, blocks, graphs,
    stream, use_graph, prefill_graph, pack_graph, slot_len, note, _pack_last, _pack_x; its
    ``_with_pdl`` for the captured step and ``_decode_forward`` for verification)."""

    verify_rows = L.MAX_MMV_TOKENS  # the most tokens a verification step takes (_verify_rows)

    @property
    def n_past(self) -> int:
        return self.slot_len[0]

    @n_past.setter
    def n_past(self, n: int) -> None:
        self.slot_len[0] = n

    def truncate(self, n: int) -> None:
        self.slot_len[0] = min(self.slot_len[0], n)

    def _check_room(self, slot: int, n: int) -> None:
        """ContextOverflowError unless n more tokens fit the slot's pages."""
        if self.slot_len[slot] + n > self.kv.capacity(slot):
            raise ContextOverflowError(f"{self.slot_len[slot] + n} tokens do not fit the context of "
                                       f"{self.kv.capacity(slot)}; raise --ctx-size or shorten the input")

    def eval(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Append tokens to slot 0; host copy of the last (or every) token's logits."""
        out = self._eval(0, tokens, all_logits)
        return cp.asnumpy(out, stream=self.stream)

    def eval_argmax(self, tokens: Sequence[int], slot: int = 0) -> np.ndarray:
        """eval with every row's logits, returning each row's argmax (ties: lowest id) computed on
        the device: speculative decoding's greedy verification copies a few ints, not the rows. Up
        to verify_rows tokens: a verification step (verify_many's, its rows' logits left in
        ws.logits[:n]); more: prompt chunks, then the argmaxes."""
        n = len(tokens)
        if 0 < n <= self.verify_rows:
            return self.verify_many([(slot, tokens)])[0]
        self._argmax_buffers()
        out = self._eval(slot, tokens, all_logits=True)
        with self.stream:
            LS.rows_argmax(self.kernels, out.data.ptr, out.strides[0] // 4, self.cfg.n_vocab, n,
                           self._argmax_out.data.ptr)
        return self._read_argmax(n)

    def _read_argmax(self, n: int) -> np.ndarray:
        """The first n of _argmax_out, through pinned memory (the stream waited for)."""
        cp.cuda.runtime.memcpyAsync(self._argmax_host.ctypes.data, self._argmax_out.data.ptr, 4 * n,
                                    cp.cuda.runtime.memcpyDeviceToHost, self.stream.ptr)
        self.stream.synchronize()
        return self._argmax_host[:n].copy()

    def _argmax_buffers(self) -> None:
        """The rows' argmaxes on the device (_argmax_out) and their pinned host copy (made once,
        before any capture)."""
        if getattr(self, "_argmax_out", None) is None:
            self._argmax_out = cp.zeros(self.ws.logits.shape[0], cp.int32)
            self._argmax_pin = cp.cuda.alloc_pinned_memory(4 * self.ws.logits.shape[0])
            self._argmax_host = np.frombuffer(self._argmax_pin, np.int32, self.ws.logits.shape[0])

    def _verify_argmax(self, rows: int) -> None:
        """A verification step (_verify_rows) and its rows' argmaxes into _argmax_out."""
        self._verify_rows(rows)
        logits = self.ws.logits
        LS.rows_argmax(self.kernels, logits.data.ptr, logits.strides[0] // 4, self.cfg.n_vocab, rows,
                       self._argmax_out.data.ptr)

    def _eval(self, slot: int, tokens: Sequence[int], all_logits: bool) -> cp.ndarray:
        n, past = len(tokens), self.slot_len[slot]
        self._check_room(slot, n)
        if all_logits and n > self.ws.logits.shape[0]:
            raise ValueError(f"all_logits is limited to {self.ws.logits.shape[0]} tokens per call on the GPU")
        ids = np.asarray(tokens, np.int32)
        with self.stream:
            for s in range(0, n, self.ws.max_rows):
                part = ids[s:s + self.ws.max_rows]
                logits = self._chunk(slot, part, past, all_logits and s + part.shape[0] >= n)
                past += part.shape[0]
                self.slot_len[slot] = past
        self.last_logits = logits
        return logits

    def _chunk(self, slot: int, part: np.ndarray, past: int, all_logits: bool) -> cp.ndarray:
        """Run one chunk of a prompt at positions past, past + 1, ...; its logits (the last row's,
        or every row's), padded and graphed as the module says."""
        ws = self.ws
        rows, pad = self._stage(slot, part, past, ws.logits.shape[0] if all_logits else ws.max_rows)
        # graphs from a size's second run, small chunks too: sampled speculative decoding's verification
        # steps repeat those sizes every step, and so do the few tokens a cached prefix leaves of a prompt
        # (a split model's small chunks without every row's logits stay eager: _small_graphs)
        self._run_graphed(("prefill", rows, all_logits), lambda: self._prefill_rows(rows, all_logits), rows,
                          rows > L.MAX_MMV_TOKENS or all_logits or self._small_graphs())
        return ws.logits[pad:rows] if all_logits else ws.logits[:1]

    def _run_graphed(self, key: tuple, run, rows: int, graphable: bool, flag: str = "prefill_graph",
                     what: str = "the prefill") -> None:
        """run() eagerly on a key's first call, from its second as a captured graph (``graphable``,
        graphs on and the attribute ``flag`` true; a failed capture turns ``flag`` off, noting
        ``what`` runs eagerly from then on)."""
        seen = self._prefill_runs.get(key, 0)
        self._prefill_runs[key] = seen + 1
        graph = graphable and self.use_graph and getattr(self, flag) and seen > 0
        if graph and not self.graphs.has(key):
            try:  # the eager first run was its warm-up
                self.graphs.capture(key, self._with_pdl(run, rows), warmup=0)
            except CaptureError as e:
                setattr(self, flag, False)
                graph = False
                if self.note:
                    self.note(f"warning: CUDA graph capture of {what} failed ({e}); evaluating it eagerly")
        if graph:
            self.graphs.replay(key)
        else:
            run()

    def capture_packed(self, max_rows: int) -> int:
        """The packed-prompt graphs (_forward_parts) of every padded size up to ``max_rows`` captured
        now, each after its eager warm-up run, so that a server's waves of prompts do not pay for a
        new size's eager run and capture mid-serving. The runs are padding alone (sequence -1, as
        the rows past a real forward's last part): no cache writes, no slot's length. Returns the
        sizes captured (0 where packed forwards are not graphed)."""
        if not (self.use_graph and self.pack_graph and self.part_align()):
            return 0
        q, top = self.tune.prefill_quantum, min(max_rows, self.ws.max_rows)
        sizes = sorted({min(r, self.ws.max_rows) for r in range(q, top + q, q)})
        self._pack_last.set(np.zeros(PACK_HEAD, np.int32), stream=self.stream)
        return sum(self._capture_ahead(("packed", r), lambda r=r: self._packed_rows(r), r, flag="pack_graph",
                                       what="packed prompts") for r in sizes)

    def _capture_ahead(self, key: tuple, run, rows: int, pos=0, seq=-1, flag: str = "prefill_graph",
                       what: str = "the prefill") -> bool:
        """``key``'s graph captured now, after its eager warm-up run (_run_graphed): ``run`` over
        ws.tokens/pos/seq[:rows] staged as token 0 at positions ``pos`` of sequence ``seq`` (-1:
        padding, which writes nothing). Whether the graph is there (the attribute ``flag`` turns
        false where a capture fails)."""
        while getattr(self, flag) and not self.graphs.has(key):  # (eager, then captured)
            host = self._ids_host()
            host[0, :rows], host[1, :rows], host[2, :rows] = 0, pos, seq
            with self.stream:
                self._upload_ids(rows)
                self._run_graphed(key, run, rows, True, flag, what)
        return self.graphs.has(key)

    def _small_graphs(self) -> bool:
        """Whether a chunk of up to MAX_MMV_TOKENS rows with its last row's logits is graphed: not on a
        split model, where the GPU suite's two-GPU tests failed with it (a greedy token apart, then a
        launch failure) and passed without it."""
        return getattr(self, "comm", None) is None

    def capture_small(self) -> int:
        """The graphs of a chunk of 1 .. MAX_MMV_TOKENS rows (the matvec path, the last row's logits)
        captured now, each after its eager warm-up run: the server's admission of a prompt whose
        cached prefix leaves that few tokens, alone in its step, is one of these, and an eager run
        holds the decode steps back for hundreds of launches. The runs are padding alone (sequence
        -1: no cache writes, no slot's length). Returns the sizes captured."""
        if not (self.use_graph and self.prefill_graph and self._small_graphs()):
            return 0
        return sum(self._capture_ahead(("prefill", r, False), lambda r=r: self._prefill_rows(r, False), r)
                   for r in range(1, L.MAX_MMV_TOKENS + 1))

    def capture_verify(self, slot: int = 0) -> None:
        """Every verification step's graph (1 .. verify_rows rows) captured now, each after its
        eager warm-up run, so that speculation's first steps of each size do not pay for them
        mid-answer. The runs evaluate token 0 at ``slot``'s next positions without counting them
        into its length (a later step overwrites those cache rows; a slot without pages has its
        writes skipped). Nothing where graphs are off or the positions would leave the slot's table."""
        if not (self.use_graph and self.prefill_graph):
            return
        past = self.slot_len[slot]
        todo = [r for r in range(1, self.verify_rows + 1) if not self.graphs.has(("verify", r))]
        if not todo or past + self.verify_rows > self.kv.max_pages * self.kv.page_size:
            return
        self._argmax_buffers()
        for r in todo:
            self._capture_ahead(("verify", r), lambda r=r: self._verify_argmax(r), r, np.arange(past, past + r), slot)
        self.stream.synchronize()

    def verify_many(self, parts: Sequence[tuple[int, Sequence[int]]]) -> list[np.ndarray]:
        """Several slots' verification rows in one step (at most verify_rows in all): part (slot,
        tokens) evaluates its tokens at the slot's next positions on the decode kernels (eval_argmax:
        one part); each part's rows' argmaxes. Each slot's length advances past its
        tokens; ``_verify_base`` keeps where each started (seq_commit)."""
        rows = sum(len(t) for _, t in parts)
        if not 0 < rows <= self.verify_rows:
            raise ValueError(f"{rows} verification rows: 1 to {self.verify_rows} a step")
        self._argmax_buffers()
        host, r = self._ids_host(), 0
        for slot, toks in parts:
            n, past = len(toks), self.slot_len[slot]
            self._check_room(slot, n)
            host[0, r:r + n], host[1, r:r + n], host[2, r:r + n] = toks, np.arange(past, past + n), slot
            self._verify_base[slot], r = past, r + n
        with self.stream:
            self._upload_ids(rows)
            self._run_graphed(("verify", rows), lambda: self._verify_argmax(rows), rows, True)
        for slot, toks in parts:
            self.slot_len[slot] += len(toks)
        got, out, r = self._read_argmax(rows), [], 0
        for _, toks in parts:
            out.append(got[r:r + len(toks)])
            r += len(toks)
        return out

    def _stage(self, slot: int, part: np.ndarray, past: int, cap: int) -> tuple[int, int]:
        """ws.tokens / pos / seq of a chunk at positions past, past + 1, ... of ``slot``, padded in
        front (sequence -1) to a multiple of prefill_quantum past the matvec rows, at most ``cap``
        rows (t fits it: the callers check); (rows, pad)."""
        t, ws = part.shape[0], self.ws
        q = self.tune.prefill_quantum
        rows = t if t <= L.MAX_MMV_TOKENS else min(-(-t // q) * q, ws.max_rows, cap)
        pad = rows - t
        host = self._ids_host()
        host[0, :pad], host[0, pad:rows] = 0, part
        host[1, :pad], host[1, pad:rows] = past + t, np.arange(past, past + t)
        host[2, :pad], host[2, pad:rows] = -1, slot
        self._upload_ids(rows)
        return rows, pad

    def _ids_host(self) -> np.ndarray:
        """The next pinned staging rows of ws.tokens / pos / seq ([3, max_rows] int32, one of
        ID_RING), free to write: the copies of the upload that used them last have run (the host
        waits only where ID_RING uploads are still queued)."""
        if getattr(self, "_ids_ring", None) is None:
            n = self.ws.max_rows
            self._ids_pin = cp.cuda.alloc_pinned_memory(ID_RING * 3 * 4 * n)
            self._ids_ring = np.frombuffer(self._ids_pin, np.int32, ID_RING * 3 * n).reshape(ID_RING, 3, n)
            self._ids_done = [None] * ID_RING
            self._ids_at = 0
        self._ids_at = (self._ids_at + 1) % ID_RING
        if (done := self._ids_done[self._ids_at]) is not None:
            done.synchronize()
        return self._ids_ring[self._ids_at]

    def _upload_ids(self, rows: int) -> None:
        """ws.tokens / pos / seq[:rows] from the staging rows _ids_host gave: three asynchronous
        copies from pinned memory on the stream (each copy from a pageable array was staged first)."""
        host, ws = self._ids_ring[self._ids_at], self.ws
        for i, dst in enumerate((ws.tokens, ws.pos, ws.seq)):
            held.copy_to_device(dst.data.ptr, host[i].ctypes.data, 4 * rows, self.stream)
        if self._ids_done[self._ids_at] is None:
            self._ids_done[self._ids_at] = held.Event()
        self._ids_done[self._ids_at].record(self.stream)

    # ---- several sequences' prompt parts in one forward -------------------------------------------
    def part_align(self) -> int:
        """Rows each part of a several-sequence forward starts at a multiple of: the query block of
        the flash prefill kernel those forwards launch (the tuning table's serve_pack_rows, else the
        kernel's rule; its contract: a block's rows are one sequence's); 0 where prompt chunks do
        not take that kernel (then parts run one by one)."""
        b, cfg = self.blocks, self.cfg
        if not (self.tune.flash or b.flash_only) or not LA.flash_ok(cfg.head_dim, cfg.head_dim_v,
                                                                   cfg.n_head // cfg.n_head_kv):
            return 0
        return self.tune.serve_pack_rows or 16 * LA.flash_config(cfg.head_dim, cfg.n_head // cfg.n_head_kv,
                                                                 self.kv.kv_type, self.kernels.knobs.flash)[0]

    def part_rows(self, n: int) -> int:
        """Rows a part of n tokens takes in a several-sequence forward (padded to part_align)."""
        a = self.part_align()
        return -(-n // a) * a if a else n

    def _forward_parts(self, parts: Sequence[tuple[int, Sequence[int]]]) -> cp.ndarray:
        """The next tokens of several slots' prompts in one forward: part i's rows padded in front
        (sequence -1) to a multiple of part_align, so no query block of the flash kernel holds two
        sequences, the whole padded at the end to a multiple of prefill_quantum (a graph per size
        from its second run, as a chunk's); returns the logits of each part's last token
        (ws.logits[:len(parts)])."""
        ws, align = self.ws, self.part_align()
        assert align and 1 < len(parts) <= min(64, ws.logits.shape[0])
        toks, pos, seq, last = [], [], [], []
        for slot, tokens in parts:
            t, past = len(tokens), self.slot_len[slot]
            if not t:
                raise ValueError("an empty prompt part")
            self._check_room(slot, t)
            pad = -t % align
            toks += [0] * pad + list(tokens)
            pos += [past + t] * pad + list(range(past, past + t))
            seq += [-1] * pad + [slot] * t
            last.append(len(toks) - 1)
        if len(toks) > ws.max_rows:
            raise ValueError(f"{len(toks)} rows of prompt parts exceed the workspace's {ws.max_rows}")
        q = self.tune.prefill_quantum
        rows = min(-(-len(toks) // q) * q, ws.max_rows)  # (a multiple of part_align: whole flash blocks of -1)
        pad = rows - len(toks)
        host = self._ids_host()
        host[0, :rows], host[1, :rows], host[2, :rows] = toks + [0] * pad, pos + [0] * pad, seq + [-1] * pad
        self._upload_ids(rows)
        self._pack_last.set(np.asarray(last + [last[-1]] * (PACK_HEAD - len(last)), np.int32), stream=self.stream)
        with self.stream:
            self._run_graphed(("packed", rows), lambda: self._packed_rows(rows), rows, True, "pack_graph",
                              "packed prompts")
        for slot, tokens in parts:
            self.slot_len[slot] += len(tokens)
        self.last_logits = logits = ws.logits[:len(parts)]
        return logits

    def _packed_rows(self, rows: int) -> cp.ndarray:
        """The model over ws.tokens/pos/seq[:rows] with part_align-row flash blocks; logits of the
        rows _pack_last names: the head over those 64 rows as a decode step of 64 runs it (kernels
        compiled at load; one head size, so one graph per row count)."""
        b = self._prefill_mode()
        b.flash_rows = self.part_align()
        try:
            x = layers(b, self.cfg, self.ws.tokens[:rows], self.ws.pos[:rows])
        finally:
            b.flash_rows = 0
        cp.take(x, self._pack_last, axis=0, out=self._pack_x)
        b.mma, b.decode, b.mmv_rows = PACK_HEAD > b.decode_mmv_rows, True, b.decode_mmv_rows
        return b.logits(self._pack_x)

    def _prefill_mode(self):
        """The blocks set for a prompt chunk (one sequence's rows, matvecs up to MAX_MMV_TOKENS)."""
        b = self.blocks
        b.seq, b.mma, b.decode = self.ws.seq, False, False
        b.mmv_rows = L.MAX_MMV_TOKENS
        return b

    def _prefill_rows(self, rows: int, all_logits: bool) -> None:
        """The model over ws.tokens/pos/seq[:rows] (logits into ws.logits); a short chunk of a model
        whose f16 copies are not resident on the tensor-core products (tuning: prefill_mma_rows)."""
        b = self._prefill_mode()
        b.mma = (L.MAX_MMV_TOKENS < rows <= self.tune.prefill_mma_rows and self.ws.mma_part.size > 1
                 and not (b.f16 is not None and b.f16.resident))
        forward(b, self.cfg, self.ws.tokens[:rows], self.ws.pos[:rows], all_logits=all_logits)

    def _verify_rows(self, rows: int) -> None:
        """ws.tokens/pos/seq[:rows] (consecutive tokens of one sequence) through the kernels of a
        decode step of as many rows, every row's logits into ws.logits: speculative decoding's
        verification. Up to decode_mmv_rows (the int8 matvecs, fused epilogues, flash_decode with
        each row's own splits) a row's logits are a one-row decode step's, bit for bit (tested on
        the small models; a big model's GLU of 2 rows takes one warp a group where one row takes
        two, launchers.glu_q8_out_config, so its sums are ordered otherwise); past them, the batch
        steps' tensor-core products (on big models the int8 matvecs of several rows were far
        slower: bench/RESULTS.md row 153) compute the same values otherwise rounded."""
        self._decode_forward(self.ws.seq, self.ws.tokens[:rows], self.ws.pos[:rows], verify=True)

    def prefill(self, tokens: Sequence[int]) -> None:
        self._eval(0, tokens, all_logits=False)
