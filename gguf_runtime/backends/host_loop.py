"""The host-side sampling loop of backends that return logits (numpy; CUDA for samplers the GPU lacks)."""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from ..errors import GGUFError
from ..sampling import Sampler, SamplingParams

NOT_FINITE = "the model's logits are not finite (NaN or infinity): the file's weights are damaged; re-download it"


def host_sample_loop(backend, n: int, params: SamplingParams, history: list[int],
                     stop: frozenset[int], logits=None, constraint=None,
                     on_token: Callable[[np.ndarray, int], None] | None = None) -> Iterator[int]:
    """Sample from the logits the backend returned (``logits``, or its host ``last_logits``),
    yield, evaluate the token (``backend.eval`` returns host logits), repeat. ``constraint``
    (engine.constraint.Constraint): only the tokens its grammar allows are drawn. ``on_token(logits,
    token)`` sees each token with the raw logits it was drawn from (before the grammar's mask),
    before it is yielded (the server's logprobs).

    The last token yielded is not evaluated (the caller decides whether it is kept).
    """
    sampler = Sampler(params)
    hist = list(history)
    logits = backend.last_logits if logits is None else logits
    for i in range(n):
        if not np.isfinite(logits).all():  # (no stage makes a logit infinite: the weights did)
            raise GGUFError(NOT_FINITE)
        raw = logits
        if constraint is not None:
            logits = constraint.apply(logits)
            if not np.isfinite(logits).any():  # the grammar allows nothing more (it ended)
                return
        tok = sampler.sample(logits, hist)
        if on_token is not None:
            on_token(raw, tok)
        if constraint is not None and tok not in stop:
            constraint.advance(tok)
        yield tok
        if tok in stop or i == n - 1:
            return
        hist.append(tok)
        logits = backend.eval([tok])[-1]
