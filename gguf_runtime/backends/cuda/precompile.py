"""Compile every kernel a model launches at load, one NVRTC pass per source file, so that no
kernel compiles on the first token or inside a graph capture.

The list is not derived from the dispatch rules: the backend's own calls run once against a
recording launcher (``Kernels.record``), which notes each kernel a launch would use and runs
nothing: every decode step size and sampling mode (and deep batch steps), a sequence's start, prompt
chunks of 1 to MAX_MMV_TOKENS rows and a full chunk (with and without every row's logits), and the
f16 copies of the cuBLAS prefill.
"""

from __future__ import annotations

from typing import Sequence

from ...quant_kernels import launch_sampling as LS
from ...quant_kernels import launchers as L

MODES = ((True, False), (True, True), (False, False), (False, True))  # (greedy, penalty) samplers


class _NoGemm:
    """cuBLAS while recording: the products are not kernels of ours and compute nothing here."""

    def wt_x(self, *args) -> None:
        pass


def precompile(backend, buckets: Sequence[int]) -> None:
    """Record the kernels of every call the backend can make, compile them, make the f16 copies."""
    blocks, k = backend.blocks, backend.kernels
    blocks.load_f16()
    gemm, blocks.gemm = blocks.gemm, (_NoGemm() if blocks.gemm is not None else None)
    k.record()
    try:
        with backend.stream:
            for rows in (b for b in buckets if b <= backend.max_batch):
                for mode in MODES:
                    backend._step(rows, mode)
                if backend._deep_bucket(rows):  # its deep steps' attention (tiles_max_keys)
                    backend._step(rows, MODES[0], deep=True)
            LS.prime_slots(k, 0, 1, backend.sampler_state)  # every admission's (records only)
            LS.row_logprobs(k, 0, 0, 0, backend.sampler_state, 1)  # a step with logprobs
            LS.chosen_logprob(k, 0, 0, backend.sampler_state, 1)
            LS.apply_mask(k, 0, 0, 1, 0, backend.sampler_state, 1)  # a step with a grammar
            LS.rows_argmax(k, 0, 0, 0, 1, 0)  # speculative decoding's greedy verification
            LS.commit_token(k, backend.sampler_state, 0, 0)  # ... and its fall-back's start
            LS.finite_rows(k, 0, 0, 0, 1, 0)
            for rows in range(1, backend.verify_rows + 1):  # verification steps on the decode kernels
                backend._verify_rows(rows)
            chunk = backend.ws.max_rows
            for rows in [*range(1, L.MAX_MMV_TOKENS + 1), chunk] if chunk > L.MAX_MMV_TOKENS else range(1, chunk + 1):
                for all_logits in (False, True):
                    backend._prefill_rows(min(rows, backend.ws.logits.shape[0]) if all_logits else rows,
                                          all_logits)
            if backend.max_batch > 1 and backend.part_align():  # the server's packed prompts (16-row flash blocks)
                backend._packed_rows(max(2 * backend.part_align(), backend.tune.prefill_quantum))
            if blocks.f16 is not None:
                blocks.f16.fill()
    finally:
        blocks.gemm = gemm
        k.compile_recorded()
    if blocks.f16 is not None:
        with backend.stream:
            blocks.f16.fill()
