"""`gguf-run serve`: an Ollama- and OpenAI-compatible HTTP server with continuous batching.

``app`` (routes, request/response shapes) runs on the event loop; ``scheduler`` runs the model
on one thread, admitting requests between decode steps; ``adapters`` put the CUDA backend's batch
API (many sequences per step) and the numpy backend (one sequence at a time) behind one interface.
Needs the ``serve`` extra (starlette, uvicorn); this package imports them only when used.
"""

from __future__ import annotations

from .adapters import CudaAdapter, NoRoom, NumpyAdapter, make_adapter
from .scheduler import Job, Scheduler, StopMatcher

__all__ = ["CudaAdapter", "Job", "NoRoom", "NumpyAdapter", "Scheduler", "StopMatcher", "make_adapter"]
