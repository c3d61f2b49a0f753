"""Capture a step function into CUDA graphs, keyed by shape, and replay them.

The caller owns every buffer the step touches (allocated before capture: a graph must not
allocate) and makes the step read all per-call inputs from device memory. ``capture`` runs the
step eagerly first (module loading, cuBLAS handles and lazily created state happen then), then
records it on a non-blocking stream with ``Stream.begin_capture``/``end_capture``. Keys are
captured largest first by ``capture_all``; all graphs draw on CuPy's one device memory pool, and
a capture that allocates from it is refused, since the pool would never get that memory back.
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterable

import cupy as cp

from .held import launch_graph


class CaptureError(RuntimeError):
    pass


class GraphManager:
    def __init__(self, stream: cp.cuda.Stream, warmup: int = 1) -> None:
        self.stream = stream
        self.warmup = warmup
        self.graphs: dict[Hashable, cp.cuda.Graph] = {}
        self.launches = 0  # graph launches so far (tests count host launches per token)

    def capture(self, key: Hashable, step: Callable[[], None],
                before_warmup: Callable[[], None] | None = None,
                after_warmup: Callable[[], None] | None = None, warmup: int | None = None) -> cp.cuda.Graph:
        """Warm up ``step`` eagerly (``warmup`` runs, default the manager's), then capture it as the
        graph for ``key``.

        ``before_warmup``/``after_warmup`` let the caller save and restore the state the warm-up
        changes (it really runs). Raises CaptureError if the step fails to capture or allocates.
        """
        pool = cp.get_default_memory_pool()
        with self.stream:
            if before_warmup:
                before_warmup()
            for _ in range(self.warmup if warmup is None else warmup):
                step()
            if after_warmup:
                after_warmup()
        self.stream.synchronize()
        used = pool.used_bytes()
        with self.stream:
            self.stream.begin_capture()
            try:
                step()
            except Exception as e:
                try:
                    self.stream.end_capture()
                except Exception:
                    pass
                raise CaptureError(f"capture failed: {type(e).__name__}: {e}") from e
            graph = self.stream.end_capture()
        if pool.used_bytes() != used:
            raise CaptureError("the step allocated device memory during capture")
        graph.upload(self.stream)
        self.graphs[key] = graph
        return graph

    def capture_all(self, keys: Iterable[Hashable], make_step: Callable[[Hashable], Callable[[], None]],
                    size: Callable[[Hashable], int] = lambda k: 0, **hooks) -> list[Hashable]:
        """Capture every key, largest first; returns the keys that failed (they run eagerly)."""
        failed = []
        for key in sorted(keys, key=size, reverse=True):
            try:
                self.capture(key, make_step(key), **hooks)
            except CaptureError:
                failed.append(key)
        return failed

    def has(self, key: Hashable) -> bool:
        return key in self.graphs

    def replay(self, key: Hashable) -> None:
        launch_graph(self.graphs[key], self.stream)  # (keeping the GIL: held.py)
        self.launches += 1

    def clear(self) -> None:
        self.graphs.clear()
