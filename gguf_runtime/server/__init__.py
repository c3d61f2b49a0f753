"""`gguf-run serve`: an Ollama- and OpenAI-compatible HTTP server with continuous batching.

Layout: ``scheduler`` runs the model on one thread, admitting requests between decode steps;
``adapters`` put the CUDA backend's batch API (many sequences per step) and the numpy backend (one
sequence at a time) behind one small interface; ``service`` connects HTTP requests to scheduler
jobs (tokenizing off the event loop, streaming, disconnects); ``app`` holds the routes,
``schemas`` the request validation and model card, ``formats`` the response bodies.
``app`` and ``service`` need the ``serve`` extra (starlette, uvicorn); the rest needs neither.
"""

from __future__ import annotations

from .adapters import CudaAdapter, NoRoom, NumpyAdapter, make_adapter
from .scheduler import Job, Scheduler, StopMatcher

__all__ = ["CudaAdapter", "Job", "NoRoom", "NumpyAdapter", "Scheduler", "StopMatcher", "make_adapter"]
