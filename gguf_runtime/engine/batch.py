"""Running several sequences at once on the CUDA backend's batch graphs."""

from __future__ import annotations

from typing import Sequence

from ..sampling import SamplingParams
from .decode_loop import LaunchAhead


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
    loop = LaunchAhead(backend, backend.tune.lookahead, launch=lambda: backend.batch_step(width))
    try:
        for s, p, pr, seed in zip(slots, prompts, plist, seeds):
            backend.seq_add(s, p, pr, n_new, seed)
            loop.admit(s, n_new)
        out: dict[int, list[int]] = {s: [] for s in slots}
        while loop.pending():
            for s, toks in loop.step().items():
                out[s] += toks
        return [out[s] for s in slots]
    finally:
        backend.stream.synchronize()
        for s in slots:
            backend.seq_release(s)
