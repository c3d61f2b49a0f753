"""User-facing errors.

Every error a user can cause (a bad file, an unsupported model, a prompt too long, a missing GPU)
is a ``GGUFRunError``: its message is one line that names the problem and what to do. The CLI
prints that line and exits with code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class GGUFRunError(Exception):
    """Base class of every error caused by input rather than by a bug."""

    exit_code = 2


class GGUFError(GGUFRunError):
    """A GGUF file is malformed, truncated or hostile."""


class UnsupportedModelError(GGUFRunError):
    """A well-formed file whose architecture or tensor types this runtime cannot run."""


class ContextOverflowError(GGUFRunError):
    """A prompt (or prompt plus generation) longer than the context."""


class TemplateError(GGUFRunError):
    """A chat template failed to render or tried to escape its sandbox."""


class BackendError(GGUFRunError):
    """The requested backend cannot run here (no GPU, no CuPy, out of GPU memory)."""


class KVCacheFullError(BackendError):
    """No free KV-cache pages for a sequence right now (a server queues it; a CLI raises the context)."""
