"""User-facing errors.

Every error a user can cause (a bad file, an unsupported model, a prompt too long, a missing GPU)
is a ``GGUFRunError``: its message is one line that names the problem and what to do. The CLI
prints that line and exits with code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` with control characters (newlines, escape sequences, bidi overrides) escaped: what a
    model file or a client wrote must not drive a terminal or break a one-line message."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 256 else f"\\u{ord(m.group()):04x}",
                        text)


class GGUFRunError(Exception):
    """Base class of every error caused by input rather than by a bug; its message is always one
    printable line (control characters from the input are escaped)."""

    exit_code = 2

    def __init__(self, message: object = "", *args: object) -> None:
        super().__init__(printable(str(message)), *args)


class GGUFError(GGUFRunError):
    """A GGUF file is malformed, truncated or hostile."""


class UnsupportedModelError(GGUFRunError):
    """A well-formed file whose architecture or tensor types this runtime cannot run."""


class ContextOverflowError(GGUFRunError):
    """A prompt (or prompt plus generation) longer than the context."""


class TemplateError(GGUFRunError):
    """A chat template failed to render or tried to escape its sandbox."""


class GrammarError(GGUFRunError):
    """A JSON schema or grammar for structured output that the grammar engine cannot use."""


class BackendError(GGUFRunError):
    """The requested backend cannot run here (no GPU, no CuPy, out of GPU memory)."""


class KVCacheFullError(BackendError):
    """No free KV-cache pages for a sequence right now (a server queues it; a CLI raises the context)."""
