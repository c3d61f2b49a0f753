"""The shape twins the GPU tests run on (real headers, random weights; `make twins` makes them)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TWINS = ("smollm2", "gemma3")
TWIN_DIR = Path(__file__).resolve().parent.parent / "build" / "twins"  # where `make twins` writes them


def twin_path(name: str) -> str:
    """The twin ``name`` in GGUF_TWIN_DIR, else build/twins. A missing twin fails the test: a GPU
    test must not pass by skipping what it was written to check."""
    path = Path(os.environ.get("GGUF_TWIN_DIR") or TWIN_DIR) / f"{name}.gguf"
    if not path.is_file():
        pytest.fail(f"no {name} twin at {path}: `make twins` makes it from twins/{name}.hdr.gguf "
                    "(`make twin-headers` writes those where the test packages are installed), "
                    "or set GGUF_TWIN_DIR to a folder that holds it", pytrace=False)
    return str(path)
