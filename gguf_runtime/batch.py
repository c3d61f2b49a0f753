"""Running several sequences at once on the CUDA backend's batch graphs."""

from __future__ import annotations

from typing import Sequence

from .backend_cuda import LOOKAHEAD, RING
from .sampling import SamplingParams


def generate_batch(backend, prompts: Sequence[Sequence[int]], n_new: int,
                   params: SamplingParams | Sequence[SamplingParams],
                   seeds: Sequence[int | None] | None = None, slots: Sequence[int] | None = None,
                   bucket: int | None = None) -> list[list[int]]:
    """Every prompt in its own slot, ``n_new`` tokens each, decoded together (no stop tokens).

    ``slots`` picks the slots (default 0, 1, ...); ``bucket`` forces the step size (default: the
    smallest bucket holding the highest slot). Slots are released at the end.
    """
    slots = list(slots) if slots is not None else list(range(len(prompts)))
    plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    seeds = list(seeds) if seeds is not None else [None] * len(prompts)
    width = bucket or (max(slots) + 1)
    ev = backend._events
    try:
        for s, p, pr, seed in zip(slots, prompts, plist, seeds):
            backend.seq_add(s, p, pr, n_new, seed)
        ev[0].record(backend.stream)
        out: list[list[int]] = [[] for _ in slots]
        issued = 0
        for i in range(n_new):
            while issued < min(i + LOOKAHEAD, n_new - 1):
                backend.batch_step(width)
                issued += 1
                ev[issued % RING].record(backend.stream)
            ev[i % RING].synchronize()
            for j, s in enumerate(slots):
                out[j].append(backend.seq_token(s, i))
        return out
    finally:
        backend.stream.synchronize()
        for s in slots:
            backend.seq_release(s)
